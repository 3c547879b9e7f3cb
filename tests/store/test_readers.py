"""kvbench.store.readers.load: tidy DataFrames from JSONL or Parquet, v1 runs migrated to the current schema."""
import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbench.store.readers import ensure_parquet, load, parquet_is_current, write_parquet
from kvbench.store.schema import SCHEMA_VERSION, CellRow, migrate_row

from tests.synth import make_run
from tests.helpers import REPO

PUBLISHED = REPO / "results/published/20261129-143003-cpu-default"


@pytest.fixture
def published(tmp_path):
    """A copy of the published run without its Parquet files (the test writes its own), its cells as the run
    wrote them in schema v1 (cells.jsonl.bak: `kvbench report --recompute` rewrote cells.jsonl in the current
    schema)."""
    copy = tmp_path / PUBLISHED.name
    shutil.copytree(PUBLISHED, copy, ignore=shutil.ignore_patterns("*.parquet", "plots", "report.*"))
    shutil.copy2(copy / "cells.jsonl.bak", copy / "cells.jsonl")
    return copy


def test_the_published_v1_run_migrates_to_the_current_schema(published):
    assert json.loads((published / "cells.jsonl").read_text().splitlines()[0])["schema_version"] == 1
    cells = load(published)
    assert len(cells) == 24 and set(cells.schema_version) == {SCHEMA_VERSION}
    assert set(cells.repeat) == {0} and set(cells.load_profile) == {"concurrent"}
    assert cells.request_rate.isna().all() and set(cells.variant) == {""}
    assert set(cells.token_contract) == {"token ids, output forced"}  # what every v1 backend did
    assert not cells.attached.any() and cells.requests_waiting_peak.isna().all()
    assert set(cells.run_id) == {PUBLISHED.name} and set(cells.run_dir) == {str(published)}
    assert list(cells.columns[:len(CellRow.model_fields)]) == list(CellRow.model_fields)
    assert cells.set_index("cell_id").loc["vllm-0.32.0_p1024_c1", "kv_measured_over_predicted"] == pytest.approx(1.0598,
                                                                                                              abs=1e-4)


def test_requests_are_tidy_with_derived_columns(published):
    requests = load(published, what="requests")
    assert len(requests) == 63 and set(requests["repeat"]) == {0}
    assert not requests[requests.warmup].counted.any()  # warm-up requests never count
    measured = requests[requests.counted]
    assert measured.ok.all() and (measured.tpot_s > 0).all()
    one = measured.set_index("cell_id").loc["hf-5.24.0_p1024_c1"]
    assert one.tpot_s == pytest.approx(0.057632356, rel=1e-6)  # the cell's TPOT, one request
    assert isinstance(one.chunk_times, list) and isinstance(one.engine_details, dict)


def test_parquet_copy_carries_the_schema_version_and_reads_back_the_same(published):
    jsonl_cells, jsonl_requests = load(published), load(published, what="requests")
    assert not parquet_is_current(published)
    assert ensure_parquet(published) and not ensure_parquet(published)  # written once, then current
    meta = pq.read_schema(published / "cells.parquet").metadata
    assert meta[b"kvbench_schema_version"] == str(SCHEMA_VERSION).encode()
    assert pq.read_schema(published / "requests.parquet").metadata[b"kvbench_schema_version"] == str(SCHEMA_VERSION).encode()
    from_parquet = load(published)
    assert from_parquet.drop(columns="flags").equals(jsonl_cells.drop(columns="flags"))
    assert list(from_parquet["flags"]) == list(jsonl_cells["flags"])
    req = load(published, what="requests")
    assert list(req.chunk_times.iloc[3]) == list(jsonl_requests.chunk_times.iloc[3])
    assert list(req.engine_details) == list(jsonl_requests.engine_details)


def test_a_stale_parquet_copy_is_not_read(published):
    write_parquet(published)
    with (published / "cells.jsonl").open("a") as f:  # a cell appended after the copy was made
        line = (published / "cells.jsonl").read_text().splitlines()[0]
        f.write(line.replace("hf-5.24.0_p1024_c1", "extra") + "\n")
    os.utime(published / "cells.jsonl", (os.path.getmtime(published / "cells.parquet") + 5,) * 2)
    assert not parquet_is_current(published)
    assert "extra" in set(load(published).cell_id)


def test_several_runs_load_into_one_frame(tmp_path):
    a = make_run(tmp_path, "a", repeats=2, prompts=(1024,), concurrency=(1,))
    b = make_run(tmp_path, "b", repeats=3, prompts=(1024,), concurrency=(1,))
    both = load(a, b)
    assert both.equals(load([a, b]))
    assert both.groupby("run_id")["repeat"].apply(list).to_dict() == {"a": [0, 1], "b": [0, 1, 2]}
    assert len(load(a, b, what="requests")) == 5 * 16


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="what must be"):
        load(PUBLISHED, what="timelines")
    with pytest.raises(FileNotFoundError, match="not a kvbench run folder"):
        load(tmp_path)
    with pytest.raises(ValueError, match="newer than this kvbench"):
        migrate_row({"schema_version": SCHEMA_VERSION + 1}, CellRow)


def test_ok_column_is_the_cells_token_contract():
    """`ok` is kvbench.common.metrics.request_verdict, as the cell's n_ok: a count the engine did not report falls
    back to the tokens received (Ollama or TGI without a prompt count) instead of failing the request."""
    import pandas as pd

    from kvbench.store.readers import _requests_derived

    def req(**kw):
        base = dict(warmup=False, error=None, prompt_tokens_sent=8, prompt_tokens_reported=8,
                    output_tokens_requested=3, output_tokens_reported=3, output_tokens_received=3,
                    chunk_times=[1.0, 1.1, 1.3], chunk_tokens=[1, 1, 1])
        return {**base, **kw}

    frame = pd.DataFrame([req(), req(prompt_tokens_reported=None), req(prompt_tokens_reported=7),
                          req(output_tokens_reported=None, output_tokens_received=2, chunk_times=[1.0, 1.1],
                              chunk_tokens=[1, 1]), req(error="HTTP 500"), req(warmup=True)])
    derived = _requests_derived(frame)
    assert derived.ok.tolist() == [True, True, False, False, False, True]  # ok: the token contract only
    assert derived.counted.tolist() == [True] * 5 + [False]  # a warm-up is not counted
    assert derived.tpot_s.iloc[0] == pytest.approx(0.15)  # (1.3 - 1.0) / (3 - 1)
