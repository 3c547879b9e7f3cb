"""The results schema, the run folder and the Markdown report."""
import json

import pytest
from pydantic import ValidationError

from kvbench.reports import write
from kvbench.store.readers import load_cells
from kvbench.store.schema import SCHEMA_VERSION, CellRow
from kvbench.store.writer import RunWriter


def cell(**overrides) -> CellRow:
    base = dict(run_id="r1", cell_id="vllm-0.32.0_p1024_c1", backend="vllm-0.32.0", engine="vllm",
                engine_version="0.32.0", model="smollm2", workload="w", prompt_tokens=1024, output_tokens=64,
                concurrency=1, kv_dtype="bf16", status="ok", n_requests=1, n_ok=1, ttft_s_p50=0.25,
                kv_bytes_per_token_predicted=23040.0, kv_bytes_peak_predicted=23040.0 * 1087,
                kv_in_use_peak_bytes=23040.0 * 1152, kv_measured_over_predicted=1152 / 1087,
                kv_pool_tokens_engine=33024, kv_pool_bytes_engine=33024 * 23040)
    return CellRow(**{**base, **overrides})


def make_run(tmp_path, rows):
    writer = RunWriter(tmp_path / "r1")
    writer.write_run_info({"run_id": "r1", "status": "finished", "command": "kvbench run",
                           "environment": {"cpu": "Test CPU", "cpu_count": 2, "memory_bytes": 2**34, "gpus": []},
                           "model": {"name": "smollm2", "sha256": "ab" * 32, "max_context": 8192},
                           "engine_versions": {"vllm-0.32.0": "0.32.0"}, "workload": {"name": "w", "seed": 1}})
    for r in rows:
        writer.write_cell(r)
    return writer.root


def test_rows_carry_the_schema_version():
    assert cell().schema_version == SCHEMA_VERSION
    assert json.loads(cell().model_dump_json())["schema_version"] == SCHEMA_VERSION


def test_status_is_validated():
    with pytest.raises(ValidationError, match="status"):
        cell(status="great")


def test_cells_append_and_load(tmp_path):
    root = make_run(tmp_path, [cell(), cell(cell_id="x", prompt_tokens=2048)])
    frame = load_cells(root)
    assert list(frame.prompt_tokens) == [1024, 2048]
    assert frame.kv_in_use_peak_bytes.iloc[0] == 23040.0 * 1152


def test_report_shows_numbers_failures_and_not_measured(tmp_path):
    failed = cell(cell_id="llamacpp-0.3.36_p1024_c1", backend="llamacpp-0.3.36", engine="llamacpp", status="failed",
                  error="engine failed to start: server exited with code 1", log_tail="error: invalid argument: --bogus",
                  ttft_s_p50=None, kv_in_use_peak_bytes=None)
    no_rss = cell(cell_id="vllm-0.32.0_p2048_c1", prompt_tokens=2048, rss_peak_bytes=None)
    _, _, text = write([make_run(tmp_path, [cell(), failed, no_rss])])
    assert "Test CPU" in text and "vllm-0.32.0 (0.32.0)" in text and "`r1`" in text
    assert "| vllm-0.32.0 | 1024 | 1 | bf16 |  | 23,040 |" in text  # an empty failure column
    assert "1.0598" in text  # 1152 / 1087
    assert "engine failed to start" in text and "invalid argument: --bogus" in text
    assert "not measured" in text  # RSS of the third row, never 0
    kv_lines = [line for line in text.splitlines() if line.startswith("| llamacpp-0.3.36 | 1024")]
    assert all("failed" in line for line in kv_lines)
    # the KV plot is written beside the report and linked from it
    assert "![KV in use vs prompt length](plots/kv_vs_context.png)" in text
    assert (tmp_path / "r1" / "plots" / "kv_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_client_lag_column_takes_the_worst_repeat_and_is_absent_for_runs_without_it():
    import pandas as pd

    from kvbench.reports.tables import aggregate, performance_table

    repeats = [cell(repeat=k, cell_id=f"vllm-0.32.0_p1024_c1_r{k}", client_loop_lag_s_max=lag, ttft_s_p50=t)
               for k, (lag, t) in enumerate([(0.002, 0.2), (0.090, 0.4)])]
    table = performance_table(aggregate(pd.DataFrame([r.model_dump() for r in repeats])))
    assert table["client lag max (ms)"].tolist() == ["90.0"]  # the bound is the worst repeat's
    assert table["TTFT p50 (s)"].tolist() == ["0.300"]  # the figures are means
    old = pd.DataFrame([cell().model_dump()]).drop(columns=["client_loop_lag_s_max"])  # a run from before
    assert "client lag max (ms)" not in performance_table(aggregate(old))
