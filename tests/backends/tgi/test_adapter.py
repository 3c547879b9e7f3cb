"""The TGI adapter against a faithful fake of TGI's router (tests/fakes/tgi_server.py)."""
import psutil
import pytest

from kvbench.backends.tgi.adapter import IMAGE, TGIBackend, parse_tgi_log
from kvbench.backends.types import EngineStartError
from kvbench.common.envs import ensure_env, is_installed
from tests.fakes.testkit import BYTES_PER_TOKEN, Poller, listening, only_on_path, prompt, run, spec, stand_in
from tests.fakes.tgi_server import FakeTGI


def attached(tmp_path, fake, **options):
    backend = TGIBackend("3.3.5", tmp_path, options)
    backend.attach(spec(tmp_path), fake.url, timeout_s=5)
    return backend


def test_stream_reads_tgi_counts_and_stamps_every_token(tmp_path):
    with FakeTGI(token_delay_s=0.003) as fake:
        backend = attached(tmp_path, fake)
        (r,) = run(backend, [prompt(100, 16)])
    assert r.error is None
    assert (r.prompt_tokens_reported, r.output_tokens_reported) == (100, 16)
    assert r.chunk_tokens == [1] * 16 and sum(r.chunk_tokens) == 16
    assert r.t_sent < r.chunk_times[0] and all(a <= b for a, b in zip(r.chunk_times, r.chunk_times[1:])) and len(set(r.chunk_times)) > 1
    assert r.chunk_times[-1] <= r.t_done
    assert r.engine_details["finish_reason"] == "length"
    # TGI takes text only; greedy, details on, no prefill details (refused on streams)
    assert fake.last_request == {"inputs": " w" * 100, "add_special_tokens": False, "parameters": {
        "max_new_tokens": 16, "details": True, "decoder_input_details": False, "do_sample": False}}
    assert TGIBackend.accepts_token_ids is False and TGIBackend.forces_output_length is False


def test_eos_counts_as_a_token_and_says_why_it_stopped(tmp_path):
    with FakeTGI(eos_after=5) as fake:
        (r,) = run(attached(tmp_path, fake), [prompt(50, 16)])
    assert r.error is None
    assert r.output_tokens_reported == 5 and sum(r.chunk_tokens) == 5
    assert r.engine_details["finish_reason"] == "eos_token" and r.engine_details["last_token_special"] is True


def test_validation_error_event_becomes_the_request_error(tmp_path):
    with FakeTGI(max_input_tokens=4095, max_total_tokens=4096) as fake:
        (r,) = run(attached(tmp_path, fake), [prompt(4090, 16)])
    assert r.error == ("validation: Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. "
                       "Given: 4090 `inputs` tokens and 16 `max_new_tokens`")
    assert r.chunk_tokens == []


def test_http_422_body_becomes_the_request_error(tmp_path):
    with FakeTGI(max_input_tokens=100, max_total_tokens=120, errors_as_http_422=True) as fake:
        (r,) = run(attached(tmp_path, fake), [prompt(200, 16)])
    assert r.error.startswith("HTTP 422: ")
    assert '"error_type":"validation"' in r.error and "`inputs` must have less than 100 tokens. Given: 200" in r.error


def test_stream_cut_off_midway_is_a_failed_request(tmp_path):
    with FakeTGI(cut_after=3) as fake:
        (r,) = run(attached(tmp_path, fake), [prompt(20, 16)])
    # a transport error caught by the load generator (the chunked body never completes)
    assert r.error and r.output_tokens_reported is None and r.chunk_tokens == []


def test_kv_pool_in_use_and_queue_against_the_fake(tmp_path):
    with FakeTGI(pool_tokens=20_000, token_delay_s=0.02, batch_slots=1) as fake:
        backend = attached(tmp_path, fake)
        pool = backend.kv_pool()
        assert (pool.tokens, pool.bytes) == (20_000, 20_000 * BYTES_PER_TOKEN)
        assert pool.source.startswith("tgi_batch_max_total_tokens")
        with Poller(backend.poll) as polls:  # KV in use and the queue from one /metrics per poll
            results = run(backend, [prompt(100, 20, "a"), prompt(200, 20, "b")], concurrency=2)
        assert all(r.error is None for r in results)
    kv, queue = [p.kv for p in polls.samples], [p.queue for p in polls.samples]
    # one request decodes at a time (batch_slots=1): the reservation is one prompt + max_new_tokens
    peak = max(kv, key=lambda s: s.tokens)
    assert peak.tokens == fake.peak_reserved == 220 and peak.bytes == 220 * BYTES_PER_TOKEN
    assert "reservation" in peak.source
    assert kv[0].tokens == 0 and queue[0]["waiting"] == 0  # idle before the requests
    assert max(q["waiting"] for q in queue) == 1 and queue[0]["source"] == "tgi_queue_size (/metrics)"


def test_kv_pool_from_the_log_when_metrics_lack_the_gauge(tmp_path):
    log = tmp_path / "tgi.log"
    log.write_text("2026-01-01T00:00:00Z  INFO text_generation_launcher: KV-cache blocks: 1200, size: 16\n"
                   "2026-01-01T00:00:01Z  INFO text_generation_router_v3: backends/v3/src/lib.rs:125: "
                   "Setting max batch total tokens to 19200\n")
    assert parse_tgi_log(log.read_text()) == {"max_batch_total_tokens": 19200, "num_blocks": 1200, "block_size": 16}
    with FakeTGI() as fake:
        fake.pool_gauge = False  # TGI < 2.3.1
        backend = attached(tmp_path, fake)
        backend.server = type("Log", (), {"log_path": log})()
        pool = backend.kv_pool()
        assert pool.tokens == 19200 and pool.bytes == 19200 * BYTES_PER_TOKEN
        assert pool.source.startswith("router log")
        log.write_text("KV-cache blocks: 1200, size: 16\n")
        assert backend.kv_pool().tokens == 19200 and backend.kv_pool().source.startswith("shard log")
        log.write_text("")
        assert backend.kv_pool() is None
        backend.server = None


def test_start_stream_kv_stop_with_the_launcher_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "text-generation-launcher", "tests.fakes.tgi_server")
    only_on_path(monkeypatch, bin_dir)
    monkeypatch.setenv("FAKE_TGI_POOL_TOKENS", "12345")
    backend = TGIBackend("3.3.5", tmp_path, {})
    s = spec(tmp_path, max_context=2048, max_concurrency=3)
    backend.start(s, tmp_path / "logs" / "tgi.log", timeout_s=30)
    pid = backend.pid
    try:
        assert backend.mode == "launcher"
        assert listening(pid) == [("127.0.0.1", backend.spec.port)]
        log = (tmp_path / "logs" / "tgi.log").read_text()
        assert (f"--model-id {s.model.hf_dir} --hostname 127.0.0.1 --port {backend.spec.port} --max-input-tokens 2047 "
                "--max-total-tokens 2048 --max-batch-prefill-tokens 2048 --max-concurrent-requests 3") in log
        assert backend.reported_version() == "3.3.5"
        # /info's model_id: the folder it was given
        assert backend.capabilities.served_model.models(backend) == [str(s.model.hf_dir)]
        (r,) = run(backend, [prompt(64, 8)])
        assert r.error is None and (r.prompt_tokens_reported, r.output_tokens_reported) == (64, 8)
        pool = backend.kv_pool()
        assert pool.tokens == 12345 and pool.details["log"]["max_batch_total_tokens"] == 12345
    finally:
        backend.stop()
    assert not psutil.pid_exists(pid)


def test_no_launcher_and_no_docker_is_a_clear_start_error(tmp_path, monkeypatch):
    only_on_path(monkeypatch, tmp_path / "empty")
    backend = TGIBackend("3.3.5", tmp_path, {})
    with pytest.raises(EngineStartError, match="text-generation-launcher not on PATH and docker not available"):
        backend.start(spec(tmp_path), tmp_path / "tgi.log", timeout_s=5)
    assert backend.server is None


def test_docker_command_publishes_on_loopback_only(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    (bin_dir).mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "docker").chmod(0o755)
    only_on_path(monkeypatch, bin_dir)
    backend = TGIBackend("3.3.5", tmp_path, {"gpus": "all"})
    s = spec(tmp_path, max_context=1024, max_concurrency=2, kv_dtype="fp8")
    s = type(s)(**{**s.__dict__, "port": 18080})
    argv, _ = backend.command(s)
    assert backend.mode == "docker"
    assert argv[argv.index("-p") + 1] == "127.0.0.1:18080:80"
    assert f"{IMAGE}:3.3.5" in argv and argv[argv.index("--model-id") + 1] == "/data/model"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3fn"
    backend.spec = s
    assert backend.kv_dtype_name() == "fp8_e4m3fn" and backend.kv_bytes_per_token() == BYTES_PER_TOKEN / 2
    other = TGIBackend("3.3.5", tmp_path, {"image": "ghcr.io/huggingface/text-generation-inference:3.3.4", "gpus": ""})
    argv, _ = other.command(s)
    assert "ghcr.io/huggingface/text-generation-inference:3.3.4" in argv and "--gpus" not in argv


def test_unsupported_kv_dtype_is_refused(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "text-generation-launcher", "tests.fakes.tgi_server")
    only_on_path(monkeypatch, bin_dir)
    s = type(spec(tmp_path))(**{**spec(tmp_path, kv_dtype="q8_0").__dict__, "port": 1})
    with pytest.raises(ValueError, match="TGI has no KV dtype 'q8_0'"):
        TGIBackend("3.3.5", tmp_path, {}).command(s)


def test_nothing_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    recipe = TGIBackend.recipe("3.3.5")
    assert recipe.steps == () and recipe.venv is False
    path = ensure_env(recipe)
    assert is_installed(recipe) and ensure_env(recipe) == path and path.name == "tgi-3.3.5"



def test_version_and_build_from_info(tmp_path):
    with FakeTGI() as fake:
        backend = TGIBackend("3.3.0", tmp_path)
        backend.attach(spec(tmp_path), fake.url, timeout_s=5)
        assert backend.reported_version() == "3.3.5"  # the server's, not the configured one
        fake.sha = "0123456789abcdef"
        assert backend.reported_version() == "3.3.5 (0123456)"
    backend.stop()  # (closes its keep-alive connection)
    assert backend.reported_version() == "3.3.0"  # the server gone: the configured version
