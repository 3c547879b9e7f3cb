"""The client side of a streamed request: one HTTP connection pool and two stream readers.

Adapters build the request body and read each event; these functions do the transport and stamp every
event's arrival time *before* it is parsed. ``client`` is whatever :func:`open_client` returns: adapters
pass it through and never use it directly, so the transport can change without touching them.

The transport is aiohttp (its C HTTP parser), JSON is orjson; the load generator runs on uvloop where it
is installed (:func:`bench.load.common.run_async`). Each read from the socket is stamped once with ``time.perf_counter()``; the
events in it are then split out and parsed, so every event of one read gets the time the read returned.
``bench/client_bench.py`` measures how accurate and how fast this is (README: "How accurate and fast is
the client").

A stream that ends early never looks complete: an incomplete chunked body raises
``aiohttp.ClientPayloadError`` (one of :data:`TRANSPORT_ERRORS`); a body that stops inside an event, or
that ends (connection closed) before its final event, gets ``result.error``. "Final event" means: the
SSE ``data: [DONE]`` line, or any event from which the adapter read the engine's output token count
(``result.output_tokens_reported``), which every adapter reads from its engine's last event.
"""
from __future__ import annotations

import time
from contextlib import asynccontextmanager

import aiohttp
import orjson

from .base import RequestResult

try:  # uvloop: a faster event loop (Linux/macOS); asyncio's own loop otherwise
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
    uvloop = None

#: Exceptions a broken connection or a cut-off stream raises; the load generator turns them into a
#: failed request. (A malformed event raises ValueError, which the load generator reports as such.)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, ConnectionError)

_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream, application/x-ndjson"}
_DONE = b"[DONE]"


@asynccontextmanager
async def open_client(max_connections: int, timeout_s: float):
    """One connection pool for ``max_connections`` concurrent streams (plus a few spare).
    ``timeout_s`` bounds each wait for the server (connect: 10 s); the load generator also bounds each
    whole request."""
    # Keep-alive connections: a new TCP connection per request added ~2 ms to TTFT at concurrency 16
    # (bench/client_bench.py). A server may close an idle one under us: _post retries that case once.
    connector = aiohttp.TCPConnector(limit=max_connections + 4, limit_per_host=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_connect=10.0, sock_read=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        yield session


async def _http_error(response, result: RequestResult) -> RequestResult:
    body = await response.read()
    result.error = f"HTTP {response.status}: {body.decode(errors='replace')[:500]}"
    result.t_done = time.perf_counter()
    return result


#: A reused keep-alive connection the server had already closed fails like this before any response.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def _post(client, url: str, body: dict, result: RequestResult):
    """POST and wait for the response headers. When the server closed the pooled connection the request
    went out on (llama-server does, between requests), retry once on a fresh one; ``result.t_sent`` is
    the send time of the attempt that was answered."""
    payload = orjson.dumps(body)
    try:
        return await client.post(url, data=payload, headers=_JSON_HEADERS)
    except _STALE_CONNECTION:
        result.t_sent = time.perf_counter()
        result.engine_details["resent_on_fresh_connection"] = True
        return await client.post(url, data=payload, headers=_JSON_HEADERS)


def _ended_early(result: RequestResult, done_marker: bool) -> None:
    if not done_marker and result.error is None and result.output_tokens_reported is None:
        result.error = "stream ended before its final event (connection closed early)"


async def stream_sse(client, url: str, body: dict, prompt, handle) -> RequestResult:
    """POST ``body`` and read a server-sent-event stream; ``handle(event, arrival_time, result)`` reads
    each JSON event (one ``data:`` line) into the result."""
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, time.perf_counter())
    perf_counter, loads, JSONDecodeError = time.perf_counter, orjson.loads, orjson.JSONDecodeError
    done_marker = False
    async with await _post(client, url, body, result) as response:
        if response.status != 200:
            return await _http_error(response, result)
        buf = b""
        async for data in response.content.iter_any():
            now = perf_counter()
            if buf:
                data = buf + data
            lines = data.split(b"\n")
            buf = lines.pop()  # the unfinished last line (b"" when the read ended on a newline)
            for line in lines:
                if line[:5] == b"data:":
                    try:  # orjson skips the space after "data:" and a trailing "\r" itself
                        event = loads(line[5:])
                    except JSONDecodeError:
                        payload = line[5:].strip()
                        if payload == _DONE:
                            done_marker = True
                            continue
                        if not payload:
                            continue
                        raise
                    handle(event, now, result)
        result.t_done = perf_counter()
    if buf.strip():
        result.error = result.error or f"stream cut off inside an event: {buf[:200]!r}"
    else:
        _ended_early(result, done_marker)
    return result


async def stream_ndjson(client, url: str, body: dict, prompt, handle) -> RequestResult:
    """POST ``body`` and read a newline-delimited JSON stream (Ollama), one event per line."""
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, time.perf_counter())
    perf_counter, loads = time.perf_counter, orjson.loads
    async with await _post(client, url, body, result) as response:
        if response.status != 200:
            return await _http_error(response, result)
        buf = b""
        now = result.t_sent
        async for data in response.content.iter_any():
            now = perf_counter()
            if buf:
                data = buf + data
            lines = data.split(b"\n")
            buf = lines.pop()
            for line in lines:
                if line.strip():
                    handle(loads(line), now, result)
        result.t_done = perf_counter()
    if buf.strip():  # a last line without its newline: complete if it parses
        try:
            event = loads(buf)
        except orjson.JSONDecodeError:
            result.error = result.error or f"stream cut off inside an event: {buf[:200]!r}"
            return result
        handle(event, now, result)
    _ended_early(result, False)
    return result


def parse_sse_line(line: str | bytes) -> dict | None:
    """One ``data:`` line of a server-sent-event stream as JSON; None for anything else or [DONE]."""
    prefix = b"data:" if isinstance(line, bytes) else "data:"
    if not line.startswith(prefix):
        return None
    payload = line[5:].strip()
    if not payload or payload in ("[DONE]", _DONE):
        return None
    return orjson.loads(payload)


def parse_ndjson_line(line: str | bytes) -> dict | None:
    line = line.strip()
    return orjson.loads(line) if line else None
