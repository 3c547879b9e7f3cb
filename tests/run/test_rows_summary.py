"""kvbench.run.rows.summarize: a cell's row from a hand-made measurement, no engine and no I/O."""
from kvbench.backends import REGISTRY
from kvbench.backends.types import KVInUse, KVPool, RequestResult
from kvbench.load import LoadPoint, LoadResult
from kvbench.run.cells import Cell
from kvbench.run.rows import (
    CellMeasurement,
    EngineRun,
    failed_row,
    memory_gap_flag,
    request_verdicts,
    summarize,
    summary_line,
)
from kvbench.run.samplers import KVSample, MemorySample, QueueSample
from kvbench.workloads import Workload

from tests.fakes.testkit import BYTES_PER_TOKEN, spec

WORKLOAD = Workload(name="w", seed=1, prompt_tokens=[100], output_tokens=4, concurrency=[2])
CELL = Cell(100, LoadPoint("concurrent", 2), requests=2)


def engine_run(tmp_path, engine="vllm") -> EngineRun:
    return EngineRun("run1", f"{engine}-1", engine, "1", spec(tmp_path).model, WORKLOAD, "auto", attached=False,
                     engine_version_reported="1.0 (abc)", token_contract="token ids, output forced",
                     rules=REGISTRY[engine].kv_rules)


def request(i, t0, error=None, out=4, prompt_read=100) -> RequestResult:
    r = RequestResult(f"r{i}", 100, 4, t0)
    if error:
        r.error, r.t_done = error, t0 + 0.1
        return r
    for k in range(out):
        r.add_chunk(t0 + 0.5 + 0.1 * k, 1)
    r.t_done, r.prompt_tokens_reported, r.output_tokens_reported = t0 + 1.0, prompt_read, out
    return r


def measurement(results, **kw) -> CellMeasurement:
    load = LoadResult(results, 10.0, 12.0, max_in_flight=2)
    return CellMeasurement(CELL, load, t_cell_start=10.0, kv_dtype="bf16", **kw)


def test_an_ok_cell_with_polled_kv_pool_queue_and_memory(tmp_path):
    results = [request(0, 10.0), request(1, 10.1)]
    pool = KVPool(bytes=9 * 128 * BYTES_PER_TOKEN, tokens=9 * 128, source="vllm:cache_config_info",
                  details={"block_size": 128})
    m = measurement(results, kv_pool=pool, kv_source="gauge", queue_source="q",
                    kv_samples=[KVSample(10.6, 256 * BYTES_PER_TOKEN, 256), KVSample(10.9, 0.0, 0)],
                    queue_samples=[QueueSample(10.6, 0, 2, 3), QueueSample(10.9, 1, 1, 4)],
                    memory_samples=[MemorySample(10.0, 100, 2), MemorySample(10.5, 300, 3), MemorySample(11.0, 200, 3)],
                    rss_baseline_bytes=90)
    row = summarize(engine_run(tmp_path), m)
    assert (row.status, row.n_ok, row.n_requests, row.flags) == ("ok", 2, 2, [])
    assert row.engine_version_reported == "1.0 (abc)" and row.token_contract == "token ids, output forced"
    assert row.cell_id == "vllm-1_p100_c2_r0" and row.kv_dtype == "bf16"
    assert row.ttft_s_p50 is not None and row.output_tokens_per_s is not None
    # 2 sequences of 100 + 4 - 1 tokens; the pool holds (9 - 1 null block) // 1 block = 8 of them
    assert row.kv_pool_sequences_predicted == 8
    assert row.kv_tokens_peak_predicted == 2 * 103 and row.kv_bytes_peak_predicted == 2 * 103 * BYTES_PER_TOKEN
    assert row.kv_in_use_peak_tokens == 256 and row.kv_in_use_source == "max of 2 polls of gauge"
    assert row.kv_measured_over_predicted == 256 / 206
    assert (row.requests_waiting_peak, row.requests_running_peak, row.preemptions) == (1, 2, 1)
    assert (row.rss_peak_bytes, row.rss_baseline_bytes, row.memory_samples, row.memory_sample_hz) == (300, 90, 3, 2.0)


def test_an_exact_engine_peak_wins_over_the_polls(tmp_path):
    m = measurement([request(0, 10.0)], kv_samples=[KVSample(10.6, 1.0, None)],
                    kv_peak=KVInUse(bytes=5000, tokens=103, source="cache tensors", details={"allocator_bytes": 6000}))
    row = summarize(engine_run(tmp_path, "hf"), m)
    assert (row.kv_in_use_peak_bytes, row.kv_in_use_source, row.kv_allocator_bytes_peak) == (5000, "cache tensors", 6000)
    assert row.kv_pool_sequences_predicted is None  # no pool


def test_requests_cut_off_by_a_dead_engine(tmp_path):
    results = [request(0, 10.0, error="StreamCutOff: connection closed"), request(1, 10.0, error="ReadError")]
    assert request_verdicts(results) == {"failed"}
    row = summarize(engine_run(tmp_path), measurement(results, engine_exit="killed by SIGKILL", log_tail="boom"))
    assert row.status == "failed" and row.n_failed == 2
    assert row.error == "engine killed by SIGKILL during the cell: StreamCutOff: connection closed"
    assert row.flags[0] == "engine killed by SIGKILL during the cell" and row.log_tail == "boom"


def test_truncated_and_short_requests_flag_the_cell(tmp_path):
    results = [request(0, 10.0), request(1, 10.0, prompt_read=90), request(2, 10.0, out=3)]
    assert request_verdicts(results) == {"ok", "truncated", "short"}
    row = summarize(engine_run(tmp_path), measurement(results, engine_exit="exited with code 1", log_tail="x"))
    assert (row.status, row.n_ok, row.n_truncated, row.n_short) == ("flagged", 1, 1, 1)
    assert row.flags[0].startswith("r1: truncated: prompt 100 sent / 90 read")
    assert row.error is None and row.log_tail is None  # the engine's exit is not blamed without failed requests


def test_an_attached_server_has_no_memory_figures(tmp_path):
    row = summarize(engine_run(tmp_path), measurement([request(0, 10.0)], memory_samples=None))
    assert row.memory_samples == 0 and row.rss_peak_bytes is None


def test_a_failed_row_carries_the_reason_and_no_figures(tmp_path):
    row = failed_row(engine_run(tmp_path), CELL, "failed", "engine failed to start: boom", "tail")
    assert (row.status, row.error, row.log_tail, row.n_requests, row.ttft_s_p50) == \
        ("failed", "engine failed to start: boom", "tail", 0, None)


def test_the_console_line_says_undefined_for_a_cell_without_itl():
    from kvbench.run.rows import summary_line
    from kvbench.store.schema import CellRow

    row = CellRow(run_id="r", cell_id="c", backend="vllm-0.32.0", engine="vllm", engine_version="0.32.0", model="m",
                  workload="w", prompt_tokens=8, output_tokens=4, concurrency=1, kv_dtype="bf16", status="ok",
                  ttft_s_p50=0.2, itl_s_p50=None, output_tokens_per_s=10.0)
    assert "ITL p50 undefined" in summary_line(row)
    assert "ITL p50 12.5 ms" in summary_line(row.model_copy(update={"itl_s_p50": 0.0125}))


def test_a_pause_in_the_memory_samples_is_flagged_and_an_even_pace_is_not(tmp_path):
    even = [MemorySample(10.0 + i * 0.05, 100, 2) for i in range(21)]
    assert memory_gap_flag(even) == [] and memory_gap_flag(even[:1]) == []
    # 11 samples at 20 Hz, then the sampler's thread got no CPU for 0.7 s, then the cell ended
    paused = even[:11] + [MemorySample(10.5 + 0.7, 400, 2)]
    row = summarize(engine_run(tmp_path), measurement([request(0, 10.0)], memory_samples=paused))
    assert row.memory_sample_hz < 10 and row.rss_peak_bytes == 400
    assert row.flags == ["memory not sampled for 0.70 s of this cell (the harness got no CPU: the engine or "
                         "another process had the cores): a peak in that time may be missed"]
    assert "warning[/]: memory not sampled for 0.70 s" in summary_line(row)
    # a pause of 5 usual gaps or fewer, or under 0.25 s, is the sampler's pace, not a pause
    assert memory_gap_flag([MemorySample(t, 1, 1) for t in (0.0, 0.5, 1.0, 2.0)]) == []
    assert memory_gap_flag([MemorySample(t, 1, 1) for t in (0.0, 0.01, 0.02, 0.2)]) == []
