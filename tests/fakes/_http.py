"""The HTTP plumbing the fakes share: JSON replies, chunked streams (SSE / NDJSON) and a way to cut a
stream off mid-body the way a crashed server does (the socket closes before the last chunk)."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streams, like hyper (TGI) and Go's net/http (Ollama)

    def log_message(self, fmt, *args):  # the fakes print their own engine-style log lines
        pass

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def read_json(self):
        raw = self.read_body()
        return json.loads(raw) if raw else {}

    def send_bytes(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, status: int, obj) -> None:
        self.send_bytes(status, json.dumps(obj, separators=(",", ":")).encode(), "application/json; charset=utf-8")

    def send_text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_bytes(status, text.encode(), content_type)

    def start_stream(self, content_type: str, extra_headers: dict | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def cut(self) -> None:
        """Close the connection mid-body, as a server that dies while streaming does."""
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class FakeServer:
    """Owns one HTTP server in a background thread; subclasses set ``handler`` and keep their state."""

    handler: type[Handler]

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.httpd: Server | None = None
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self):
        self.httpd = Server((self.host, self.port), self.handler)
        self.httpd.fake = self  # handlers reach the state as self.server.fake
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def serve_forever(self) -> None:
        """Run in the foreground (the stand-in executable); SIGTERM ends the process."""
        self.httpd = Server((self.host, self.port), self.handler)
        self.httpd.fake = self
        self.httpd.serve_forever()

    def stop(self) -> None:
        if self.httpd:
            self.httpd.shutdown()
            self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def count_words(text: str) -> int:
    """The fakes' tokenizer: kvbench prompts are words that are one token each (workloads/prompts.py)."""
    return len(text.split())
