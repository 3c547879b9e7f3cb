"""A minimal OpenAI-compatible streaming server with programmed timing, for measuring clients.

``python -m kvbench.selfcheck.mock_server --port 8123 --ttft-ms 20 --itl-ms 2`` answers ``POST /v1/completions``
(and ``/v1/chat/completions``) with ``max_tokens`` streamed chunks of one token each, shaped like vLLM's
with ``return_token_ids`` (``token_ids`` per chunk) and ``stream_options.include_usage`` (a final event
with ``usage``), then ``data: [DONE]``. Every chunk goes out as its own HTTP/1.1 chunk, as vLLM sends it.

Timing: the first token is sent ``ttft`` after the request was read, token k at ``ttft + k * itl``.
asyncio's timers are only good to about a millisecond, so each send is scheduled against its absolute
deadline: a Linux timerfd (microsecond wake-ups; the loop's own timers round to a millisecond) wakes the
loop ``--spin-ms`` early and the last stretch is a busy wait on ``time.perf_counter()``. The spin is short
(0.2 ms) so that requests arriving meanwhile are read promptly. With ``--ttft-ms 0 --itl-ms 0`` (instant mode) the whole response, pre-serialised
once per (output tokens, prompt tokens), goes out in one write as soon as the request is read.

The server records, per request, when it read it and when it actually sent each token
(``time.perf_counter()``, which is CLOCK_MONOTONIC on Linux and so comparable across processes):
``GET /mock/records`` returns them (and clears them). A request is keyed by the first token id of its
prompt (a list of ids), so a client that numbers its prompts can pair its own timings with the mock's.
It binds to 127.0.0.1 and is meant to run in a process of its own, on a core of its own (``--cpu``).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import heapq
import os
import time

import orjson

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

perf_counter = time.perf_counter
MODEL = "mock"
TOKEN_ID = 278  # " the" in Llama-family vocabularies; any id will do
TOKEN_TEXT = " the"


def _chunk(payload: bytes) -> bytes:
    """One SSE event as one HTTP/1.1 chunk."""
    data = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


_DONE = _chunk(b"[DONE]") + b"0\r\n\r\n"
_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")


def _json_response(obj, status: str = "200 OK") -> bytes:
    body = orjson.dumps(obj)
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (status.encode(), len(body))) + body


class Responses:
    """The pre-serialised chunks of one kind of response (completions or chat), cached per length."""

    def __init__(self, chat: bool):
        self.chat = chat
        self._token_events: dict[int, list[bytes]] = {}
        self._tails: dict[tuple[int, int], bytes] = {}
        self._whole: dict[tuple[int, int], bytes] = {}
        self.object = b"chat.completion.chunk" if chat else b"text_completion"

    def _event(self, finish: str | None) -> bytes:
        if self.chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": TOKEN_TEXT}, "logprobs": None,
                      "finish_reason": finish, "stop_reason": None, "token_ids": [TOKEN_ID]}
        else:
            choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None, "token_ids": [TOKEN_ID]}
        return _chunk(orjson.dumps({"id": "cmpl-mock", "object": self.object.decode(), "created": 0,
                                    "model": MODEL, "choices": [choice], "usage": None}))

    def token_events(self, n: int) -> list[bytes]:
        """n events of one token each; the last one carries finish_reason "length"."""
        events = self._token_events.get(n)
        if events is None:
            middle = self._event(None)
            events = self._token_events[n] = [middle] * (n - 1) + [self._event("length")] if n else []
        return events

    def tail(self, n: int, prompt_tokens: int) -> bytes:
        """The usage event, [DONE] and the end of the chunked body."""
        key = (n, prompt_tokens)
        tail = self._tails.get(key)
        if tail is None:
            usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}
            tail = self._tails[key] = _chunk(orjson.dumps({"id": "cmpl-mock", "object": self.object.decode(),
                                                           "created": 0, "model": MODEL, "choices": [],
                                                           "usage": usage})) + _DONE
        return tail

    def whole(self, n: int, prompt_tokens: int) -> bytes:
        key = (n, prompt_tokens)
        data = self._whole.get(key)
        if data is None:
            data = self._whole[key] = _STREAM_HEAD + b"".join(self.token_events(n)) + self.tail(n, prompt_tokens)
        return data


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class TimerFD:
    """A Linux timerfd on CLOCK_MONOTONIC (perf_counter's clock): wakes the event loop at an absolute time
    to within tens of microseconds, where the loop's own timers round to milliseconds."""

    def __init__(self):
        if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
            raise OSError("perf_counter is not CLOCK_MONOTONIC here")
        self._libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self._libc.timerfd_create(1, os.O_NONBLOCK | os.O_CLOEXEC)  # CLOCK_MONOTONIC
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")

    def set(self, t: float) -> None:
        sec = int(t)
        value = _Itimerspec(_Timespec(0, 0), _Timespec(sec, max(1, int((t - sec) * 1e9))))
        if self._libc.timerfd_settime(self.fd, 1, ctypes.byref(value), None) != 0:  # TFD_TIMER_ABSTIME
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass


class Stream:
    __slots__ = ("transport", "events", "tail", "deadlines", "sent", "record")

    def __init__(self, transport, events, tail, deadlines, record):
        self.transport, self.events, self.tail, self.deadlines, self.record = transport, events, tail, deadlines, record
        self.sent = 0


class MockServer:
    def __init__(self, ttft_s: float, itl_s: float, spin_s: float, record_sends: bool = True):
        self.ttft_s, self.itl_s, self.spin_s = ttft_s, itl_s, spin_s
        self.instant = ttft_s == 0 and itl_s == 0
        self.record_sends = record_sends
        self.responses = {False: Responses(chat=False), True: Responses(chat=True)}
        self.records: list[dict] = []
        self.seq = 0
        self._heap: list[tuple[float, int, Stream]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._timerfd: TimerFD | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop, use_timerfd: bool = True) -> str:
        """Attach to ``loop``; returns how deadlines are kept, for the start-up line."""
        self.loop = loop
        if use_timerfd:
            try:
                self._timerfd = TimerFD()
                loop.add_reader(self._timerfd.fd, self._on_timerfd)
                return f"timerfd + {self.spin_s * 1e3:g} ms spin"
            except (OSError, AttributeError, NotImplementedError):
                self._timerfd = None
        return f"event-loop timer + {self.spin_s * 1e3:g} ms spin"

    def _on_timerfd(self) -> None:
        self._timerfd.clear()
        self._tick()

    # --- requests ----------------------------------------------------------------------------------
    def handle(self, transport, method: str, path: str, body: bytes, t_recv: float) -> None:
        if method == "GET":
            if path in ("/health", "/ping"):
                transport.write(_json_response({"status": "ok"}))
            elif path == "/v1/models":
                transport.write(_json_response({"object": "list", "data": [
                    {"id": MODEL, "object": "model", "created": 0, "owned_by": "kvbench", "max_model_len": 1 << 20}]}))
            elif path.startswith("/mock/records"):
                records, self.records = self.records, []
                transport.write(_json_response({"ttft_s": self.ttft_s, "itl_s": self.itl_s, "records": records}))
            elif path == "/version":
                transport.write(_json_response({"version": "mock"}))
            else:
                transport.write(_json_response({"error": "not found"}, "404 Not Found"))
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            transport.write(_json_response({"error": "not found"}, "404 Not Found"))
            return
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            transport.write(_json_response({"error": f"bad JSON: {exc}"}, "400 Bad Request"))
            return
        chat = path.endswith("chat/completions")
        n = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
        prompt = request.get("messages") if chat else request.get("prompt")
        key, prompt_tokens = self.seq, 0
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            key, prompt_tokens = prompt[0], len(prompt)
        elif isinstance(prompt, str):
            prompt_tokens = len(prompt.split())
        elif isinstance(prompt, list):
            prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in prompt if isinstance(m, dict))
        self.seq += 1
        responses = self.responses[chat]
        if not request.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": TOKEN_TEXT * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": TOKEN_TEXT * n, "finish_reason": "length"})
            transport.write(_json_response({"id": "cmpl-mock", "object": "chat.completion" if chat else "text_completion",
                                            "created": 0, "model": MODEL, "choices": [choice],
                                            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                      "total_tokens": prompt_tokens + n}}))
            return
        if self.instant:
            transport.write(responses.whole(n, prompt_tokens))
            self.records.append({"key": key, "t_recv": t_recv, "t_sent": perf_counter(), "n": n})
            return
        transport.write(_STREAM_HEAD)
        first = t_recv + self.ttft_s
        record = {"key": key, "t_recv": t_recv, "t_first_due": first, "n": n, "sends": []}
        self.records.append(record)
        if n == 0:
            transport.write(responses.tail(0, prompt_tokens))
            return
        stream = Stream(transport, responses.token_events(n), responses.tail(n, prompt_tokens),
                        [first + k * self.itl_s for k in range(n)], record)
        self._push(stream)

    # --- the scheduler: absolute deadlines, a timer to get close, a spin for the last stretch ----------
    def _push(self, stream: Stream) -> None:
        deadline = stream.deadlines[stream.sent]
        heapq.heappush(self._heap, (deadline, id(stream), stream))
        if deadline < self._timer_at:
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        self._timer_at = deadline
        if self._timerfd is not None:
            self._timerfd.set(deadline - self.spin_s)
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(max(0.0, deadline - self.spin_s - perf_counter()), self._tick)

    def _tick(self) -> None:
        """Send what is due. Spins only up to the first deadline (at most ``spin_s``), sends everything due
        by then, and goes back to the event loop, so that requests arriving meanwhile are read on time."""
        self._timer, self._timer_at = None, float("inf")
        heap = self._heap
        if heap:
            deadline = heap[0][0]
            now = perf_counter()
            if deadline <= now + self.spin_s:
                while now < deadline:
                    now = perf_counter()
            while heap and heap[0][0] <= now:
                _, _, stream = heapq.heappop(heap)
                if stream.transport.is_closing():
                    continue
                i = stream.sent
                last = i + 1 == len(stream.events)
                stream.transport.write(stream.events[i] + stream.tail if last else stream.events[i])
                if self.record_sends:
                    stream.record["sends"].append(now)
                stream.sent = i + 1
                if not last:
                    heapq.heappush(heap, (stream.deadlines[i + 1], id(stream), stream))
                now = perf_counter()
        if heap:
            self._arm(heap[0][0])


class HTTPProtocol(asyncio.Protocol):
    """Just enough HTTP/1.1: keep-alive, Content-Length bodies, one request at a time per connection."""

    def __init__(self, server: MockServer):
        self.server = server
        self.buf = b""
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        t_recv = perf_counter()
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            lines = head.split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self.server.handle(self.transport, method, path, body, t_recv)


async def serve(args) -> None:
    server = MockServer(args.ttft_ms / 1000, args.itl_ms / 1000, args.spin_ms / 1000, not args.no_record_sends)
    loop = asyncio.get_running_loop()
    timing = server.start(loop, use_timerfd=not args.no_timerfd)
    srv = await loop.create_server(lambda: HTTPProtocol(server), args.host, args.port, backlog=1024)
    print(f"mock server on http://{args.host}:{args.port} ttft={args.ttft_ms} ms itl={args.itl_ms} ms ({timing})",
          flush=True)
    async with srv:
        await srv.serve_forever()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--ttft-ms", type=float, default=20.0, help="time to first token after the request is read")
    p.add_argument("--itl-ms", type=float, default=2.0, help="time between tokens (0 with --ttft-ms 0: instant)")
    p.add_argument("--spin-ms", type=float, default=0.2,
                   help="busy-wait this long before each deadline (2 ms or more with --no-timerfd)")
    p.add_argument("--no-timerfd", action="store_true", help="the event loop's timers (1 ms granularity) only")
    p.add_argument("--cpu", type=int, default=None, help="pin the server to this CPU")
    p.add_argument("--no-record-sends", action="store_true", help="record only the request, not every send")
    p.add_argument("--asyncio", action="store_true", help="asyncio's own event loop instead of uvloop")
    args = p.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        if uvloop is not None and not args.asyncio:
            uvloop.run(serve(args))
        else:
            asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
