"""The third fault matrix's secrets (docs/fault-matrix.md, "Keys a server echoes"): a server (a proxy's
error page) echoes the Authorization header it got, or the Basic credentials of the URL's userinfo, in its
error bodies, its SSE error events and its /version; nothing of any credential reaches a file of the run or
the console. A key that cannot go into a header is refused at parse time."""
from __future__ import annotations

import base64
import html
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
        if self.path.startswith("/api/v1/query"):  # a Prometheus behind a proxy whose error page echoes
            page = f"<html><body><h1>400 Bad Request</h1><pre>{'x' * 120}{self._echo()}</pre></body></html>"
            self._send(400, "text/html", page.encode())  # the echo straddles the 200 characters kept
        elif self.path == "/version":
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


def pieces(secrets: set[str], n: int = 8) -> set[str]:
    """Every n characters in a row of every form: a piece of a key cut off with the text around it (an
    error cut at 500 characters before it was masked) is a leak too."""
    return {f[i:i + n] for f in secrets for i in range(len(f) - n + 1)}


# one cell of two requests at once (split over the two load workers where asked) and a warm-up: the server's
# two kinds of error, each echoing (the smoke workload's four cells, each starting two workers, took 6 s of CPU)
ONE_CELL = """name = "one-cell"
seed = 7
prompt_tokens = [128]
output_tokens = 16
warmup_requests = 1
warmup_prompt_tokens = 32
[load]
profile = "concurrent"
concurrency = [2]
rounds = 1
"""


@pytest.mark.parametrize("how", ["api_key_env", "url_userinfo", "load_workers", "prometheus"])
def test_a_server_echoing_the_credentials_puts_none_in_the_results_or_the_console(tmp_path, echoing, how):
    """``load_workers``: the key's echoes read in spawned load workers (--load-workers 2), which hold the
    parent's credentials before they cut an error to 500 characters. ``prometheus``: the --prometheus URL's
    Basic credentials echoed by its error page, cut to 200 characters."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    userinfo = f"{quote(USER, safe='')}:{quote(PASSWORD, safe='')}"
    extra = []
    if how in ("api_key_env", "load_workers"):
        env["KVBENCH_TEST_KEY"] = KEY
        backend, secrets = f"openai:url=http://{echoing},api_key_env=KVBENCH_TEST_KEY", forms(KEY)
        extra = ["--load-workers", "2"] if how == "load_workers" else []
    elif how == "url_userinfo":
        backend = f"openai:url=http://{userinfo}@{echoing}"
        secrets = forms(PASSWORD) | forms(f"{USER}:{PASSWORD}") | {userinfo}
    else:
        backend = f"openai:url=http://{echoing}"
        secrets = forms(PASSWORD) | forms(f"{USER}:{PASSWORD}") | {userinfo}
        extra = ["--prometheus", f"http://{userinfo}@{echoing}"]
    (tmp_path / "one_cell.toml").write_text(ONE_CELL)
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "-b", backend, "--workload",
                           str(tmp_path / "one_cell.toml"),
                           "--results-dir", str(tmp_path), "--run-id", "run", "--request-timeout", "20",
                           "--start-timeout", "20", "--allow-model-mismatch", *extra], cwd=REPO, env=env,
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
    if how == "prometheus":  # its echo recorded, masked, in every cell's telemetry source
        cells = [json.loads(line) for line in (run_dir / "cells.jsonl").read_text().splitlines()]
        assert all("HTTP 400, not JSON: <html>" in c["prom_source"] for c in cells), [c["prom_source"] for c in cells]
        assert any("you sent Authorization: Basic ***" in c["prom_source"] for c in cells)
    else:
        scheme = "Basic" if how == "url_userinfo" else "Bearer"
        assert f"you sent Authorization: {scheme} ***" in (run_dir / "run.json").read_text()  # /version's echo
    texts = {"the console": console}
    for path in files:
        texts[str(path.relative_to(run_dir))] = path.read_bytes().decode("latin-1")
        if path.suffix == ".parquet":
            table = pq.read_table(path).to_pandas()
            texts[f"{path.name}'s table"] = table.to_csv() + str(pq.read_metadata(path).metadata)
    for secret in pieces(secrets):
        for where, text in texts.items():
            assert secret not in text, f"{secret!r} in {where}"


def test_scrub_masks_every_form_and_leaves_other_text():
    redact.hold_secret("sk-unit-test/key+1")
    text = ("Bearer sk-unit-test/key+1, sk-unit-test%2Fkey%2B1, "
            + base64.b64encode(b"sk-unit-test/key+1").decode() + ', "sk-unit-test\\/key+1"')
    assert redact.scrub(text) == "Bearer ***, ***, ***, \"***\""
    assert redact.scrub("nothing secret here") == "nothing secret here"
    assert redact.scrub_value({"a": ["x sk-unit-test/key+1"], "n": 3}) == {"a": ["x ***"], "n": 3}


def test_credentials_held_within_a_scope_are_let_go_after_it():
    redact.hold_secret("kept-outside-1")
    with redact.held_within():
        redact.hold_secret("sk-only-inside")
        assert redact.scrub("sk-only-inside kept-outside-1") == "*** ***"
        assert redact.held_values()[-1] == "sk-only-inside"
    assert redact.scrub("sk-only-inside kept-outside-1") == "sk-only-inside ***"
    assert "sk-only-inside" not in redact.held_values()


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


def test_scrub_masks_html_lowercase_percent_and_every_base64_form():
    """A proxy's HTML error page (&quot; &amp;), a URL's lower-case percent-escapes, URL-safe or unpadded
    base64, the key inside a longer base64 text (a header block encoded whole)."""
    key = 'sk-html/"quoted"&amp+key?'
    redact.hold_secret(key)
    assert redact.scrub(f"<pre>{html.escape(key)}</pre>") == "<pre>***</pre>"
    assert redact.scrub(html.escape(key, quote=False)) == "***"
    parts = quote(key, safe="").split("%")
    lower = "%".join([parts[0], *(p[:2].lower() + p[2:] for p in parts[1:])])
    assert redact.scrub(f"key={lower}") == "key=***"
    urlsafe = base64.urlsafe_b64encode(key.encode()).decode()
    assert redact.scrub(urlsafe) == "***" and redact.scrub(urlsafe.rstrip("=")) == "***"
    for prefix in (b"Authorization: Bearer ", b"x", b"xy", b"xyz"):
        blob = base64.b64encode(prefix + key.encode() + b"\r\nHost: h").decode()
        masked = redact.scrub(blob)
        # the characters that only the key's bits decide went, whatever the key's offset in the blob
        assert "***" in masked and len(blob) - len(masked) >= 4 * len(key) // 3 - 6, (prefix, masked)
    assert redact.scrub("ordinary words and c2stadG") == "ordinary words and c2stadG"


def test_the_hub_token_of_the_environment_is_held(tmp_path, monkeypatch):
    token = "hf_PLANTEDtokenOfTheHub0123456789"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "fifo"))
    os.mkfifo(tmp_path / "fifo")  # a token file that is a FIFO: refused, never blocks
    from typer.testing import CliRunner

    from kvbench.cli import app

    CliRunner().invoke(app, ["backends"])  # every command holds it as it starts
    assert redact.scrub(f"token {token} echoed") == "token *** echoed"
    filed = "hf_PLANTEDfromTheTokenFile98765"
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "token"))
    (tmp_path / "token").write_text(filed + "\n")
    redact.hold_environment_tokens()
    assert redact.scrub(filed) == "***"
