"""Schema v3: every run under results/ loads with the same columns and dtypes, old or new, JSONL or Parquet."""
from pathlib import Path

import pandas as pd
import pytest

from kvbench.store.readers import column_dtypes, load
from kvbench.store.schema import SCHEMA_VERSION, CellRow, RequestRow, migrate_row

from tests.synth import make_run
from tests.helpers import REPO

# The committed runs only (results/published/, results/gpu/): never results/runs/, the user's own runs, where
# an interrupted `make bench` leaves a half-written one.
ROOT = REPO / "results"
RUNS = sorted(p.parent for folder in ("published", "gpu") for p in (ROOT / folder).glob("*/cells.jsonl"))


def signature(frame: pd.DataFrame) -> list[tuple[str, str]]:
    return [(c, str(t)) for c, t in frame.dtypes.items()]


def test_there_are_published_runs():
    assert len(RUNS) >= 3, RUNS


@pytest.mark.parametrize("what", ["cells", "requests"])
def test_every_run_loads_with_identical_columns_and_dtypes(what, tmp_path):
    new = make_run(tmp_path, "new", repeats=1, prompts=(128,), concurrency=(1,))  # a run written today
    signatures = {str(run): signature(load(run, what=what)) for run in [*RUNS, new]}
    first = signatures[str(RUNS[0])]
    for run, sig in signatures.items():
        assert sig == first, run
    dtypes = dict(first)
    if what == "cells":
        assert dtypes["client_loop_lag_s_max"] == "float64"  # absent from v1 and some v2 rows
        assert dtypes["preemptions"] == dtypes["requests_running_peak"] == "float64"
        assert dtypes["gpu_process_peak_bytes"] == dtypes["rss_peak_bytes"] == "float64"
        assert dtypes["n_ok"] == dtypes["concurrency"] == "Int64"
        assert dtypes["status"] == dtypes["flags"] == "object"
        assert dtypes["engine_mode"] == dtypes["gpu_devices"] == "object" and dtypes["gpus_used"] == "Int64"
        assert dtypes["gpu_overhead_bytes_per_gpu"] == dtypes["kv_in_use_peak_bytes_per_gpu"] == "float64"
    else:
        assert dtypes["ok"] == dtypes["counted"] == "bool" and dtypes["tpot_s"] == "float64"


def test_a_v2_row_without_client_loop_lag_migrates():
    row = CellRow(run_id="r", cell_id="c", backend="b", engine="e", engine_version="1", model="m", workload="w",
                  prompt_tokens=8, output_tokens=4, concurrency=1, kv_dtype="f16", status="ok").model_dump()
    row["schema_version"] = 2
    del row["client_loop_lag_s_max"]
    out = migrate_row(row, CellRow)
    assert out["schema_version"] == SCHEMA_VERSION and out["client_loop_lag_s_max"] is None
    assert out["prefix_cache_source"] == "not recorded" and out["prefix_cache_hit_rate"] is None


def test_a_v6_row_reads_with_its_hit_rate_not_recorded_and_a_v7_row_keeps_its_own():
    row = CellRow(run_id="r", cell_id="c", backend="b", engine="e", engine_version="1", model="m", workload="w",
                  prompt_tokens=8, output_tokens=4, concurrency=1, kv_dtype="f16", status="ok").model_dump()
    old = {k: v for k, v in row.items() if not k.startswith("prefix_cache")} | {"schema_version": 6}
    out = migrate_row(old, CellRow)
    assert out["prefix_cache_source"] == "not recorded" and out["prefix_cache_expected"] == ""
    new = row | {"prefix_cache_source": "not reported", "prefix_cache_hit_rate": None}
    assert migrate_row(new, CellRow)["prefix_cache_source"] == "not reported"


def test_every_field_has_a_dtype():
    for model in (CellRow, RequestRow):
        dtypes = column_dtypes(model)
        assert list(dtypes) == list(model.model_fields)
        assert set(dtypes.values()) <= {"float64", "Int64", "bool", "boolean", "object"}
    assert column_dtypes(RequestRow)["chunk_times"] == "object"
    assert column_dtypes(CellRow)["kv_pool_bytes_engine"] == "float64"


def test_a_parquet_copy_without_a_column_still_loads_it(tmp_path):
    """The issue's case: a Parquet copy made before client_loop_lag_s_max existed; load() gives the column
    (NaN) with the same dtype as everywhere else instead of raising."""
    import pyarrow.parquet as pq

    from kvbench.store.readers import parquet_is_current, write_parquet

    run = make_run(tmp_path, "old", repeats=1, prompts=(128,), concurrency=(1,))
    write_parquet(run)
    table = pq.read_table(run / "cells.parquet")
    pq.write_table(table.drop_columns(["client_loop_lag_s_max"]), run / "cells.parquet")
    assert parquet_is_current(run)  # it is the copy load() reads
    cells = load(run)
    assert cells.client_loop_lag_s_max.isna().all() and str(cells.client_loop_lag_s_max.dtype) == "float64"
    assert signature(cells) == signature(load(RUNS[0]))
