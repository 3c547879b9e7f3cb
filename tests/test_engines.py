"""Real engines on the embedded model with the smoke workload: figures come back and make sense."""
import io
import math

import pandas as pd
import pytest
from rich.console import Console

from bench.config import BackendConfig
from bench.kvmodel import round_up
from bench.results import load_cells, load_run_info
from bench.runner import RunOptions, Runner
from workloads import load

from .conftest import engine_env

pytestmark = pytest.mark.engine
SMOLLM2_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # 2 x layers x kv heads x head_dim x bf16/f16


def run_smoke(tmp_path_factory, *backends, **options):
    for b in backends:
        engine_env(BackendConfig.parse(b).engine)
    root = tmp_path_factory.mktemp("runs")
    opts = RunOptions(model="smollm2", workload=load("smoke"), backends=[BackendConfig.parse(b) for b in backends],
                      results_dir=root, run_id="run", start_timeout_s=300, request_timeout_s=300, **options)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir)


def requests_of(run_dir) -> pd.DataFrame:
    return pd.read_json(run_dir / "requests.jsonl", lines=True)


def check_common(run_dir, cells: pd.DataFrame):
    """What every engine's smoke run must show."""
    wl = load("smoke")
    assert len(cells) == len(wl.prompt_tokens) * len(wl.concurrency)
    assert (cells.status == "ok").all(), cells[["cell_id", "status", "error", "flags"]].to_string()
    assert (cells.schema_version == 1).all()
    assert (cells.ttft_s_p50 > 0).all() and (cells.output_tokens_per_s > 0).all()
    assert (cells.itl_s_p50 > 0).all() and (cells.e2e_s_p50 > cells.ttft_s_p50).all()
    assert (cells.kv_bytes_per_token_predicted == SMOLLM2_BYTES_PER_TOKEN).all()
    # memory sampled at 10 Hz or faster, over the engine's whole process tree
    assert (cells.memory_sample_hz >= 10).all() and (cells.rss_peak_bytes > 50e6).all()
    # KV in use grows with the prompt at each concurrency
    for _, group in cells.groupby("concurrency"):
        ordered = group.sort_values("prompt_tokens")
        assert ordered.kv_in_use_peak_bytes.is_monotonic_increasing
        assert ordered.kv_in_use_peak_bytes.iloc[-1] > ordered.kv_in_use_peak_bytes.iloc[0]
    # every request met the token contract and kept its chunk timestamps
    reqs = requests_of(run_dir)
    warmup = reqs[reqs.warmup]
    assert len(warmup) == wl.warmup_requests and warmup.error.isna().all()  # recorded, not counted
    reqs = reqs[~reqs.warmup]
    assert len(reqs) == sum(c * wl.rounds for c in wl.concurrency) * len(wl.prompt_tokens)
    assert (reqs.prompt_tokens_reported == reqs.prompt_tokens_sent).all()
    assert (reqs.output_tokens_reported == wl.output_tokens).all()
    assert (reqs.output_tokens_received == wl.output_tokens).all()
    assert all(sorted(t) == t for t in reqs.chunk_times)
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
    return run_smoke(tmp_path_factory, "vllm")


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
    check_common(run_dir, cells)
    block = 128
    for row in cells.itertuples():
        # the pool vLLM allocated is whole blocks of block_size x the formula's bytes per token:
        # num_gpu_blocks = budget // bytes_per_block, so a wrong bytes/token would change the block count
        blocks = row.kv_pool_tokens_engine // block
        assert blocks == row.kv_pool_bytes_engine // (block * SMOLLM2_BYTES_PER_TOKEN)
        assert row.kv_pool_bytes_predicted == blocks * block * SMOLLM2_BYTES_PER_TOKEN
        # in use is block-rounded: never below the tokens held, never above whole blocks for them
        upper = row.concurrency * round_up(row.prompt_tokens + row.output_tokens - 1, block)
        assert row.kv_in_use_peak_tokens <= upper
        if row.concurrency == 1:
            assert row.kv_in_use_peak_tokens == upper
            assert row.kv_measured_over_predicted >= 1
    assert (cells.engine_version_reported == "0.32.0").all()


def test_llamacpp(llama_run):
    run_dir, cells = llama_run
    check_common(run_dir, cells)
    wl = load("smoke")
    slots = max(wl.concurrency)
    cells_per_slot = round_up(max(wl.prompt_tokens) + wl.output_tokens, 256)  # llama.cpp pads n_ctx to 256
    for row in cells.itertuples():
        assert row.kv_pool_tokens_engine == slots * cells_per_slot
        # the logged MiB (two decimals) equals the formula for every cell
        assert math.isclose(row.kv_pool_bytes_engine, slots * cells_per_slot * SMOLLM2_BYTES_PER_TOKEN,
                            abs_tol=0.005 * 2**20)
        assert row.kv_in_use_peak_tokens <= row.concurrency * (row.prompt_tokens + row.output_tokens - 1)
        if row.concurrency == 1:
            assert row.kv_in_use_peak_tokens >= row.prompt_tokens
