"""The decode bound (bench/common/bandwidth.py, bench/run/decode_bound.py): the bytes a decode step reads over the
measured read bandwidth, beside the cell's ITL."""
from dataclasses import replace

import pytest

from kvbench.backends.types import KVPool
from kvbench.common import bandwidth
from kvbench.common.bandwidth import decode_bound, read_bandwidth, run_probe
from kvbench.run.plan import routed_experts
from kvbench.run.rows import EngineRun, summarize
from kvbench.store.schema import SCHEMA_VERSION, CellRow, migrate_row

from tests.fakes.testkit import BYTES_PER_TOKEN
from tests.helpers import DATA
from tests.run.test_rows_summary import WORKLOAD, engine_run, measurement, request

PROBED = {"device": "cpu", "bytes_per_s": 1e10, "threads": 2}


def run_with(tmp_path, **kw) -> EngineRun:
    return replace(engine_run(tmp_path), **kw)


def test_the_bound_is_the_weights_and_every_sequences_kv_over_the_bandwidth():
    b = decode_bound(1e9, 2e6, 4, 1e10)
    assert (b.step_bytes, b.kv_bytes, b.itl_s) == (1e9 + 8e6, 8e6, (1e9 + 8e6) / 1e10)
    assert b.kv_share == pytest.approx(8e6 / (1e9 + 8e6))


@pytest.mark.parametrize("args", [(1e9, 1e6, 1, 0.0), (1e9, 1e6, 0, 1e10), (-1.0, 1e6, 1, 1e10),
                                  (1e9, float("nan"), 1, 1e10), (1e9, 1e6, 1, float("nan"))])
def test_a_bound_of_sizes_no_step_has_is_refused(args):
    with pytest.raises(ValueError):
        decode_bound(*args)


def test_a_row_carries_the_bound_its_efficiency_and_what_they_came_from(tmp_path):
    """Two sequences of 100-token prompts and 4 output tokens: at the mean decode step each has 100 + 3 // 2 = 101
    tokens cached; the weights are the engine's own figure; ITLs of 0.1 s."""
    pool = KVPool(bytes=None, tokens=None, source="no pool",
                  details={"weights_bytes": 2e8, "weights_source": "parameters and buffers as loaded"})
    m = measurement([request(0, 10.0), request(1, 10.1)], kv_pool=pool)
    row = summarize(run_with(tmp_path, memory_bandwidth=PROBED, checkpoint_bytes=999), m)
    step = 2e8 + 2 * 101 * BYTES_PER_TOKEN
    assert row.decode_step_bytes == pytest.approx(step)
    assert row.decode_kv_share == pytest.approx(2 * 101 * BYTES_PER_TOKEN / step)
    assert row.itl_s_bound == pytest.approx(step / 1e10)
    assert row.itl_s_p50 == pytest.approx(0.1) and row.decode_efficiency == pytest.approx(step / 1e10 / 0.1)
    assert "(parameters and buffers as loaded)" in row.decode_bound_source
    assert "10.0 GB/s (2 threads" in row.decode_bound_source and "2 x 101 tokens" in row.decode_bound_source


def test_without_the_engines_weights_the_checkpoint_is_read_and_said(tmp_path):
    row = summarize(run_with(tmp_path, memory_bandwidth=PROBED, checkpoint_bytes=10**8),
                    measurement([request(0, 10.0)]))
    assert row.decode_step_bytes == pytest.approx(1e8 + 2 * 101 * BYTES_PER_TOKEN)  # 2 in flight at most
    assert "the checkpoint's tensors as stored" in row.decode_bound_source


@pytest.mark.parametrize("probe, checkpoint, reason", [
    (None, 10**8, "no bandwidth was probed"),
    ({"not_measured": "a GPU machine: ..."}, 10**8, "a GPU machine"),
    (PROBED, None, "the engine reported no weights"),
])
def test_a_bound_that_cannot_be_had_is_none_and_says_why(tmp_path, probe, checkpoint, reason):
    row = summarize(run_with(tmp_path, memory_bandwidth=probe, checkpoint_bytes=checkpoint),
                    measurement([request(0, 10.0)]))
    assert (row.itl_s_bound, row.decode_efficiency, row.decode_step_bytes) == (None, None, None)
    assert row.decode_bound_source.startswith("not measured: ") and reason in row.decode_bound_source


def test_a_moe_models_step_reads_the_experts_its_tokens_take(tmp_path):
    """Qwen3-30B-A3B's experts as run.json records them (128 routed, 8 a token, 95 % of the weights): one
    sequence in flight reads 8/128 of them; two read 1 - (120/128)^2 (each token draws its own)."""
    moe = routed_experts(DATA / "configs" / "qwen3-30b-a3b.json")
    assert (moe["routed_experts"], moe["experts_per_token"]) == (128, 8) and 0.9 < moe["expert_share"] < 1
    assert routed_experts(tmp_path) is None  # no config: dense as far as the bound knows
    row = summarize(run_with(tmp_path, memory_bandwidth=PROBED, checkpoint_bytes=10**9, moe=moe),
                    measurement([request(0, 10.0)]))
    read = 1 - (1 - 8 / 128) ** 2  # 2 in flight at most (the measurement's load)
    weights = 1e9 * ((1 - moe["expert_share"]) + moe["expert_share"] * read)
    assert row.decode_step_bytes == pytest.approx(weights + 2 * 101 * BYTES_PER_TOKEN)
    assert "the routed experts (95%) read at 12%: 2 tokens a step taking 8 of 128 each" in row.decode_bound_source
    dense = summarize(run_with(tmp_path, memory_bandwidth=PROBED, checkpoint_bytes=10**9),
                      measurement([request(0, 10.0)]))
    assert dense.decode_step_bytes == pytest.approx(1e9 + 2 * 101 * BYTES_PER_TOKEN) and "experts" not in dense.decode_bound_source


def test_the_probe_reads_past_the_cache_and_gives_a_bandwidth():
    got = read_bandwidth(threads=1, rounds=1)
    assert got["array_bytes"] >= bandwidth.MIN_ARRAY and got["threads"] == 1
    # any memory a machine has reads between 100 MB/s and 10 TB/s: a figure outside is a broken probe
    assert 1e8 < got["bytes_per_s"] < 1e13


def test_the_probe_is_off_when_asked_and_on_a_gpu_machine(monkeypatch):
    monkeypatch.setenv(bandwidth.PROBE_SWITCH, "off")
    assert "switched off" in run_probe({})["not_measured"]
    monkeypatch.setenv(bandwidth.PROBE_SWITCH, "on")
    assert "GPU machine" in run_probe({"gpus": [{"name": "H100"}]})["not_measured"]
    assert run_probe({"gpus": [{"name": "H100"}]}, lambda: {"device": "gpu"}) == {"device": "gpu"}
    monkeypatch.setattr(bandwidth, "read_bandwidth", lambda: {"bytes_per_s": 1.0, "threads": 3})
    assert run_probe({"gpus": []}) == {"device": "cpu", "bytes_per_s": 1.0, "threads": 3,
                                       "label": "3 threads, measured at the run's start"}


def test_a_row_of_an_earlier_schema_has_no_bound():
    old = {k: v for k, v in CellRow(run_id="r", cell_id="c", backend="b", engine="e", engine_version="1", model="m",
                                    workload="w", prompt_tokens=1, output_tokens=1, concurrency=1, kv_dtype="bf16",
                                    status="ok").model_dump().items() if not k.startswith(("decode_", "itl_s_bound"))}
    old["schema_version"] = 9
    new = migrate_row(old, CellRow)
    assert new["itl_s_bound"] is None and new["decode_bound_source"] is None and new["schema_version"] == SCHEMA_VERSION
