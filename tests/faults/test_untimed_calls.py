"""The third fault matrix's harness calls (docs/fault-matrix.md, "Wire formats"): kvbench's own calls to an
engine (/version, /tokenize, /metrics, /v1/models, the health path) had a timeout per read only, so a server
that sends a byte just inside each read timeout, or a body without end, held the run (and its memory) for
ever. Each call now has a deadline and each answer a size cap (backends/untimed.py): past either the call
fails as any failed call to the engine does, in seconds."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvbench.backends import REGISTRY
from kvbench.backends.untimed import DEADLINE_READS, bounded_client

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


class _Hostile(BaseHTTPRequestHandler):
    """/trickle: a JSON body one byte every 0.2 s, for ever; /endless: a chunked body without end;
    /huge: a Content-Length of 1 TB; /ok and /version: a version."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.path.partition("?")[0]
        try:
            if path == "/huge":
                self.send_response(200)
                self.send_header("Content-Length", str(10**12))
                self.end_headers()
                self.wfile.write(b"{")
                return
            if path in ("/ok", "/version"):
                body = b'{"version": "0.32.0"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if path == "/trickle":
                self.wfile.write(b"1\r\n{\r\n")
                while True:
                    time.sleep(0.2)
                    self.wfile.write(b"1\r\n \r\n")
                    self.wfile.flush()
            block = b" " * 65536
            while True:  # /endless
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
        except OSError:  # the client gave up and closed the connection
            pass


@pytest.fixture(scope="module")
def hostile():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def timed(call):
    started = time.monotonic()
    try:
        call()
    except httpx.HTTPError as exc:
        return exc, time.monotonic() - started
    raise AssertionError("the call did not fail")


def test_a_body_that_trickles_ends_at_the_call_s_deadline(hostile):
    with bounded_client(1.0) as client:
        exc, took = timed(lambda: client.get(hostile + "/trickle"))
    assert isinstance(exc, httpx.ReadTimeout) and "after its deadline (3 read timeouts)" in str(exc)
    assert DEADLINE_READS <= took < DEADLINE_READS + 2


@pytest.mark.parametrize("path, says", [("/endless", "is over 1 MiB"), ("/huge", "says it is 1,000,000,000,000 bytes")])
def test_an_answer_over_the_cap_fails_without_being_read(hostile, path, says):
    with bounded_client(5.0, max_bytes=MiB) as client:
        exc, took = timed(lambda: client.get(hostile + path))
    assert isinstance(exc, httpx.ReadError) and says in str(exc), exc
    assert took < 5


def test_a_sound_answer_passes(hostile):
    with bounded_client(5.0) as client:
        assert client.get(hostile + "/ok").json() == {"version": "0.32.0"}


def test_an_adapter_s_calls_are_bounded(hostile, tmp_path, monkeypatch):
    """vLLM's adapter asks /version through Backend.http: a trickling answer gives its fallback within the
    deadline instead of holding the run."""
    vllm = REGISTRY["vllm"]("0.32.0", tmp_path, {})
    monkeypatch.setattr(type(vllm), "untimed_timeout_s", 1.0)
    vllm.base_url = hostile
    assert vllm.reported_version() == "0.32.0"  # /version answers
    vllm.base_url = hostile + "/trickle?"
    started = time.monotonic()
    assert vllm.reported_version() == "0.32.0"  # the configured one: the call failed in time
    assert time.monotonic() - started < DEADLINE_READS + 2
    vllm.stop()
