"""Hosted and secured endpoints in attach mode: https with verified certificates (a real local TLS server
with a self-signed certificate), API keys from an environment variable, basic auth from the URL, and
no secret anywhere in what a run writes or prints."""
from __future__ import annotations

import base64
import os
import ssl
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbench.backends.openai.adapter import OpenAIBackend
from kvbench.backends.streaming import TRANSPORT_ERRORS, open_client, stream_sse
from kvbench.backends.types import EngineStartError
from kvbench.load import run_async
from kvbench.run.backend_config import BackendConfig
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.testkit import prompt, run, spec
from tests.helpers import REPO



@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (and its key), made by the openssl command line."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


def server_tls(cert) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*cert)
    return context


def attach(tmp_path, cfg: BackendConfig) -> OpenAIBackend:
    """As the runner does: the adapter from the config, its credentials, then attach."""
    backend = OpenAIBackend(cfg.version, None, cfg.options)
    backend.auth_headers = cfg.auth_headers()
    backend.attach(spec(tmp_path), cfg.url, timeout_s=5)
    return backend


def test_https_without_the_ca_bundle_fails_on_the_certificate(tmp_path, cert):
    with FakeOpenAI(tls=server_tls(cert)) as fake:
        assert fake.url.startswith("https://127.0.0.1:")
        cfg = BackendConfig.parse(f"openai:url={fake.url}")
        with pytest.raises(EngineStartError) as info:
            attach(tmp_path, cfg)
        message = str(info.value)
        assert "certificate verify failed" in message and "self-signed certificate" in message
        assert "ca_bundle=PATH" in message  # says what to do
        # the streaming client on its own verifies too: no request reaches the server
        n_before = len(fake.auth_seen)

        async def go():
            async with open_client(1, 5.0) as client:
                return await stream_sse(client, fake.url + "/v1/completions", {}, prompt(8, 4),
                                        OpenAIBackend._read_event)
        with pytest.raises(TRANSPORT_ERRORS) as raised:
            run_async(go())
        assert isinstance(raised.value, ssl.SSLCertVerificationError)
        assert len(fake.auth_seen) == n_before


def test_https_with_the_ca_bundle_streams_with_timings(tmp_path, cert):
    with FakeOpenAI(tls=server_tls(cert), token_delay_s=0.005) as fake:
        cfg = BackendConfig.parse(f"openai:url={fake.url},ca_bundle={cert[0]}")
        backend = attach(tmp_path, cfg)
        try:
            results = run(backend, [prompt(40, 8, "a"), prompt(40, 8, "b"), prompt(40, 8, "c")], concurrency=2)
        finally:
            backend.stop()
    assert fake.last_request is not None and fake.last_request["max_tokens"] == 8  # it got there, over TLS
    for r in results:
        assert r.error is None and r.output_tokens_reported == 8 and r.chunk_tokens == [1] * 8
        times = [r.t_sent, *r.chunk_times, r.t_done]
        assert times == sorted(times)
        # the server sleeps 5 ms before each token: the stamps are the arrivals, not one read at the end
        assert r.chunk_times[-1] - r.chunk_times[0] >= 7 * 0.004


def test_api_key_from_the_environment_is_sent_as_a_bearer_token(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_TEST_KEY", "sk-test-123")
    with FakeOpenAI(require_auth="Bearer sk-test-123") as fake:
        cfg = BackendConfig.parse(f"openai:url={fake.url},api_key_env=KVBENCH_TEST_KEY")
        assert "sk-test-123" not in repr(cfg) + cfg.model_dump_json()
        backend = attach(tmp_path, cfg)
        (r,) = run(backend, [prompt(20, 4)])
        assert backend.reported_version() == "0.32.0"
        backend.stop()
    assert r.error is None and r.output_tokens_reported == 4
    # every call carried it: the health check, /v1/models, the streamed POST, /version
    assert len(fake.auth_seen) >= 4 and set(fake.auth_seen) == {"Bearer sk-test-123"}


def test_a_server_that_wants_a_key_fails_the_attach_at_once(tmp_path, monkeypatch):
    with FakeOpenAI(require_auth="Bearer right") as fake:
        with pytest.raises(EngineStartError, match="answered HTTP 401 to /v1/models: it wants credentials: give api_key_env"):
            attach(tmp_path, BackendConfig.parse(f"openai:url={fake.url}"))
        monkeypatch.setenv("KVBENCH_TEST_KEY", "wrong")
        with pytest.raises(EngineStartError, match="HTTP 401 to /v1/models: it refused the credentials"):
            attach(tmp_path, BackendConfig.parse(f"openai:url={fake.url},api_key_env=KVBENCH_TEST_KEY"))
        assert fake.auth_seen == [None, "Bearer wrong"]  # one try each, not retried until the timeout


def test_basic_auth_from_the_url_userinfo(tmp_path):
    expected = "Basic " + base64.b64encode(b"alice:p@ss:w0rd").decode()
    with FakeOpenAI(require_auth=expected) as fake:
        host = fake.url.removeprefix("http://")
        cfg = BackendConfig.parse(f"openai:url=http://alice:p%40ss:w0rd@{host}")  # userinfo percent-encoded
        assert cfg.url == fake.url and cfg.label == f"openai@{host}"
        backend = attach(tmp_path, cfg)
        (r,) = run(backend, [prompt(20, 4)])
        backend.stop()
    assert r.error is None and r.output_tokens_reported == 4
    assert set(fake.auth_seen) == {expected} and len(fake.auth_seen) >= 3


def test_a_whole_run_writes_and_prints_no_secret(tmp_path):
    """`kvbench run` against a fake server with a password in the URL and an API key in the environment:
    neither secret appears in any file of the run folder (JSONL, Parquet, run.json, timelines, report.md,
    report.html, plots), nor in what it printed; and the run did happen, with the key sent."""
    secret_url, secret_key = "PLANTEDSECRET1", "PLANTEDSECRET2"
    with FakeOpenAI(require_auth=f"Bearer {secret_key}", token_delay_s=0.0005) as fake:
        host = fake.url.removeprefix("http://")
        env = {**os.environ, "KVBENCH_TEST_KEY": secret_key, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-m", "kvbench.cli", "run", "-b",
             f"openai:url=http://user:{secret_url}@{host},api_key_env=KVBENCH_TEST_KEY", "--workload", "smoke",
             "--results-dir", str(tmp_path), "--run-id", "run", "--request-timeout", "60", "--start-timeout", "20"],
            cwd=REPO, env=env, capture_output=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console.decode(errors="replace")[-3000:]
    assert set(fake.auth_seen) == {f"Bearer {secret_key}"} and len(fake.auth_seen) > 8

    run_dir = tmp_path / "run"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"run.json", "cells.jsonl", "requests.jsonl", "cells.parquet", "report.md", "report.html"} <= names
    label = f"openai@{host}"
    timelines = [p.name for p in files if p.parent.name == "timelines"]
    assert timelines and all(label in name for name in timelines)  # file names made from the label
    assert label.encode() in (run_dir / "cells.jsonl").read_bytes()  # the rows are there, labelled host:port
    for secret in (secret_url, secret_key):
        for path in files:
            assert secret.encode() not in path.read_bytes(), f"{secret} in {path.relative_to(run_dir)}"
            assert secret not in str(path.relative_to(run_dir))
        assert secret.encode() not in console
    # Parquet pages may be compressed: read every table back and look in its values too
    for path in files:
        if path.suffix == ".parquet":
            table = pq.read_table(path).to_pandas()
            text = table.to_csv() + str(pq.read_metadata(path).metadata)
            assert secret_url not in text and secret_key not in text, path
    assert "***@" in (run_dir / "run.json").read_text()  # the command line is kept, with the password masked
