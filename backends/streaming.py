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
docs/client.md.)

A stream that ends early never looks complete: a connection closed before the response's end (by its
Content-Length or chunked framing) raises :class:`StreamCutOff` (one of :data:`TRANSPORT_ERRORS`); a body
that stops inside an event, or that ends before its final event, gets ``result.error``. "Final event"
means: the SSE ``data: [DONE]`` line, or any event from which the adapter read the engine's output token
count (``result.output_tokens_reported``), which every adapter reads from its engine's last event. A 200
answer whose Content-Type is not the stream asked for (an HTML page of a proxy or a login wall, a JSON
body of a server that ignored ``stream``) is not read as events: its error says what came instead.

https: TLS through the standard ``ssl`` module, certificates verified (:func:`tls_context`). What a request
to one server carries besides its body, its credential headers and the TLS context that trusts its
certificate, is that server's :class:`Endpoint`, set by the adapter when it attaches
(:func:`configure_endpoint`); a URL's own ``user:password@`` is sent as basic auth.

Long because the transport, the connection pool and both stream readers (the SSE one reading every framing
the standard allows) share the timed path, whose per-token cost the harness benchmarks watch: kept in one
module, its calls stay local.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import json
import ssl
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httptools
import orjson

from kvbench.common.redact import holding, scrub

from .types import RequestResult


class StreamCutOff(ConnectionError):
    """The connection closed before the whole response arrived."""


#: Exceptions a broken connection or a cut-off stream raises; the load generator turns them into a
#: failed request. (A malformed event raises ValueError, which the load generator reports as such.)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (OSError, httptools.HttpParserError)

_DONE = b"[DONE]"
_BOM = b"\xef\xbb\xbf"
_NO_EVENT = object()  # an SSE event that carries no JSON for the adapter: [DONE], or empty data
perf_counter = time.perf_counter

Origin = tuple[str, str, int]  # (scheme, host, port): a pool of connections, and an endpoint's settings


@dataclass(frozen=True)
class Endpoint:
    """What every request to one server carries besides its body."""

    headers: bytes = b""  # extra header lines, each ending in CRLF (Authorization)
    tls: ssl.SSLContext | None = None  # for https: the context that verifies the server's certificate


_ENDPOINTS: dict[Origin, Endpoint] = {}


def origin(url: str) -> Origin:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80)


def configure_endpoint(base_url: str, headers: dict[str, str] | None = None,
                       tls: ssl.SSLContext | None = None) -> None:
    """Every request to ``base_url``'s server (scheme, host, port) sends ``headers``; an https one verifies
    the server with ``tls`` (default: :func:`tls_context`). Called by the adapter that attaches to it; the
    load generator's clients read it when they send (one attached server at a time per origin)."""
    lines = b""
    for name, value in (headers or {}).items():
        if any(c in f"{name}{value}" for c in "\r\n\0") or not name or ":" in name:
            raise ValueError(f"header {name!r}: a name without ':' and no line break in name or value")
        lines += f"{name}: {value}\r\n".encode("latin-1")
    if lines or tls is not None:
        _ENDPOINTS[origin(base_url)] = Endpoint(lines, tls)
    else:
        _ENDPOINTS.pop(origin(base_url), None)


def forget_endpoint(base_url: str) -> None:
    _ENDPOINTS.pop(origin(base_url), None)


@functools.lru_cache(maxsize=8)
def tls_context(ca_bundle: str | None = None) -> ssl.SSLContext:
    """A client context that verifies certificates and host names: against ``ca_bundle`` (a PEM file) when
    given, else the system's CA store (certifi's where the system has none). One per bundle, shared by the
    streaming client and the adapter's untimed client."""
    if ca_bundle:
        return ssl.create_default_context(cafile=ca_bundle)
    context = ssl.create_default_context()
    if not context.cert_store_stats().get("x509_ca") and not context.get_ca_certs():
        try:
            import certifi
        except ImportError:
            pass
        else:
            context.load_verify_locations(cafile=certifi.where())
    return context


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time. The response body goes to
    ``body_handler(data, arrival_time)`` (given to :meth:`send`) as it arrives, from inside ``data_received``."""

    def __init__(self, key: Origin):
        self.key = key  # (scheme, host, port): the pool it returns to
        self.transport = None
        # httptools reads the callbacks once, here: each HTTP chunk of the body goes straight into this list
        # (a C call, no Python frame per streamed event: ~0.05 us a token, the client's ceiling)
        self.pending: list[bytes] = []  # body pieces of the current read
        self.on_body = self.pending.append
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.used = False  # has carried a request before: the server may have closed it meanwhile
        self._reset()

    def _reset(self, accept: tuple[bytes, ...] = ()):
        self.status = 0
        self.keep_alive = False
        self.accept = accept  # Content-Types (lower-case substrings) a 200 body may have to be read as events
        self.content_type = b""
        self.wrong_type = False  # a 200 answer of another Content-Type: its body is kept as an error
        self.framed = False  # Content-Length or chunked: the body has a known end
        self.headers_done = asyncio.get_running_loop().create_future()
        self.done = asyncio.get_running_loop().create_future()
        self.body_handler = None  # None once the headers say the body is no stream to read (error_chunks)
        self.error_chunks: list[bytes] = []  # the body of a non-200 answer
        self.pending.clear()
        self.failure: BaseException | None = None

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        now = perf_counter()
        try:
            self.parser.feed_data(data)  # body pieces collect in self.pending (one per HTTP chunk)
            pending = self.pending
            if pending:
                if self.body_handler is None:  # an error answer's body, or one of another Content-Type
                    self.error_chunks += pending
                    pending.clear()
                    return
                body = pending[0] if len(pending) == 1 else b"".join(pending)
                pending.clear()
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
            if self.headers_done.cancelled():  # the request gave up (timed out) before the answer came
                self.done.cancel()
            elif self.headers_done.exception() is None and not self.framed:
                self.done.set_result(None)  # a body without length ends when the connection does
            else:
                _set_failed(self.done, StreamCutOff("connection closed before the end of the response"))

    # --- httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes):
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True
        elif lower == b"content-type":
            self.content_type = value

    def on_headers_complete(self):
        self.status = self.parser.get_status_code()
        if self.status != 200:
            self.body_handler = None  # the body goes to error_chunks
        elif self.accept and self.content_type:  # no Content-Type at all: read it
            ctype = self.content_type.lower()
            for accepted in self.accept:  # a loop, not any(generator): once a request, ~1 us less
                if accepted in ctype:
                    break
            else:
                self.wrong_type = True
                self.body_handler = None  # the body goes to error_chunks
        if not self.headers_done.done():
            self.headers_done.set_result(None)

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

    def send(self, head: bytes, payload: bytes, on_body, accept: tuple[bytes, ...] = ()):
        self._reset(accept)
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
    """Keep-alive connections per origin (scheme, host, port), opened as needed (the load generator bounds
    how many requests are in flight, so this pool needs no limit of its own)."""

    def __init__(self):
        self.idle: dict[Origin, list[_Connection]] = {}
        self.all: set[_Connection] = set()

    async def _connect(self, key: Origin, tls: ssl.SSLContext | None = None) -> _Connection:
        """A new connection to ``key``; https ones through ``tls`` (verified; the TLS handshake is within the
        10 s connect limit). A certificate that does not verify raises ssl.SSLCertVerificationError."""
        scheme, host, port = key
        if scheme == "https" and tls is None:
            tls = tls_context()
        loop = asyncio.get_running_loop()
        connecting = loop.create_connection(lambda: _Connection(key), host, port, ssl=tls,
                                            server_hostname=host if tls else None)
        _, conn = await asyncio.wait_for(connecting, 10.0)
        self.all.add(conn)
        return conn

    async def acquire(self, key: Origin, tls: ssl.SSLContext | None = None) -> _Connection:
        pool = self.idle.get(key)
        while pool:
            conn = pool.pop()
            if not conn.closed:
                return conn
            self.all.discard(conn)
        return await self._connect(key, tls)

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


@functools.lru_cache(maxsize=64)
def _url_head(url: str) -> tuple[Origin, str, str, bytes]:
    """What a request's head takes from its URL: the origin, the path (with the query), the Host and the
    basic-auth line of the URL's userinfo (b"" without one). Cached: a load sends to one URL, and parsing
    it for every request cost ~2 us (the client's ceiling, docs/harness-benchmarks.md)."""
    parts = urlsplit(url)
    auth = b""
    if parts.username is not None:
        userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        auth = b"Authorization: Basic " + base64.b64encode(userinfo) + b"\r\n"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]  # never the userinfo
    return origin(url), path, host, auth


def _head(url: str, payload: bytes) -> tuple[Origin, bytes, ssl.SSLContext | None]:
    """The request's origin, its head (with the endpoint's headers, or basic auth from the URL's userinfo)
    and the TLS context of an https endpoint configured with one."""
    key, path, host, auth = _url_head(url)
    endpoint = _ENDPOINTS.get(key)
    extra = endpoint.headers if endpoint else b""
    if auth and b"authorization:" not in extra.lower():
        extra += auth
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream, application/x-ndjson\r\nContent-Length: {len(payload)}\r\n").encode()
    return key, head + extra + b"\r\n", endpoint.tls if endpoint else None


async def _request(client: Client, url: str, body: dict, result: RequestResult, on_body,
                   accept: tuple[bytes, ...] = ()) -> _Connection:
    """POST and wait for the response headers; returns the connection with its response under way.
    ``result.t_sent`` is stamped as the request goes out, after any connection it had to open. A keep-alive
    connection the server closed under us (llama-server does, between requests) fails before any answer: the
    request is resent once on a fresh connection, and ``result.t_sent`` is the send time of the attempt that
    was answered."""
    payload = orjson.dumps(body)
    key, head, tls = _head(url, payload)
    conn = await client.acquire(key, tls)
    reused = conn.used
    # the send time is when the request's bytes go out: a connection opened for it is not the server's latency
    # (at 16 in flight the handshakes of a cell's first requests made TTFT's p99 1.9 ms late, 0.5 without)
    result.t_sent = perf_counter()
    conn.send(head, payload, on_body, accept)
    try:
        await conn.headers_done
    except StreamCutOff:
        if not reused:
            raise
        client.drop(conn)
        result.engine_details["resent_on_fresh_connection"] = True
        conn = await client._connect(key, tls)
        result.t_sent = perf_counter()
        conn.send(head, payload, on_body, accept)
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


_SSE_TYPES = (b"text/event-stream",)
_NDJSON_TYPES = (b"json",)  # application/x-ndjson (Ollama), application/jsonl, application/json


async def _stream(client: Client, url: str, body: dict, prompt, split_events,
                  accept: tuple[bytes, ...] = (), what: str = "") -> tuple[RequestResult, dict]:
    """The request, its body fed through ``split_events(data, now, state)``; returns the result and the
    splitter's state at the end (:func:`new_stream_state`: the unfinished tail of the body, whether the SSE
    [DONE] marker came, ...). A 200 answer of a Content-Type
    other than ``accept`` fails with ``what`` (the kind of stream asked for) in its error."""
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, perf_counter())
    state = new_stream_state(result)

    def on_body(data: bytes, now: float):
        split_events(data, now, state)

    conn = await _request(client, url, body, result, on_body, accept)
    if conn.status != 200 or conn.wrong_type:
        try:
            await _finish(client, conn, result)
        except StreamCutOff:
            pass
        text = scrub(b"".join(conn.error_chunks).decode(errors="replace"))  # before it is cut: no half key
        if conn.status != 200:
            result.error = f"HTTP {conn.status}: {text[:500]}"
        else:
            ctype = conn.content_type.decode("latin-1").split(";")[0].strip()
            result.error = f"HTTP 200 but content-type {ctype}, not {what}: {text[:300]}"
        result.t_done = perf_counter()
        return result, state
    try:
        await _finish(client, conn, result)
    finally:
        if conn.failure is not None and not isinstance(conn.failure, ConnectionError):
            raise conn.failure  # the adapter's own error (e.g. a malformed event), not the transport's
    return result, state


def new_stream_state(result: RequestResult) -> dict:
    """What a stream's splitter keeps between two reads: ``buf`` the unfinished line; ``done`` the SSE [DONE]
    marker came; ``other`` the first line that was no SSE field (an HTML page served as text/event-stream);
    ``bad_utf8`` the events whose text was not UTF-8. (The SSE splitter's own per-read state is in its
    closure: :func:`stream_sse`.)"""
    return {"buf": bytearray(), "done": False, "result": result, "other": None, "bad_utf8": 0}


def sse_payloads(body: bytes) -> list[bytes]:
    """The data of every event of a whole SSE body, by the standard (the same reading as the timed
    splitter in :func:`stream_sse`, for a body read whole off the timed path: an attach probe)."""
    if body[:3] == _BOM:
        body = body[3:]
    events, data = [], None
    for line in body.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        if not line:
            if data is not None:
                events.append(data)
            data = None
        elif line[:1] != b":":
            name, _, value = line.partition(b":")
            if name == b"data":
                value = value[1:] if value[:1] == b" " else value
                data = value if data is None else data + b"\n" + value
    return events


def sse_json(data: bytes):
    """An event's data as JSON. Data lines are joined by LF (the standard), so a server that splits an event's
    line inside a JSON string puts a bare LF in that string, which strict JSON refuses (it failed the attach
    probe, and the request): such data is read with the LF kept in the string, as Python's non-strict JSON
    reads it. Anything else that is not JSON raises, as before."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        if b"\n" not in data:
            raise
        try:
            return json.loads(data.decode(errors="replace"), strict=False)
        except ValueError:
            pass
        raise


def _sse_line_ends(data: bytes, state: dict, odd: bool | None) -> tuple[bytes, bool | None]:
    """``data`` with its CRLF and bare CR line ends made LF (the standard allows all three), and the splitter's
    ``odd`` for the next read (True: this read ended in CR). A CRLF cut between two reads is one line end;
    a byte-order mark at the stream's start (``odd`` None) is dropped. Only reads holding a CR (and the
    first) come here: LF streams keep the fast path."""
    if odd is None:  # the stream's first bytes: a byte-order mark, maybe cut between reads
        head = bytes(state["buf"]) + data
        if len(head) < 3 and _BOM.startswith(head):
            state["buf"][:] = head
            return b"", None
        state["buf"].clear()
        data = head[3:] if head[:3] == _BOM else head
    elif odd and data[:1] == b"\n":  # the read before ended in CR: this LF is the same line end
        data = data[1:]
    odd = data[-1:] == b"\r"
    return (data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if 13 in data else data), odd


def _sse_field(line: bytes, pending: bytes | None, state: dict) -> bytes | None:
    """A line that is neither ``data:`` nor a blank line nor a comment: a field kvbench does not read
    (``event``, ``id``, ``retry``; ignored as the standard says), or ``data`` without a colon (an empty
    data line). The first such line is kept: a body with no event at all is said with it."""
    if line == b"data":
        return b"" if pending is None else pending + b"\n"
    if state["other"] is None and line.partition(b":")[0] not in (b"event", b"id", b"retry"):
        state["other"] = line[:4096]  # cut to 200 once scrubbed
    return pending


def _sse_event(payload: bytes, state: dict, loads):
    """The JSON of an event whose fast parse failed: :data:`_NO_EVENT` for ``[DONE]`` and an empty event, the event read
    with its invalid UTF-8 replaced by U+FFFD (and counted) when that was the only fault; else the parse
    error is raised (a malformed event fails its request)."""
    text = payload.strip()
    if text == _DONE:
        state["done"] = True
        return _NO_EVENT
    if not text:
        return _NO_EVENT
    try:
        text.decode()  # UTF-8: else read replaced, and counted
    except UnicodeDecodeError:
        state["bad_utf8"] += 1
        state["result"].engine_details["events_not_utf8"] = state["bad_utf8"]
        return sse_json(text.decode(errors="replace").encode())
    return sse_json(text)  # raises the parse error


def _complete_lines(data: bytes, tail: bytearray) -> list[bytes]:
    """The lines that ``data`` completes, the first one prefixed with ``tail`` (the unfinished line of the
    reads before); what follows the last newline becomes the new ``tail``, in place. Linear in the bytes: a
    read without a newline is appended to the tail (not joined with it into a new object), and only the
    new read is split at newlines. (Joining every read onto the whole unfinished line and re-splitting
    it cost 13.8 s of TTFT for one 100 MB event on localhost.)"""
    lines = data.split(b"\n")  # a read without a newline: [data] itself, no copy
    rest = lines.pop()
    if tail:
        if lines:
            tail += lines[0]
            lines[0] = bytes(tail)
            tail.clear()
        tail += rest
    elif rest:
        tail += rest
    return lines


def _scrubbed(data: bytes | bytearray, limit: int = 200) -> bytes:
    """The first ``limit`` bytes of a server's text for an error, held credentials masked before the cut."""
    if not holding():
        return bytes(data[:limit])
    return scrub(bytes(data[:limit + 4096]).decode("latin-1")).encode("latin-1")[:limit]


def _ended_early(result: RequestResult, done_marker: bool, final_event: str) -> None:
    if not done_marker and result.error is None and result.output_tokens_reported is None:
        result.error = f"stream ended before {final_event} (connection closed early)"


async def stream_sse(client, url: str, body: dict, prompt, handle,
                     final_event: str = "its final event") -> RequestResult:
    """POST ``body`` and read a server-sent-event stream; ``handle(event, arrival_time, result)`` reads
    each JSON event (its data lines, as the standard joins them) into the result. ``final_event`` names, in the error of a
    stream that ended early, the engine's last event (the one that carries its token counts)."""
    loads, JSONDecodeError = orjson.loads, orjson.JSONDecodeError
    # what the splitter carries from one read to the next (per request: one splitter a request): the data
    # lines of an event not ended yet (None: none), and whether the next read needs _sse_line_ends (None
    # before the first read, True after one ending in CR). Closure variables, not state's keys: this runs
    # once a read, where a dict's lookups cost ~1 % a token (docs/fault-matrix.md, "Wire formats").
    pending, odd = None, None

    def split_events(data: bytes, now: float, state: dict) -> None:
        # The WHATWG standard's event-stream parsing: an event is its data lines (joined by LF) up to a
        # blank line; lines end in LF, CRLF or CR; ":" starts a comment; "data:" takes one space after it.
        # The usual stream (LF, one data line an event) costs one slice test and one parse an event.
        nonlocal pending, odd
        # a CR is looked for as the int 13 (memchr); b"\r" in data searched 1 KiB in ~0.3 us, +2-4 % a token
        if odd is not False or 13 in data:
            data, odd = _sse_line_ends(data, state, odd)
        result, waiting = state["result"], pending  # a local in the loop: faster than the closure's cell
        for line in _complete_lines(data, state["buf"]):
            if not line:  # the blank line: the event is complete
                if waiting is not None:
                    try:  # orjson skips the space after "data:" itself
                        event = loads(waiting)
                    except JSONDecodeError:
                        event = _sse_event(waiting, state, loads)
                        if event is _NO_EVENT:
                            waiting = None
                            continue
                    waiting = None
                    handle(event, now, result)
            elif line[:5] == b"data:":
                if waiting is None:
                    waiting = line[5:]
                else:  # one event over several data lines
                    value = line[5:]
                    waiting += b"\n" + (value[1:] if value[:1] == b" " else value)
            elif line[:1] != b":":  # a comment is skipped
                waiting = _sse_field(line, waiting, state)
        pending = waiting

    result, state = await _stream(client, url, body, prompt, split_events, _SSE_TYPES,
                                  "an event stream (text/event-stream)")
    if result.error:
        return result
    buf = state["buf"]
    if pending is not None and not buf.strip():  # data lines without the blank line ending the event
        buf = b"data:" + pending
    if buf.strip():
        result.error = f"stream cut off inside an event: {_scrubbed(buf)!r}"
    elif state["other"] is not None and not (state["done"] or result.chunk_times or result.output_tokens_reported):
        result.error = (f"HTTP 200 text/event-stream but the body held no server-sent event: it began "
                        f"{_scrubbed(state['other']).decode(errors='replace')!r}")
    else:
        _ended_early(result, state["done"], final_event)
    return result


async def stream_ndjson(client, url: str, body: dict, prompt, handle,
                        final_event: str = "its final event") -> RequestResult:
    """POST ``body`` and read a newline-delimited JSON stream (Ollama), one event per line; ``final_event``
    as for :func:`stream_sse`."""
    loads = orjson.loads
    last = {"now": 0.0}

    def split_events(data: bytes, now: float, state: dict) -> None:
        last["now"] = now
        for line in _complete_lines(data, state["buf"]):
            if line.strip():
                handle(loads(line), now, state["result"])

    result, state = await _stream(client, url, body, prompt, split_events, _NDJSON_TYPES,
                                  "a JSON-lines stream (application/x-ndjson)")
    if result.error:
        return result
    buf = bytes(state["buf"])
    if buf.strip():  # a last line without its newline: complete if it parses
        try:
            event = loads(buf)
        except orjson.JSONDecodeError:
            result.error = f"stream cut off inside an event: {_scrubbed(buf)!r}"
            return result
        handle(event, last["now"], result)
    _ended_early(result, False, final_event)
    return result
