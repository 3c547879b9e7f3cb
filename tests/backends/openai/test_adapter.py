"""The attach-only OpenAI-compatible adapter against a fake vLLM-style completions server
(tests/fakes/openai_server.py); queue_state of every adapter that has one."""
from pathlib import Path

import httpx
import pytest

from kvbench.backends import REGISTRY
from kvbench.backends.llamacpp.adapter import LlamaCppBackend
from kvbench.backends.openai.adapter import OpenAIBackend
from kvbench.backends.prometheus import metric_samples
from kvbench.backends.types import EngineStartError
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.run.backend_config import BackendConfig
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.testkit import prompt, run, spec
from tests.helpers import FAKES_DATA


def attached(tmp_path, fake, **options):
    backend = OpenAIBackend("v1", tmp_path, options)
    backend.attach(spec(tmp_path), fake.url, timeout_s=5)
    return backend


def test_text_prompt_one_token_per_text_chunk_and_usage(tmp_path):
    # a server that takes text only and refuses vLLM's extensions: asked, and used as it is
    with FakeOpenAI(model="served-name", vllm_extensions=False, token_id_prompts=False) as fake:
        backend = attached(tmp_path, fake)
        assert backend.model == "served-name"  # the first id of /v1/models
        (r,) = run(backend, [prompt(100, 16)])
        assert backend.reported_version() == "0.32.0"
    assert r.error is None
    assert (r.prompt_tokens_reported, r.output_tokens_reported) == (100, 16)
    assert r.chunk_tokens == [1] * 16 and all(a <= b for a, b in zip(r.chunk_times, r.chunk_times[1:])) and len(set(r.chunk_times)) > 1
    assert r.engine_details["finish_reason"] == "length"
    body = fake.last_request
    assert body["prompt"] == " w" * 100 and body["max_tokens"] == 16 and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body and "min_tokens" not in body and "return_token_ids" not in body
    assert backend.kv_pool() is None and backend.kv_in_use(None) is None
    assert backend.accepts_token_ids is False and backend.forces_output_length is False


def test_token_ids_ignore_eos_and_multi_token_chunks(tmp_path):
    with FakeOpenAI(tokens_per_chunk=4, eos_after=5) as fake:
        backend = attached(tmp_path, fake, token_ids=True, ignore_eos=True, return_token_ids=True)
        (r,) = run(backend, [prompt(50, 16)])
    assert fake.last_request["prompt"] == list(range(100, 150))
    assert fake.last_request["ignore_eos"] is True and fake.last_request["min_tokens"] == 16
    assert r.error is None and r.chunk_tokens == [4, 4, 4, 4] and r.output_tokens_reported == 16
    assert backend.accepts_token_ids and backend.forces_output_length


def test_without_token_ids_a_packed_chunk_counts_once(tmp_path):
    # documented under-count: the usage's completion_tokens stays exact, and the two disagree
    with FakeOpenAI(tokens_per_chunk=4) as fake:
        (r,) = run(attached(tmp_path, fake, token_ids=False), [prompt(50, 16)])
    assert r.chunk_tokens == [1, 1, 1, 1] and r.output_tokens_reported == 16


def test_eos_without_ignore_eos_stops_early(tmp_path):
    with FakeOpenAI(eos_after=5) as fake:
        (r,) = run(attached(tmp_path, fake, ignore_eos=False), [prompt(50, 16)])
    assert r.error is None and r.output_tokens_reported == 5 and r.engine_details["finish_reason"] == "stop"


def test_error_bodies_cut_off_and_missing_usage(tmp_path):
    with FakeOpenAI(max_model_len=128) as fake:
        backend = attached(tmp_path, fake)
        (too_long,) = run(backend, [prompt(120, 16)])
        assert too_long.error.startswith("HTTP 400: ") and "maximum context length is 128 tokens" in too_long.error
        # a served_model the server does not know fails the attach (its first probe), not every request
        with pytest.raises(EngineStartError, match="HTTP 404: .*The model `other` does not exist."):
            attached(tmp_path, fake, served_model="other")
        fake.cut_after = 2
        (cut,) = run(backend, [prompt(10, 8)])
        assert cut.error and cut.output_tokens_reported is None
        fake.cut_after, fake.include_usage = None, False
        (no_usage,) = run(backend, [prompt(10, 8)])
        assert no_usage.error and no_usage.output_tokens_reported is None


def test_the_server_is_asked_what_it_supports_and_what_it_serves(tmp_path):
    with FakeOpenAI() as vllm_like:  # vLLM's dialect: ids, ignore_eos and usage in the stream
        backend = attached(tmp_path, vllm_like)
        (r,) = run(backend, [prompt(50, 16)])
    served = backend.capabilities.served_model
    assert served.support(backend) == {"stream usage": True, "token ids": True, "ignore_eos": True}
    assert served.models(backend) == ["smollm2"] and backend.accepts_token_ids and backend.forces_output_length
    assert vllm_like.last_request["prompt"] == list(range(100, 150)) and vllm_like.last_request["ignore_eos"] is True
    assert r.error is None and r.output_tokens_reported == 16

    with FakeOpenAI(vllm_extensions=False, token_id_prompts=False, include_usage=False) as plain:
        backend = attached(tmp_path, plain)
        (r,) = run(backend, [prompt(50, 16)])
    assert backend.capabilities.served_model.support(backend) == {"stream usage": False, "token ids": False,
                                                                  "ignore_eos": False}
    assert not (backend.accepts_token_ids or backend.forces_output_length)
    body = plain.last_request
    assert isinstance(body["prompt"], str) and "ignore_eos" not in body and "stream_options" not in body
    # no usage chunk from a server that was found to send none: the tokens received count, not an error
    assert r.error is None and r.output_tokens_reported is None and sum(r.chunk_tokens) == 16

    with FakeOpenAI() as told:  # an option given is used as given, not asked
        backend = attached(tmp_path, told, token_ids=False, ignore_eos=False)
    assert backend.capabilities.served_model.support(backend) == {"stream usage": True}
    assert not (backend.accepts_token_ids or backend.forces_output_length)

    with FakeOpenAI() as unasked:  # probe=false: nothing sent before the cells, the options' defaults used
        backend = attached(tmp_path, unasked, probe=False)
    assert backend.capabilities.served_model.support(backend) == {} and unasked.last_request is None
    assert not (backend.accepts_token_ids or backend.forces_output_length)


def test_a_server_without_a_version_endpoint_reports_none(tmp_path):
    with FakeOpenAI(version=None) as fake:
        assert attached(tmp_path, fake).reported_version() is None
    with FakeOpenAI() as fake:
        assert attached(tmp_path, fake).reported_version() == "0.32.0"


# --- whole runs against the fake: the served model, the short outputs of a server without ignore_eos ---------

TINY = """name = "tiny"
seed = 3
prompt_tokens = [32]
output_tokens = 16
concurrency = [1]
rounds = 3
warmup_requests = 1
warmup_prompt_tokens = 16
"""


def whole_run(tmp_path, fake, run_id, **options):
    import io
    import json

    from rich.console import Console

    from kvbench.run.runner import Runner, RunOptions
    from kvbench.store.readers import load_cells
    from kvbench.workloads import load

    (tmp_path / "tiny.toml").write_text(TINY)
    out = io.StringIO()
    opts = RunOptions(model="smollm2", workload=load(str(tmp_path / "tiny.toml")), results_dir=tmp_path,
                      run_id=run_id, estimate=False, backends=[BackendConfig.parse(f"openai:url={fake.url}")],
                      **options)
    run_dir = Runner(opts, Console(file=out, width=200)).run()
    return load_cells(run_dir), json.loads((run_dir / "run.json").read_text()), out.getvalue()


def test_the_served_model_is_recorded_and_set_against_the_model(tmp_path, smollm2):
    with FakeOpenAI(model="Qwen/Qwen2.5-7B-Instruct", version=None) as fake:
        cells, info, console = whole_run(tmp_path, fake, "mismatch")
        label = f"openai@127.0.0.1:{fake.port}"
        assert info["served_models"] == {label: ["Qwen/Qwen2.5-7B-Instruct"]}
        assert (cells.status == "failed").all()
        assert "the server serves Qwen/Qwen2.5-7B-Instruct, not --model smollm2" in cells.error.iloc[0]
        assert "--allow-model-mismatch" in cells.error.iloc[0]
        cells, info, console = whole_run(tmp_path, fake, "allowed", allow_model_mismatch=True)
    assert (cells.status != "failed").all() and "warning: the server serves Qwen/Qwen2.5-7B-Instruct" in console
    from kvbench.reports import build

    header = dict(build([tmp_path / "allowed"]).headers[0])
    assert header["Served models"].startswith(f"{label}: Qwen/Qwen2.5-7B-Instruct (asked: `stream usage yes")  # a code span: a server's words
    assert header["Model"].startswith("smollm2")  # the model whose KV is predicted, the served one beside it
    assert cells.engine_version_reported.isna().all()  # no /version: unknown, not "v1"
    with FakeOpenAI(model="HuggingFaceTB/SmolLM2-135M-Instruct") as fake:  # the same model, named as the hub does
        cells, info, _ = whole_run(tmp_path, fake, "same")
    assert (cells.status == "ok").all() and info["capabilities"][f"openai@127.0.0.1:{fake.port}"] == {
        "stream usage": True, "token ids": True, "ignore_eos": True}
    assert set(cells.token_contract) == {"token ids, output forced"}


def test_a_server_without_ignore_eos_keeps_the_timings_of_its_short_outputs(tmp_path, smollm2):
    # the defaults, against a server that ends every output at EOS after 5 tokens and knows no ignore_eos
    with FakeOpenAI(vllm_extensions=False, token_id_prompts=False, eos_after=5) as fake:
        cells, info, _ = whole_run(tmp_path, fake, "short")
    row = cells.iloc[0]
    assert row.token_contract == "text, output as generated"
    assert row.status == "flagged" and row.n_short == 3 and row.n_ok == 3 and row.ttft_s_p50 > 0
    assert row.output_tokens_per_s > 0
    assert all("short output: the server does not honour ignore_eos (output 16 asked / 5 generated)" in f
               for f in row["flags"])


def test_start_needs_a_url(tmp_path):
    backend = OpenAIBackend("v1", tmp_path, {})
    with pytest.raises(EngineStartError, match="benchmarks a running server: give it a url"):
        backend.start(spec(tmp_path), tmp_path / "x.log", timeout_s=5)


def test_registered_and_parsed():
    assert {"tgi", "ollama", "openai"} <= set(REGISTRY)
    cfg = BackendConfig.parse("openai:url=http://127.0.0.1:8000,served_model=m,ignore_eos=true")
    assert (cfg.engine, cfg.url, cfg.options) == ("openai", "http://127.0.0.1:8000", {"served_model": "m", "ignore_eos": True})
    assert BackendConfig.parse("tgi").version == "3.3.5" and BackendConfig.parse("ollama").engine == "ollama"


def _metrics_client(text: str, status: int = 200) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(status, text=text)))


def test_queue_state_of_vllm_and_llamacpp(tmp_path):
    vllm = VLLMBackend("0.32.0", tmp_path, {})
    vllm.base_url = "http://127.0.0.1:1"
    text = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 3.0\n"
            "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{model_name=\"m\"} 7.0\n")
    state = vllm.queue_state(_metrics_client(text))
    assert state["waiting"] == 3.0 and state["preemptions"] == 7.0 and "vllm:num_requests_waiting" in state["source"]
    assert vllm.queue_state(_metrics_client("")) is None
    llama = LlamaCppBackend("0.3.36", tmp_path, {})
    llama.base_url = "http://127.0.0.1:1"
    text = ("# HELP llamacpp:requests_deferred Number of requests deferred.\n# TYPE llamacpp:requests_deferred gauge\n"
            "llamacpp:requests_deferred 2\n# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 4\n")
    state = llama.queue_state(_metrics_client(text))
    assert state["waiting"] == 2 and "llamacpp:requests_deferred" in state["source"]
    assert llama.queue_state(_metrics_client("", status=501)) is None
    assert OpenAIBackend("v1", tmp_path, {}).queue_state(None) is None  # the base default


def test_vllm_poll_reads_one_metrics_page_and_parses_only_what_it_needs(tmp_path):
    """A real vLLM 0.32.0 /metrics page (600 lines, mostly histograms), with the KV gauge and queue set:
    one poll fetches it once, and the filtered parse gives what the full parse gives for those samples."""
    page = (FAKES_DATA / "vllm-0.32.0-metrics.txt").read_text()
    page = (page.replace('vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0',
                         'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.045454545454545456')
                .replace('vllm:num_requests_waiting{engine="0",model_name="smollm2"} 0.0',
                         'vllm:num_requests_waiting{engine="0",model_name="smollm2"} 5.0')
                .replace('vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0',
                         'vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0'))
    fetches = []
    client = httpx.Client(transport=httpx.MockTransport(
        lambda request: fetches.append(request.url.path) or httpx.Response(200, text=page)))
    vllm = VLLMBackend("0.32.0", tmp_path, {})
    vllm.base_url = "http://127.0.0.1:1"
    vllm.spec = spec(tmp_path)
    vllm._cache_info = metric_samples(page)["vllm:cache_config_info"][0][0]  # read once at start in a run
    state = vllm.poll(client)
    assert fetches == ["/metrics"]
    # 67 blocks of 128, one of them vLLM's null block: 0.04545... x 66 = 3 blocks in use
    assert state.kv.tokens == 3 * 128 and state.kv.bytes == 3 * 128 * vllm.kv_bytes_per_token()
    assert (state.queue["waiting"], state.queue["running"], state.queue["preemptions"]) == (5.0, 3.0, 0.0)
    names = ("vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc", "absent")
    full = metric_samples(page)
    assert metric_samples(page, names) == {n: full[n] for n in names if n in full}
    assert len(full) > 100  # the page really is mostly other samples
