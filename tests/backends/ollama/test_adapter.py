"""The Ollama adapter against a faithful fake of `ollama serve` (tests/fakes/ollama_server.py)."""
import hashlib

import gguf
import psutil
import pytest

from kvbench.backends.ollama.adapter import OllamaBackend, last_load, model_tag, parse_slog_kv
from kvbench.backends.types import EngineStartError
from tests.fakes.ollama_server import FakeOllama
from tests.fakes.testkit import BYTES_PER_TOKEN, listening, only_on_path, prompt, run, spec, stand_in

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A GGUF with SmolLM2's attention geometry and no tensors (the fakes read metadata only)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-smollm2.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(30)
    w.add_head_count(9)
    w.add_head_count_kv(3)
    w.add_embedding_length(576)
    w.add_context_length(8192)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def fake(tmp_path):
    with FakeOllama(models_dir=tmp_path / "models", num_parallel=2, log_file=open(tmp_path / "fake.log", "w")) as f:
        yield f


def attached(tmp_path, fake, gguf_path, max_context=512, **options):
    backend = OllamaBackend("0.30.0", tmp_path, options)
    backend.attach(spec(tmp_path, max_context=max_context, max_concurrency=2, gguf=gguf_path), fake.url, timeout_s=5)
    return backend


def test_attach_imports_the_gguf_and_streams_ndjson(tmp_path, fake, tiny_gguf):
    backend = attached(tmp_path, fake, tiny_gguf)
    digest = "sha256:" + hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert backend.model == model_tag(backend.spec) and backend.model in fake.models
    assert fake.models[backend.model]["digest"] == digest and fake.blob_path(digest).exists()
    assert fake.loaded == (backend.model, 512)  # loaded at start with the num_ctx every request uses
    (r,) = run(backend, [prompt(100, 16)])
    assert r.error is None
    assert (r.prompt_tokens_reported, r.output_tokens_reported) == (100, 16)
    assert r.chunk_tokens == [1] * 16 and all(a <= b for a, b in zip(r.chunk_times, r.chunk_times[1:])) and len(set(r.chunk_times)) > 1
    assert r.t_sent < r.chunk_times[0] and r.chunk_times[-1] <= r.t_done
    assert r.engine_details["done_reason"] == "length" and r.engine_details["eval_duration"] > 0
    assert backend.reported_version() == "0.30.0"
    assert backend.kv_in_use(None) is None  # not measured
    assert backend.kv_pool() is None  # attached: no server log
    assert backend.show_geometry().num_kv_heads == 3 and backend.running_model()["context_length"] == 512
    assert OllamaBackend.accepts_token_ids is False and OllamaBackend.forces_output_length is False


def test_eos_and_silent_truncation_are_reported_as_the_engine_says(tmp_path, fake, tiny_gguf):
    backend = attached(tmp_path, fake, tiny_gguf)
    fake.eos_after = 5
    (short,) = run(backend, [prompt(50, 16)])
    assert short.error is None and short.output_tokens_reported == 5 and sum(short.chunk_tokens) == 5
    assert short.engine_details["done_reason"] == "stop"
    fake.eos_after = None
    (long,) = run(backend, [prompt(600, 8)])  # over num_ctx 512: Ollama truncates, 200 OK
    assert long.error is None and long.prompt_tokens_sent == 600 and long.prompt_tokens_reported == 512


def test_unknown_model_is_the_404_body(tmp_path, fake, tiny_gguf):
    backend = attached(tmp_path, fake, tiny_gguf)
    backend.model = "nope"
    (r,) = run(backend, [prompt(10, 4)])
    assert r.error == 'HTTP 404: {"error":"model \\"nope\\" not found, try pulling it first"}'


def test_error_line_mid_stream_and_cut_off_stream(tmp_path, fake, tiny_gguf):
    backend = attached(tmp_path, fake, tiny_gguf)
    fake.error_after = 3
    (r,) = run(backend, [prompt(10, 8)])
    assert r.error == "an error was encountered while running the model: unexpected EOF"
    assert sum(r.chunk_tokens) == 3 and r.output_tokens_reported is None
    fake.error_after, fake.cut_after = None, 3
    (r,) = run(backend, [prompt(10, 8)])
    assert r.error and r.output_tokens_reported is None


def test_served_model_that_does_not_exist_fails_the_attach(tmp_path, fake, tiny_gguf):
    with pytest.raises(EngineStartError, match="not found, try pulling it first"):
        attached(tmp_path, fake, tiny_gguf, served_model="llama3.2")


@pytest.mark.parametrize("style", ["llamacpp", "slog"])
def test_start_stream_kv_stop_with_ollama_on_path(tmp_path, monkeypatch, tiny_gguf, style):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "ollama", "tests.fakes.ollama_server")
    only_on_path(monkeypatch, bin_dir)
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FAKE_OLLAMA_LOG_STYLE", style)
    backend = OllamaBackend("0.30.0", tmp_path, {})
    s = spec(tmp_path, max_context=1000, max_concurrency=2, gguf=tiny_gguf)
    backend.start(s, tmp_path / "logs" / "ollama.log", timeout_s=30)
    pid = backend.pid
    try:
        assert listening(pid) == [("127.0.0.1", backend.spec.port)]
        log = (tmp_path / "logs" / "ollama.log").read_text()
        assert "OLLAMA_NUM_PARALLEL:2" in log and "OLLAMA_KV_CACHE_TYPE:f16" in log
        assert (tmp_path / "home" / "ollama" / "models" / "blobs").is_dir()  # OLLAMA_MODELS under KVBENCH_HOME
        (r,) = run(backend, [prompt(300, 8)])
        assert r.error is None and (r.prompt_tokens_reported, r.output_tokens_reported) == (300, 8)
        pool = backend.kv_pool()
        # 2 slots x 1000 cells padded to 1024, 23,040 bytes each: exactly 45 MiB
        assert pool.bytes == 2 * 1024 * BYTES_PER_TOKEN == 45 * MIB
        assert pool.tokens == (2048 if style == "llamacpp" else 2 * 1000)  # slog: context_length x slots from /api/ps
        assert pool.source.startswith("llama_kv_cache" if style == "llamacpp" else 'msg="kv cache"')
        assert pool.details["api_ps"]["context_length"] == 1000
        assert pool.details["bytes_per_token_api_show"] == BYTES_PER_TOKEN
    finally:
        backend.stop()
    assert not psutil.pid_exists(pid)


def test_kv_type_and_flash_attention_reach_the_server(tmp_path, monkeypatch):
    only_on_path(monkeypatch, tmp_path / "bin")
    stand_in(tmp_path / "bin", "ollama", "tests.fakes.ollama_server")
    backend = OllamaBackend("0.30.0", tmp_path, {})
    s = spec(tmp_path, kv_dtype="q8_0", gguf=tmp_path / "m.gguf")
    argv, env = backend.command(type(s)(**{**s.__dict__, "port": 11500}))
    assert argv[1:] == ["serve"] and env["OLLAMA_HOST"] == "127.0.0.1:11500"
    assert env["OLLAMA_KV_CACHE_TYPE"] == "q8_0" and env["OLLAMA_FLASH_ATTENTION"] == "1"
    with pytest.raises(ValueError, match="ollama has no KV dtype 'fp8'; it takes: auto, f16"):
        backend.command(spec(tmp_path, kv_dtype="fp8", gguf=tmp_path / "m.gguf"))


def test_no_ollama_on_path_is_a_clear_start_error(tmp_path, monkeypatch, tiny_gguf):
    only_on_path(monkeypatch, tmp_path / "empty")
    backend = OllamaBackend("0.30.0", tmp_path, {})
    with pytest.raises(EngineStartError, match="ollama not on PATH"):
        backend.start(spec(tmp_path, gguf=tiny_gguf), tmp_path / "ollama.log", timeout_s=5)


def test_log_readers_take_the_last_load():
    text = ('time=t level=INFO source=server.go:400 msg="starting runner" cmd="llama-server -c 2048"\n'
            'time=t level=INFO source=ml/backend.go:250 msg="kv cache" device=CPU size="90.0 MiB"\n'
            'time=t level=INFO source=server.go:400 msg="starting runner" cmd="llama-server -c 4096"\n'
            'time=t level=INFO source=ml/backend.go:250 msg="kv cache" device=CUDA0 size="1.5 GiB"\n'
            'time=t level=INFO source=ml/backend.go:250 msg="kv cache" device=CUDA1 size="512 B"\n')
    assert [d["bytes"] for d in parse_slog_kv(last_load(text))] == [round(1.5 * 1024**3), 512]
    assert len(parse_slog_kv(text)) == 3


def test_a_blob_already_on_the_server_is_not_uploaded_again(tmp_path, fake, tiny_gguf, monkeypatch):
    import ollama
    attached(tmp_path, fake, tiny_gguf)

    def no_upload(self, path):
        raise AssertionError("uploaded again")
    monkeypatch.setattr(ollama.Client, "create_blob", no_upload)
    again = attached(tmp_path, fake, tiny_gguf)
    assert again.model in fake.models
    assert again.running_model()["expires_at"].startswith("2318-")  # JSON values: the client's datetimes dumped


def test_ollama_errors_while_preparing_say_the_status_and_ollamas_message(tmp_path, fake, tiny_gguf):
    with pytest.raises(EngineStartError, match=r"HTTP 404 model 'llama3.2' not found|HTTP 404 model \"llama3.2\" not found"):
        attached(tmp_path, fake, tiny_gguf, served_model="llama3.2")
