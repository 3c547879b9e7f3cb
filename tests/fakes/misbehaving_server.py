"""An OpenAI-compatible server (tests/fakes/openai_server.py's vLLM dialect) that misbehaves on purpose,
for the fault matrix (docs/fault-matrix.md). ``fault`` picks how its completions go wrong; its other
routes (/v1/models, /version) answer normally, as a server that is up but broken does.

Faults: ``hang`` (reads the request, never answers), ``stall`` (one event, then nothing), ``infinite``
(tokens forever, no end), ``list`` / ``null`` / ``choices_str`` / ``not_json`` (an event of the wrong shape:
``data: [1,2,3]``, ``data: null``, ``{"choices": "abc"}``, ``data: {oops``), ``http_500`` / ``http_429``
(vLLM's error body), ``reset`` (TCP reset mid-stream), ``html`` (a 200 ``text/html`` page, as a proxy's
login page). ``fault_every`` = n: only every n-th completion misbehaves, the others are served normally.
``fault_after`` = n: the first n completions are served normally (a server that hangs after n requests);
``fault_for_s`` = s: the fault lasts s seconds from the first completion it hit, then the server recovers
(a stall: the completions hung meanwhile are let go, unanswered, and later ones are served). ``faulted``
counts the completions the fault hit.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

from tests.fakes.openai_server import FakeOpenAI, OpenAIHandler

FAULTS = ("hang", "stall", "infinite", "list", "null", "choices_str", "not_json", "http_500", "http_429", "reset",
          "html")
WRONG_SHAPE = {"list": b"data: [1,2,3]\n\n", "null": b"data: null\n\n",
               "choices_str": b'data: {"id": "cmpl-1", "object": "text_completion", "choices": "abc"}\n\n',
               "not_json": b"data: {oops\n\n"}


class MisbehavingHandler(OpenAIHandler):
    def do_POST(self):
        fake: FakeMisbehaving = self.server.fake
        if self.path != "/v1/completions":
            return super().do_POST()
        with fake.lock:
            fake.completions += 1
            faulty = fake.completions > fake.fault_after and fake.completions % fake.fault_every == 0
            now = time.monotonic()
            if faulty and fake.fault_for_s is not None:
                fake.fault_began = fake.fault_began or now
                faulty = now < fake.fault_began + fake.fault_for_s
            fake.faulted += faulty
        if not faulty:
            return super().do_POST()
        self.read_json()
        fault = fake.fault
        if fault == "hang":
            fake.wait_out()
            return
        if fault == "http_500":
            return self.send_json(500, {"error": {"message": "EngineCore encountered an issue. See stack trace.",
                                                  "type": "InternalServerError", "param": None, "code": 500}})
        if fault == "http_429":
            return self.send_json(429, {"error": {"message": "Too many requests", "type": "RateLimitError",
                                                  "param": None, "code": 429}})
        if fault == "html":
            return self.send_text(200, "<!doctype html><html><body>Sign in</body></html>", "text/html; charset=utf-8")
        self.start_stream("text/event-stream; charset=utf-8")
        event = {"id": "cmpl-1", "object": "text_completion", "created": 1764000000, "model": fake.model,
                 "choices": [{"index": 0, "text": " w", "logprobs": None, "finish_reason": None, "stop_reason": None}],
                 "usage": None}
        if fault in WRONG_SHAPE:
            self.chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.chunk(WRONG_SHAPE[fault])
            self.chunk(b"data: [DONE]\n\n")
            return self.end_stream()
        if fault == "stall":
            self.chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            fake.wait_out()
            return
        if fault == "infinite":
            while not fake.released.is_set():
                try:
                    self.chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                except OSError:
                    return
                fake.released.wait(0.01)
            return
        if fault == "reset":
            self.chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            # SO_LINGER 0: close() sends a RST, as a crashed host or a killed proxy does
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")


class FakeMisbehaving(FakeOpenAI):
    handler = MisbehavingHandler

    def __init__(self, fault: str, fault_every: int = 1, fault_after: int = 0, fault_for_s: float | None = None,
                 **kwargs):
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, not {fault!r}")
        super().__init__(**kwargs)
        self.fault, self.fault_every, self.fault_after, self.fault_for_s = fault, fault_every, fault_after, fault_for_s
        self.completions = self.faulted = 0
        self.fault_began: float | None = None  # monotonic time of the first completion the fault hit
        self.released = threading.Event()  # set at stop: hanging handlers return

    def wait_out(self) -> None:
        """Hang until the server stops, or until its stall is over."""
        self.released.wait(None if self.fault_for_s is None else
                           max(0.0, self.fault_began + self.fault_for_s - time.monotonic()))

    def stop(self) -> None:
        self.released.set()
        super().stop()
