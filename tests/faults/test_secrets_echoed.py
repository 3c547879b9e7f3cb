"""The third fault matrix's secrets (docs/fault-matrix.md, "Keys a server echoes"): a server (a proxy's
error page) echoes the Authorization header it got, or the Basic credentials of the URL's userinfo, in its
error bodies, its SSE error events and its /version; nothing of any credential reaches a file of the run or
the console. A key that cannot go into a header is refused at parse time."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote

import pyarrow.parquet as pq
import pytest

from kvbench.common import redact
from kvbench.run.backend_config import BackendConfig, ConfigError
from tests.helpers import REPO

KEY = "sk-PLANTED/key+with=odd\"chars"  # '/', '+', '=' and '"': percent-, JSON- and PHP-escaped forms differ
USER, PASSWORD = "alice", "p@ss:PLANTED%w0rd/"


class _Echoing(BaseHTTPRequestHandler):
    """/v1/models and /version answer (the version echoes the header); a 2-token completion (the attach
    probe) streams; every other completion fails, alternately an HTTP 502 HTML page and an HTTP 200 SSE
    error event, each echoing the Authorization header, the credentials it decodes to, and their
    percent-encoded and JSON-escaped forms."""

    protocol_version = "HTTP/1.1"
    count = 0

    def log_message(self, *args):
        pass

    def _echo(self) -> str:
        header = self.headers.get("Authorization") or ""
        kind, _, value = header.partition(" ")
        plain = base64.b64decode(value).decode() if kind == "Basic" else value
        return (f"you sent Authorization: {header}; credentials {plain}; percent-encoded {quote(plain, safe='')}; "
                f"JSON {json.dumps(plain)}; PHP {json.dumps(plain).replace('/', chr(92) + '/')}")

    def _send(self, status: int, ctype: str, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/version":
            self._send(200, "application/json", json.dumps({"version": self._echo()}).encode())
        else:
            self._send(200, "application/json", json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        echo = self._echo()
        if body.get("max_tokens") == 2:  # the probe: a good stream, usage included
            events = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]},
                      {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}]
            sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            self._send(200, "text/event-stream", sse)
            return
        type(self).count += 1
        if self.count % 2:
            page = f"<html><body><h1>502 Bad Gateway</h1><pre>{'x' * 420}{echo}</pre></body></html>"
            self._send(502, "text/html", page.encode())  # the echo straddles the 500 characters kept
        else:
            event = {"error": {"message": f"upstream refused: {echo}", "type": "proxy_error"}}
            self._send(200, "text/event-stream", b"data: " + json.dumps(event).encode() + b"\n\n")


@pytest.fixture
def echoing():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echoing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def forms(secret: str) -> set[str]:
    return {secret, quote(secret, safe=""), json.dumps(secret)[1:-1], base64.b64encode(secret.encode()).decode()}


@pytest.mark.parametrize("how", ["api_key_env", "url_userinfo"])
def test_a_server_echoing_the_credentials_puts_none_in_the_results_or_the_console(tmp_path, echoing, how):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    if how == "api_key_env":
        env["KVBENCH_TEST_KEY"] = KEY
        backend, secrets = f"openai:url=http://{echoing},api_key_env=KVBENCH_TEST_KEY", forms(KEY)
    else:
        userinfo = f"{quote(USER, safe='')}:{quote(PASSWORD, safe='')}"
        backend = f"openai:url=http://{userinfo}@{echoing}"
        secrets = forms(PASSWORD) | forms(f"{USER}:{PASSWORD}") | {userinfo}
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "-b", backend, "--workload", "smoke",
                           "--results-dir", str(tmp_path), "--run-id", "run", "--request-timeout", "20",
                           "--start-timeout", "20", "--allow-model-mismatch"], cwd=REPO, env=env,
                          capture_output=True, timeout=600)
    console = (proc.stdout + proc.stderr).decode(errors="replace")
    run_dir = tmp_path / "run"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"run.json", "cells.jsonl", "requests.jsonl", "report.md", "report.html"} <= {p.name for p in files}, console
    requests = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    errors = [r["error"] for r in requests if r.get("error")]
    # the server did echo, and the rows say so with the credentials masked
    assert errors and all(e.startswith("HTTP 502: <html>") or "upstream refused: you sent Authorization: " in e
                          for e in errors), errors[:3]
    assert any(e.startswith("HTTP 502") and "you sent Authorization: " in e for e in errors)  # cut after the echo
    assert any("upstream refused" in e for e in errors)
    scheme = "Bearer" if how == "api_key_env" else "Basic"
    assert f"you sent Authorization: {scheme} ***" in (run_dir / "run.json").read_text()  # /version's echo
    for secret in secrets:
        for path in files:
            data = path.read_bytes()
            assert secret.encode() not in data, f"{secret!r} in {path.relative_to(run_dir)}"
            if path.suffix == ".parquet":
                table = pq.read_table(path).to_pandas()
                assert secret not in table.to_csv() + str(pq.read_metadata(path).metadata), path
        assert secret not in console, secret


def test_scrub_masks_every_form_and_leaves_other_text():
    redact.hold_secret("sk-unit-test/key+1")
    text = ("Bearer sk-unit-test/key+1, sk-unit-test%2Fkey%2B1, "
            + base64.b64encode(b"sk-unit-test/key+1").decode() + ', "sk-unit-test\\/key+1"')
    assert redact.scrub(text) == "Bearer ***, ***, ***, \"***\""
    assert redact.scrub("nothing secret here") == "nothing secret here"
    assert redact.scrub_value({"a": ["x sk-unit-test/key+1"], "n": 3}) == {"a": ["x ***"], "n": 3}


@pytest.mark.parametrize("value, problem", [("clé-secrète", "not printable ASCII (at position 3 of 11)"),
                                            ("sk-\x07bell", "not printable ASCII (at position 4 of 8)")])
def test_a_key_that_cannot_go_into_a_header_is_refused_at_parse_time(monkeypatch, value, problem):
    monkeypatch.setenv("KVBENCH_TEST_KEY", value)
    with pytest.raises(ConfigError) as info:
        BackendConfig.parse("openai:url=http://127.0.0.1:9,api_key_env=KVBENCH_TEST_KEY")
    assert problem in str(info.value) and value not in str(info.value)


def test_a_non_ascii_key_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "KVBENCH_TEST_KEY": "clé-PLANTED"}
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "-b",
                           "openai:url=http://127.0.0.1:9,api_key_env=KVBENCH_TEST_KEY", "--workload", "smoke",
                           "--results-dir", str(tmp_path), "--run-id", "run"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "not printable ASCII" in lines[0] and "PLANTED" not in lines[0], lines
    assert not (tmp_path / "run").exists()
