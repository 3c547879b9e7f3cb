"""The client side of a streamed request: a pool of HTTP/1.1 connections and two stream readers.

Adapters build the request body and read each event; these functions do the transport and stamp every
event's arrival time *before* it is parsed. ``client`` is whatever :func:`open_client` returns: adapters
pass it through and never use it directly, so the transport can change without touching them.

The transport is an asyncio protocol per connection with httptools (llhttp, the HTTP parser uvicorn
uses) doing the HTTP framing in C; JSON is orjson; the load generator runs on uvloop where it is
installed (:func:`kvbench.load.run_async`). Each read from the socket is stamped once with
``time.perf_counter()`` and its events are split out and handed to the adapter right there, in the
protocol's callback: no task switch or buffer copy per token. (aiohttp, the first transport, spent
1.6-2 us of Python per streamed chunk in its stream reader; ``selfcheck/client_bench.py`` measures this one,
README: "How accurate and fast is the client".)

A stream that ends early never looks complete: a connection closed before the response's end (by its
Content-Length or chunked framing) raises :class:`StreamCutOff` (one of :data:`TRANSPORT_ERRORS`); a body
that stops inside an event, or that ends before its final event, gets ``result.error``. "Final event"
means: the SSE ``data: [DONE]`` line, or any event from which the adapter read the engine's output token
count (``result.output_tokens_reported``), which every adapter reads from its engine's last event.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httptools
import orjson

from .types import RequestResult


class StreamCutOff(ConnectionError):
    """The connection closed before the whole response arrived."""


#: Exceptions a broken connection or a cut-off stream raises; the load generator turns them into a
#: failed request. (A malformed event raises ValueError, which the load generator reports as such.)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (OSError, httptools.HttpParserError)

_DONE = b"[DONE]"
perf_counter = time.perf_counter


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time. The response body goes to
    ``body_handler(data, arrival_time)`` (given to :meth:`send`) as it arrives, from inside ``data_received``."""

    def __init__(self, key: tuple[str, int]):
        self.key = key  # (host, port): the pool it returns to
        self.transport = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.used = False  # has carried a request before: the server may have closed it meanwhile
        self._reset()

    def _reset(self):
        self.status = 0
        self.keep_alive = False
        self.framed = False  # Content-Length or chunked: the body has a known end
        self.headers_done = asyncio.get_running_loop().create_future()
        self.done = asyncio.get_running_loop().create_future()
        self.body_handler = None
        self.error_chunks: list[bytes] = []  # the body of a non-200 answer
        self.pending: list[bytes] = []  # body pieces of the current read
        self.failure: BaseException | None = None

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        now = perf_counter()
        try:
            self.parser.feed_data(data)  # body pieces collect in self.pending (one per HTTP chunk)
            if self.pending:
                body = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
                self.pending.clear()
                self.body_handler(body, now)  # one call per read, however many chunks it held
        except httptools.HttpParserCallbackError:
            self._fail(self.failure or StreamCutOff("response handler failed"))
        except httptools.HttpParserError as exc:
            self._fail(exc)
        except Exception as exc:  # the adapter's error (a malformed event): surfaces from the request
            self.failure = exc
            self._fail(exc)

    def connection_lost(self, exc):
        self.closed = True
        if not self.headers_done.done():
            _set_failed(self.headers_done, StreamCutOff("server closed the connection before answering"))
        if not self.done.done():
            if self.headers_done.exception() is None and not self.framed:
                self.done.set_result(None)  # a body without length ends when the connection does
            else:
                _set_failed(self.done, StreamCutOff("connection closed before the end of the response"))

    # --- httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes):
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self):
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes):
        if self.status != 200 or self.body_handler is None:
            self.error_chunks.append(body)
        else:
            self.pending.append(body)

    def on_message_complete(self):
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is over
        if not self.done.done():
            self.done.set_result(None)

    # --- helpers ---------------------------------------------------------------------------------
    def _fail(self, exc: BaseException):
        for future in (self.headers_done, self.done):
            if not future.done():
                _set_failed(future, exc)
        self.close()

    def close(self):
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def send(self, head: bytes, payload: bytes, on_body):
        self._reset()
        self.body_handler = on_body
        self.used = True
        if self.closed or self.transport.is_closing():  # closed between the pool and now
            self.headers_done.set_exception(StreamCutOff("connection closed before the request was sent"))
            return
        self.transport.write(head + payload)


def _set_failed(future: asyncio.Future, exc: BaseException) -> None:
    """Fail ``future``, marked as seen: a request awaits only one of its connection's two futures (or
    none, once it has given up), and asyncio would otherwise warn that the other's error went unread."""
    future.set_exception(exc)
    future.exception()


class Client:
    """Keep-alive connections per host, opened as needed (the load generator bounds how many requests
    are in flight, so this pool needs no limit of its own)."""

    def __init__(self):
        self.idle: dict[tuple[str, int], list[_Connection]] = {}
        self.all: set[_Connection] = set()

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        connecting = loop.create_connection(lambda: _Connection((host, port)), host, port)
        _, conn = await asyncio.wait_for(connecting, 10.0)
        self.all.add(conn)
        return conn

    async def acquire(self, host: str, port: int) -> _Connection:
        pool = self.idle.get((host, port))
        while pool:
            conn = pool.pop()
            if not conn.closed:
                return conn
            self.all.discard(conn)
        return await self._connect(host, port)

    def release(self, conn: _Connection) -> None:
        if conn.closed or not conn.keep_alive:
            self.drop(conn)
        else:
            conn.body_handler = None
            self.idle.setdefault(conn.key, []).append(conn)

    def drop(self, conn: _Connection) -> None:
        conn.close()
        self.all.discard(conn)

    def close(self) -> None:
        for conn in self.all:
            conn.close()
        self.all.clear()
        self.idle.clear()


@asynccontextmanager
async def open_client(max_connections: int, timeout_s: float):
    """A connection pool for up to ``max_connections`` concurrent streams. ``timeout_s`` is enforced
    around each whole request by the load generator."""
    client = Client()
    try:
        yield client
    finally:
        client.close()


async def _request(client: Client, url: str, body: dict, result: RequestResult, on_body) -> _Connection:
    """POST and wait for the response headers; returns the connection with its response under way. A
    keep-alive connection the server closed under us (llama-server does, between requests) fails before
    any answer: the request is resent once on a fresh connection, and ``result.t_sent`` is the send time
    of the attempt that was answered."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    payload = orjson.dumps(body)
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream, application/x-ndjson\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    conn = await client.acquire(host, port)
    reused = conn.used
    conn.send(head, payload, on_body)
    try:
        await conn.headers_done
    except StreamCutOff:
        if not reused:
            raise
        client.drop(conn)
        result.engine_details["resent_on_fresh_connection"] = True
        conn = await client._connect(host, port)
        result.t_sent = perf_counter()
        conn.send(head, payload, on_body)
        await conn.headers_done
    return conn


async def _finish(client: Client, conn: _Connection, result: RequestResult) -> None:
    try:
        await conn.done
    except BaseException:
        client.drop(conn)
        raise
    result.t_done = perf_counter()
    client.release(conn)


async def _stream(client: Client, url: str, body: dict, prompt, split_events) -> tuple[RequestResult, bytes, bool]:
    """The request, its body fed through ``split_events(data, now, state)``; returns the result, the
    unfinished tail of the body and whether the SSE [DONE] marker came."""
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, perf_counter())
    state = {"buf": b"", "done": False, "result": result}

    def on_body(data: bytes, now: float):
        split_events(data, now, state)

    conn = await _request(client, url, body, result, on_body)
    if conn.status != 200:
        try:
            await _finish(client, conn, result)
        except StreamCutOff:
            pass
        result.error = f"HTTP {conn.status}: {b''.join(conn.error_chunks).decode(errors='replace')[:500]}"
        result.t_done = perf_counter()
        return result, b"", False
    try:
        await _finish(client, conn, result)
    finally:
        if conn.failure is not None and not isinstance(conn.failure, ConnectionError):
            raise conn.failure  # the adapter's own error (e.g. a malformed event), not the transport's
    return result, state["buf"], state["done"]


def _ended_early(result: RequestResult, done_marker: bool, final_event: str) -> None:
    if not done_marker and result.error is None and result.output_tokens_reported is None:
        result.error = f"stream ended before {final_event} (connection closed early)"


async def stream_sse(client, url: str, body: dict, prompt, handle,
                     final_event: str = "its final event") -> RequestResult:
    """POST ``body`` and read a server-sent-event stream; ``handle(event, arrival_time, result)`` reads
    each JSON event (one ``data:`` line) into the result. ``final_event`` names, in the error of a
    stream that ended early, the engine's last event (the one that carries its token counts)."""
    loads, JSONDecodeError = orjson.loads, orjson.JSONDecodeError

    def split_events(data: bytes, now: float, state: dict) -> None:
        if state["buf"]:
            data = state["buf"] + data
        lines = data.split(b"\n")
        state["buf"] = lines.pop()  # the unfinished last line (b"" when the read ended on a newline)
        result = state["result"]
        for line in lines:
            if line[:5] == b"data:":
                try:  # orjson skips the space after "data:" and a trailing "\r" itself
                    event = loads(line[5:])
                except JSONDecodeError:
                    payload = line[5:].strip()
                    if payload == _DONE:
                        state["done"] = True
                        continue
                    if not payload:
                        continue
                    raise
                handle(event, now, result)

    result, buf, done_marker = await _stream(client, url, body, prompt, split_events)
    if result.error:
        return result
    if buf.strip():
        result.error = f"stream cut off inside an event: {buf[:200]!r}"
    else:
        _ended_early(result, done_marker, final_event)
    return result


async def stream_ndjson(client, url: str, body: dict, prompt, handle,
                        final_event: str = "its final event") -> RequestResult:
    """POST ``body`` and read a newline-delimited JSON stream (Ollama), one event per line; ``final_event``
    as for :func:`stream_sse`."""
    loads = orjson.loads
    last = {"now": 0.0}

    def split_events(data: bytes, now: float, state: dict) -> None:
        last["now"] = now
        if state["buf"]:
            data = state["buf"] + data
        lines = data.split(b"\n")
        state["buf"] = lines.pop()
        for line in lines:
            if line.strip():
                handle(loads(line), now, state["result"])

    result, buf, _ = await _stream(client, url, body, prompt, split_events)
    if result.error:
        return result
    if buf.strip():  # a last line without its newline: complete if it parses
        try:
            event = loads(buf)
        except orjson.JSONDecodeError:
            result.error = f"stream cut off inside an event: {buf[:200]!r}"
            return result
        handle(event, last["now"], result)
    _ended_early(result, False, final_event)
    return result
