"""Real engines on the embedded model with the smoke workload: figures come back and make sense."""
import io
import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from kvbench.kv.geometry import round_up
from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells, load_run_info
from kvbench.store.schema import SCHEMA_VERSION
from kvbench.workloads import load

from tests.helpers import engine_env

pytestmark = pytest.mark.engine
SMOLLM2_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # 2 x layers x kv heads x head_dim x bf16/f16


# vLLM's KV gauge is set by its API server as each step's output is handled. On a busy 2-core machine
# that process can fall ~0.5 s behind the engine, longer than a 16-token decode: the polls then read
# the idle gauge through the whole request. A 64-token decode outlasts such a stall.
POLLED_SMOKE = load("smoke").model_copy(update={"output_tokens": 64})


def run_smoke(tmp_path_factory, *backends, workload=None, **options):
    for b in backends:
        engine_env(BackendConfig.parse(b).engine)
    root = tmp_path_factory.mktemp("runs")
    opts = RunOptions(model="smollm2", workload=workload or load("smoke"), backends=[BackendConfig.parse(b) for b in backends],
                      results_dir=root, run_id="run", start_timeout_s=300, request_timeout_s=300, **options)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir)


def requests_of(run_dir) -> pd.DataFrame:
    return pd.read_json(run_dir / "requests.jsonl", lines=True)


def check_common(run_dir, cells: pd.DataFrame, wl=None):
    """What every engine's smoke run must show."""
    wl = wl or load("smoke")
    assert len(cells) == len(wl.prompt_tokens) * len(wl.load.concurrency)
    assert (cells.status == "ok").all(), cells[["cell_id", "status", "error", "flags"]].to_string()
    assert (cells.schema_version == SCHEMA_VERSION).all()
    assert (cells.ttft_s_p50 > 0).all() and (cells.output_tokens_per_s > 0).all()
    assert (cells.e2e_s_p50 > cells.ttft_s_p50).all()
    assert (cells.kv_bytes_per_token_predicted == SMOLLM2_BYTES_PER_TOKEN).all()
    # memory sampled at 10 Hz or faster, over the engine's whole process tree; on a CI machine whose cores
    # other tests keep busy, the sampler's thread may get no CPU for a while: then the row says so
    paused = cells["flags"].map(lambda flags: any(f.startswith("memory not sampled for") for f in flags))
    assert ((cells.memory_sample_hz >= 10) | paused).all(), cells[["cell_id", "memory_sample_hz", "flags"]]
    assert (cells.memory_sample_hz >= 10).any() and (cells.rss_peak_bytes > 50e6).all()
    # KV in use grows with the prompt at each concurrency. A polled figure that no poll caught (a gauge
    # behind an engine other tests starve of CPU) is "not measured", and says so, never a zero. A poll is a
    # sample: at 2 in flight on a starved machine it may see one request of the long rung where it saw both
    # of the short one (equal peaks), so the growth must show at one concurrency at least, never a fall
    missed = cells.kv_in_use_peak_bytes.isna()
    assert cells[missed].kv_in_use_source.str.startswith("not measured: none of").all()
    grown = 0
    for _, group in cells[~missed].groupby("concurrency"):
        ordered = group.sort_values("prompt_tokens")
        assert ordered.kv_in_use_peak_bytes.is_monotonic_increasing, \
            ordered[["cell_id", "kv_in_use_peak_bytes", "kv_in_use_source", "client_loop_lag_s_max"]].to_string()
        grown += len(ordered) > 1 and ordered.kv_in_use_peak_bytes.iloc[-1] > ordered.kv_in_use_peak_bytes.iloc[0]
    assert grown, cells[["cell_id", "kv_in_use_peak_bytes", "kv_in_use_source"]].to_string()
    # every request met the token contract and kept its chunk timestamps
    reqs = requests_of(run_dir)
    warmup = reqs[reqs.warmup]
    # the workload's warm-up and the estimate's two calibration requests: recorded, not counted
    assert len(warmup) == wl.warmup_requests + 2 and warmup.error.isna().all()
    reqs = reqs[~reqs.warmup]
    assert len(reqs) == sum(c * wl.load.rounds for c in wl.load.concurrency) * len(wl.prompt_tokens)
    assert (reqs.prompt_tokens_reported == reqs.prompt_tokens_sent).all()
    assert (reqs.output_tokens_reported == wl.output_tokens).all()
    assert (reqs.output_tokens_received == wl.output_tokens).all()
    assert all(sorted(t) == t for t in reqs.chunk_times)
    # ITL has a sample wherever a request's tokens arrived in two reads or more (docs/metrics.md); a
    # stalled client reads a whole short stream at once, and then the cell has none, and says so
    for row in cells.itertuples():
        spread = [len(set(t)) > 1 for t in reqs[reqs.cell_id == row.cell_id].chunk_times]
        assert (row.itl_s_p50 > 0) if any(spread) else pd.isna(row.itl_s_p50), (row.cell_id, row.client_loop_lag_s_max)
    assert (cells.client_loop_lag_s_max >= 0).all()
    for row in cells.itertuples():
        timeline = pd.read_csv(run_dir / "timelines" / f"{row.cell_id}.csv")
        assert (timeline.series == "memory").sum() == row.memory_samples
        assert (timeline.series == "kv").sum() > 0
    info = load_run_info(run_dir)
    assert info["status"] == "finished" and info["model"]["sha256"] and info["environment"]["cpu_count"]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    return run_smoke(tmp_path_factory, "hf")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return run_smoke(tmp_path_factory, "vllm", workload=POLLED_SMOKE)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return run_smoke(tmp_path_factory, "llamacpp")


def test_hf(hf_run):
    run_dir, cells = hf_run
    check_common(run_dir, cells)
    # transformers' cache tensors equal the formula exactly: every sequence caches prompt + output - 1 tokens
    assert (cells.kv_in_use_peak_bytes == cells.kv_bytes_peak_predicted).all()
    assert (cells.kv_in_use_peak_bytes == SMOLLM2_BYTES_PER_TOKEN * cells.concurrency
            * (cells.prompt_tokens + cells.output_tokens - 1)).all()
    assert cells.kv_pool_bytes_engine.isna().all()  # static batching: no pool
    assert (cells.engine_version_reported == "5.24.0").all()


def test_vllm(vllm_run):
    run_dir, cells = vllm_run
    check_common(run_dir, cells, POLLED_SMOKE)
    block = 128
    for row in cells.itertuples():
        # the pool vLLM allocated is whole blocks of block_size x the formula's bytes per token:
        # num_gpu_blocks = budget // bytes_per_block, so a wrong bytes/token would change the block count
        blocks = row.kv_pool_tokens_engine // block
        assert blocks == row.kv_pool_bytes_engine // (block * SMOLLM2_BYTES_PER_TOKEN)
        assert row.kv_pool_bytes_predicted == blocks * block * SMOLLM2_BYTES_PER_TOKEN
        # in use is block-rounded: never below the tokens held, never above whole blocks for them
        upper = row.concurrency * round_up(row.prompt_tokens + row.output_tokens - 1, block)
        assert not row.kv_in_use_peak_tokens > upper
        if row.concurrency == 1 and not pd.isna(row.kv_in_use_peak_tokens):
            assert row.kv_in_use_peak_tokens == upper, (row.kv_in_use_source, row.client_loop_lag_s_max)
            assert row.kv_measured_over_predicted >= 1
    single = cells[cells.concurrency == 1]
    assert single.kv_in_use_peak_tokens.notna().any(), single[["cell_id", "kv_in_use_source"]].to_string()
    assert (cells.engine_version_reported == "0.32.0").all()
    # vLLM's own bytes a step (--enable-mfu-metrics): every step reads the weights (the bf16 checkpoint, as
    # served on a CPU) once, and no more than them twice and the whole pool
    weights = json.loads((run_dir / "run.json").read_text())["model"]["checkpoint_bytes"]
    for row in cells.itertuples():
        assert weights <= row.engine_step_read_bytes <= 2 * weights + row.kv_pool_bytes_engine, row.engine_step_bytes_source
        assert row.engine_step_write_bytes > 0 and "steps over the cell" in row.engine_step_bytes_source


def test_llamacpp(llama_run):
    run_dir, cells = llama_run
    check_common(run_dir, cells)
    # how llama-server was built for this CPU, as `kvbench backends` says it (AMX left out where the CPU has it)
    from kvbench.backends.llamacpp.adapter import LlamaCppBackend

    (label,) = set(cells.backend)
    build = load_run_info(run_dir)["engine_builds"][label]
    assert build == LlamaCppBackend.machine_build(LlamaCppBackend.default_version) and build.startswith("GGML_NATIVE=")
    built_flags = (Path(engine_env("llamacpp")) / "BUILD_FLAGS").read_text()
    assert ("-mno-amx-int8" in built_flags) == ("without AMX" in build)
    wl = load("smoke")
    slots = max(wl.load.concurrency)
    cells_per_slot = round_up(max(wl.prompt_tokens) + wl.output_tokens, 256)  # llama.cpp pads n_ctx to 256
    measured = 0
    for row in cells.itertuples():
        assert row.kv_pool_tokens_engine == slots * cells_per_slot
        # the logged MiB (two decimals) equals the formula for every cell
        assert math.isclose(row.kv_pool_bytes_engine, slots * cells_per_slot * SMOLLM2_BYTES_PER_TOKEN,
                            abs_tol=0.005 * 2**20)
        if math.isnan(row.kv_in_use_peak_tokens):  # on a busy machine the 10 Hz poll can miss a short request:
            assert row.kv_in_use_source.startswith("not measured: none of"), row.kv_in_use_source  # said so
            continue
        measured += 1
        assert row.kv_in_use_peak_tokens <= row.concurrency * (row.prompt_tokens + row.output_tokens - 1)
        if row.concurrency == 1:
            assert row.kv_in_use_peak_tokens >= row.prompt_tokens
    assert measured >= len(cells) / 2
    # the start's check: its pool and its output buffer (a row of logits a slot: the plan's host memory) as logged
    (check,) = load_run_info(run_dir)["startup_checks"].values()
    assert check["verdict"] == "plan within tolerance", check
    out = check["off_by"]["term: output buffer"]
    # printed to two decimals of MiB: within half the last digit
    assert out["ok"] and out["planned"] == slots * 49_152 * 4 and abs(out["logged"] - out["planned"]) <= 0.005 * 2**20 + 1


def run_workload(tmp_path_factory, workload, *backends):
    root = tmp_path_factory.mktemp("runs")
    opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse(b) for b in backends],
                      results_dir=root, run_id="run", start_timeout_s=300, request_timeout_s=300)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir)


def test_attach_to_a_running_llamacpp_with_an_open_loop(tmp_path_factory, smollm2):
    """A llama-server kvbench did not start: it is benchmarked, left running, and its memory is "not
    measured" (None), never 0. The load is an open loop (Poisson arrivals, at most 2 in flight)."""
    from kvbench.backends.llamacpp.adapter import LlamaCppBackend
    from kvbench.backends.types import ServerSpec
    from kvbench.workloads import Workload

    server = LlamaCppBackend(LlamaCppBackend.default_version, engine_env("llamacpp"))
    server.start(ServerSpec(model=smollm2, max_context=512, max_concurrency=2, kv_dtype="auto"),
                 tmp_path_factory.mktemp("external") / "llama.log", 120)
    try:
        wl = Workload(name="attach", seed=5, prompt_tokens=[64], output_tokens=8, load_profile="poisson",
                      request_rates=[4.0], concurrency=[2], requests=6, warmup_requests=0)
        run_dir, cells = run_workload(tmp_path_factory, wl, f"llamacpp:url={server.base_url}")
        assert server.alive()  # kvbench does not stop what it did not start
        row = cells.iloc[0]
        assert row.status == "ok", row.flags
        assert row.attached and row.backend == f"llamacpp@{server.base_url.split('//')[1]}"
        assert row.load_profile == "poisson" and row.request_rate == 4.0 and row.offered_request_rate == 4.0
        assert 0 < row.achieved_request_rate and row.max_in_flight <= 2 and row.n_ok == 6
        assert pd.isna(row.rss_peak_bytes) and row.memory_samples == 0  # not measured, not zero
        assert row.kv_in_use_peak_tokens > 0  # /slots still answers remotely
        assert row.token_contract == "token ids, output forced"
        info = load_run_info(run_dir)
        assert "tokenize endpoint" in info["token_checks"][row.backend]
        # what it serves, read from its /v1/models: the GGUF --model names (else the cells would have failed)
        (served,) = info["served_models"][row.backend]
        assert served.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") or "SmolLM2" in served, served
        reqs = requests_of(run_dir)
        reqs = reqs[~reqs.warmup]  # the estimate's calibration requests are warm-ups, off the schedule
        # uvloop rounds timers to whole milliseconds: a request may leave up to about 1 ms early
        assert reqs.t_scheduled.notna().all() and (reqs.t_sent >= reqs.t_scheduled - 2e-3).all()
    finally:
        server.stop()
    assert not server.alive()


def test_vllm_kv_boundary(tmp_path_factory):
    """The pool holds 2 sequences of 48 + 64 tokens (one 128-token block each, plus the null block); 4
    requests at once: vLLM runs 2 and queues the rest, as the KV model predicts. (Sequences stay inside
    their first block, so vLLM never has to preempt one to grow another; 64 decode steps keep each state
    for a second or more, many polls at 10 Hz.)"""
    from kvbench.workloads import Workload

    engine_env("vllm")
    wl = Workload(name="boundary", family="kv_boundary", seed=5, prompt_tokens=[48], output_tokens=64,
                  kv_pool_sequences=2, concurrency=[4], warmup_requests=0)
    run_dir, cells = run_workload(tmp_path_factory, wl, "vllm")
    row = cells.iloc[0]
    assert row.status == "ok", (row.error, row.flags)
    assert row.kv_pool_tokens_engine == (2 * 1 + 1) * 128
    assert row.kv_pool_sequences_predicted == 2
    diagnosis = (row.queue_source, row.client_loop_lag_s_max)  # polls taken, and how late the client ran
    assert row.requests_running_peak == 2 and row.requests_waiting_peak >= 1, diagnosis
    assert row.preemptions == 0
    assert row.kv_in_use_peak_tokens <= 2 * 128


def test_all_six_backends_in_one_run(tmp_path_factory, monkeypatch):
    """hf, vllm and llama.cpp for real; TGI and Ollama started from stand-in executables of their faithful
    fakes (tests/fakes/); a fake OpenAI-compatible server attached by URL: one run, one row each."""
    from kvbench.workloads import Workload
    from tests.fakes.openai_server import FakeOpenAI
    from tests.fakes.testkit import stand_in

    for engine in ("hf", "vllm", "llamacpp"):
        engine_env(engine)
    bin_dir = tmp_path_factory.mktemp("bin")
    stand_in(bin_dir, "text-generation-launcher", "tests.fakes.tgi_server")
    stand_in(bin_dir, "ollama", "tests.fakes.ollama_server")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    wl = Workload(name="six", seed=5, prompt_tokens=[32], output_tokens=4, concurrency=[1], warmup_requests=0)
    # a generic OpenAI-compatible server: text prompts only, no ignore_eos (the adapter asks, and uses text)
    with FakeOpenAI(vllm_extensions=False, token_id_prompts=False) as fake:
        run_dir, cells = run_workload(tmp_path_factory, wl, "hf", "vllm", "llamacpp", "tgi",
                                      f"ollama:models_dir={tmp_path_factory.mktemp('ollama-models')}",
                                      f"openai:url={fake.url}")
    assert sorted(cells.engine) == ["hf", "llamacpp", "ollama", "openai", "tgi", "vllm"]
    assert (cells.status == "ok").all(), cells[["backend", "status", "error", "flags"]].to_string()
    contracts = dict(zip(cells.engine, cells.token_contract))
    assert contracts["vllm"] == contracts["llamacpp"] == contracts["hf"] == "token ids, output forced"
    assert contracts["tgi"] == contracts["ollama"] == contracts["openai"] == "text, output as generated"
    assert cells.set_index("engine").attached.to_dict() == {
        "hf": False, "vllm": False, "llamacpp": False, "tgi": False, "ollama": False, "openai": True}
