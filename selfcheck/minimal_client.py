"""A minimal raw asyncio client for the OpenAI-compatible mock (kvbench.selfcheck.mock_server): what the
ceiling of kvbench's client is measured against (tests/benchmarks/bench_client_ceiling.py), and its TTFT and
ITL error (kvbench.selfcheck.client_bench --minimal).

It does only what any client that times a stream must do, in the leanest way: uvloop, one protocol per
keep-alive connection, httptools for the HTTP framing, one ``perf_counter`` stamp per socket read, the SSE
lines split per HTTP chunk, orjson per ``data:`` line, each chunk's time and ``token_ids`` count kept.
No pool, no timeouts, no adapter, no error handling: it assumes the mock answers every request.
"""
from __future__ import annotations

import asyncio
import time

import httptools
import orjson
import uvloop

perf_counter = time.perf_counter


class _Connection(asyncio.Protocol):
    def __init__(self):
        self.parser = httptools.HttpResponseParser(self)
        self.tail = b""
        self.now = 0.0

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.now = perf_counter()
        self.parser.feed_data(data)

    def on_body(self, body: bytes):
        lines = (self.tail + body if self.tail else body).split(b"\n")
        self.tail = lines.pop()
        for line in lines:
            if line[:5] == b"data:" and line[6:7] == b"{":
                for choice in orjson.loads(line[5:])["choices"]:
                    self.times.append(self.now)
                    self.tokens.append(len(choice["token_ids"]))

    def on_message_complete(self):
        self.done.set_result(None)

    def send(self, request: bytes) -> asyncio.Future:
        self.times, self.tokens, self.tail = [], [], b""
        self.done = asyncio.get_running_loop().create_future()
        self.sent = perf_counter()
        self.transport.write(request)
        return self.done


async def _load(host: str, port: int, requests: int, concurrency: int, output_tokens: int,
                timings: list | None = None) -> tuple[int, float]:
    """(output tokens received, CPU seconds from the first connection to the last answer); each request's
    (send time, chunk times) appended to ``timings`` where given."""
    loop = asyncio.get_running_loop()
    pending = iter(range(requests))
    received = 0

    async def worker():
        nonlocal received
        _, conn = await loop.create_connection(_Connection, host, port)
        for i in pending:
            body = orjson.dumps({"model": "mock", "prompt": [i, 1, 2, 3], "max_tokens": output_tokens, "stream": True})
            await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body))
            received += sum(conn.tokens)
            if timings is not None:
                timings.append((conn.sent, conn.times))
        conn.transport.close()

    cpu0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return received, time.process_time() - cpu0


def run(host: str, port: int, requests: int, concurrency: int, output_tokens: int,
        timings: list | None = None) -> tuple[int, float]:
    return uvloop.run(_load(host, port, requests, concurrency, output_tokens, timings))
