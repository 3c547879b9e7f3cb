"""The streaming client's line buffer (backends/streaming.py): an event that spans many reads costs time
linear in its size. Each read used to be joined onto everything before it and the whole re-split, so one
100 MB SSE event took 13.8 s of TTFT on localhost (quadratic); the time is printed, the bound generous."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from kvbench.backends.streaming import open_client, stream_ndjson, stream_sse
from kvbench.load import run_async
from kvbench.workloads.prompts import Prompt

PROMPT = Prompt("r0", (1, 2, 3), "", 1)
BIG = 100 * 2**20  # one event's text, bytes


async def _serve_once(head: bytes, pieces, client_fn):
    """A server that writes ``head`` then each of ``pieces`` (bytes) to the first request, then closes."""
    async def handler(reader, writer):
        request = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in request.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.write(head)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await client_fn(f"http://127.0.0.1:{port}/v1/completions")


def _read(pieces, reader=stream_sse, content_type=b"text/event-stream"):
    """The events ``reader`` hands over for a close-delimited body of ``pieces``: (event, arrival) each, and
    the request's result."""
    events = []

    def handle(event, now, result):
        events.append((event, now))
        if isinstance(event, dict) and "usage" in event:
            result.output_tokens_reported = event["usage"]["completion_tokens"]

    async def client_fn(url):
        async with open_client(1, 60.0) as client:
            return await reader(client, url, {"prompt": [1, 2, 3]}, PROMPT, handle)

    head = b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\nConnection: close\r\n\r\n"
    result = run_async(_serve_once(head, pieces, client_fn))
    return events, result


def test_a_100_mb_event_is_parsed_in_time_linear_in_its_size():
    text = "x" * BIG
    event = b'data: {"choices": [{"index": 0, "text": "' + text.encode() + b'"}]}\n\n'
    tail = b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n'
    # the server writes it in 64 KiB pieces, as a socket delivers it: about 1,600 reads on the client
    pieces = [event[i:i + 65536] for i in range(0, len(event), 65536)] + [tail]
    t0 = time.perf_counter()
    events, result = _read(pieces)
    took = time.perf_counter() - t0
    ttft = events[0][1] - result.t_sent
    print(f"\n100 MiB SSE event: TTFT {ttft:.2f} s, whole request {took:.2f} s")
    assert result.error is None, result.error
    assert len(events) == 2 and len(events[0][0]["choices"][0]["text"]) == BIG
    assert ttft < 5.0, ttft  # 13.8 s when every read re-joined the whole event


@pytest.mark.parametrize("reader", ["sse", "ndjson"])
def test_lines_split_at_any_read_boundary_come_out_whole_and_in_order(reader):
    """Random cuts of a stream (inside a line, at its newline, several lines per read, a read that is only
    part of a long line): the same events as one read gives, and the unfinished tail stays an error."""
    rng = random.Random(5)
    objs = [{"i": i, "text": "y" * rng.choice([0, 1, 7, 300, 70_000])} for i in range(40)]
    if reader == "sse":
        body = b"".join(b"data: " + json.dumps(o).encode() + rng.choice([b"\n\n", b"\r\n\r\n", b"\n: ping\n\n"])
                        for o in objs) + b"data: [DONE]\n\n"
        read, ctype = stream_sse, b"text/event-stream"
    else:
        body = b"".join(json.dumps(o).encode() + b"\n" for o in objs)
        read, ctype = stream_ndjson, b"application/x-ndjson"
    for trial in range(5):
        cuts = sorted(rng.sample(range(1, len(body)), 60 if trial else 1))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
        events, result = _read(pieces, read, ctype)
        assert [e for e, _ in events] == objs
        if reader == "sse":
            assert result.error is None, result.error  # its [DONE] came
        else:  # no event with the token count: the end is not known to be the end
            assert "stream ended before" in (result.error or ""), result.error
    # a body that stops inside an event, across several reads: the tail is kept and named
    half = json.dumps(objs[3]).encode()
    events, result = _read([b"data: " + half[:5], half[5:20], half[20:40]], stream_sse)
    assert events == [] and result.error.startswith("stream cut off inside an event: b'data: ")
    assert "bytearray" not in result.error
