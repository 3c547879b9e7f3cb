"""A usage count that is no count, in a whole run (docs/fault-matrix.md, "Wire formats"): the request it
came with fails with the reason, and every request of the cell keeps its row in requests.jsonl and
requests.parquet (a float or above-int64 count used to fail the cell and write none of its rows)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest

from tests.helpers import REPO

BAD_COUNTS = {1: 2.0, 2: 2**63, 3: "16"}  # the nth measured completion's completion_tokens


class _BadCounts(BaseHTTPRequestHandler):
    """An OpenAI completions server: every completion streams its max_tokens tokens and a usage event; the
    completions named in BAD_COUNTS report a count that is no count."""

    protocol_version = "HTTP/1.1"
    count = 0

    def log_message(self, *args):
        pass

    def _send(self, ctype: str, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send("application/json", json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body.get("max_tokens") or 1
        completion = n
        if n == 16:  # the workload's measured requests (the probe asks 2 tokens, the warm-up others)
            type(self).count += 1
            completion = BAD_COUNTS.get(self.count, n)
        events = [{"choices": [{"index": 0, "text": "a"}]} for _ in range(n)]
        events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion}})
        self._send("text/event-stream",
                   b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n")


@pytest.fixture
def bad_counts():
    _BadCounts.count = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BadCounts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_bad_usage_count_fails_its_request_and_every_row_is_written(tmp_path, bad_counts):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "-b", f"openai:url=http://{bad_counts}",
                           "--workload", "smoke", "--results-dir", str(tmp_path), "--run-id", "run",
                           "--request-timeout", "20", "--start-timeout", "20", "--allow-model-mismatch", "--no-report"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    run_dir = tmp_path / "run"
    cells = [json.loads(line) for line in (run_dir / "cells.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(cells) == 4, proc.stdout + proc.stderr
    measured = {c["cell_id"] for c in cells}
    requests = [r for r in rows if r["cell_id"] in measured]  # the warm-up's rows aside
    assert len(requests) == sum(c["n_requests"] for c in cells) == _BadCounts.count
    errors = sorted(r["error"] for r in requests if r.get("error"))
    assert len(errors) == len(BAD_COUNTS), errors
    assert all(e.startswith("bad response: the engine's output token count ") and e.endswith("not a token count")
               for e in errors), errors
    assert sum(not r.get("error") and r["output_tokens_reported"] == 16 for r in requests) \
        == len(requests) - len(BAD_COUNTS)
    for bad in (r for r in requests if r.get("error")):  # its timings stay; the count is not taken
        assert bad["output_tokens_received"] == 16 and bad["output_tokens_reported"] is None
    assert pq.read_table(run_dir / "requests.parquet").num_rows == len(rows)
