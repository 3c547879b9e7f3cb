"""kvbench report --recompute: figures rebuilt from requests.jsonl under today's definitions."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.common.metrics import RequestTimes, cell_metrics
from kvbench.store import recompute as rc
from kvbench.store.readers import load
from kvbench.store.schema import SCHEMA_VERSION, CellRow, RequestRow
from kvbench.store.writer import RunWriter
from tests.helpers import REPO

# The committed runs only (results/published/, results/gpu/): never results/runs/, the user's own runs, where
# an interrupted `make bench` leaves a half-written one.
RESULTS = REPO / "results"
PUBLISHED = sorted(p.parent for folder in ("published", "gpu") for p in (RESULTS / folder).glob("*/requests.jsonl"))


def _run(tmp_path) -> Path:
    """A run of one cell whose row was written by an older kvbench: ITL p50 0.0 and TPOT 0.0 where a
    request's whole stream came in one read."""
    w = RunWriter(tmp_path / "old")
    w.write_run_info({"run_id": "old", "status": "finished", "environment": {"cpu": "x", "cpu_count": 2, "gpus": []}})
    streams = [(10.0, [10.5, 10.6, 10.7, 10.8]), (20.0, [20.4, 20.4, 20.4, 20.4]), (30.0, [30.5, 30.5, 30.9, 31.0])]
    times = []
    for i, (sent, chunks) in enumerate(streams):
        w.write_request(RequestRow(run_id="old", cell_id="c", backend="b", request_id=f"r{i}", prompt_tokens_sent=8,
                                   prompt_tokens_reported=8, output_tokens_requested=4, output_tokens_received=4,
                                   output_tokens_reported=4, t_sent=sent, t_done=chunks[-1], chunk_times=chunks,
                                   chunk_tokens=[1, 1, 1, 1], ttft_s=chunks[0] - sent, e2e_s=chunks[-1] - sent,
                                   error=None))
        times.append(RequestTimes(sent, tuple(chunks), (1, 1, 1, 1), chunks[-1]))
    w.write_request(RequestRow(run_id="old", cell_id="warm", backend="b", request_id="w", warmup=True,
                               prompt_tokens_sent=8, prompt_tokens_reported=8, output_tokens_requested=4,
                               output_tokens_received=4, output_tokens_reported=4, t_sent=0.0, t_done=1.0,
                               chunk_times=[1.0], chunk_tokens=[4], ttft_s=1.0, e2e_s=1.0, error=None))
    figures = cell_metrics(times, [8, 8, 8], slo_tpot_s=0.2)
    figures.update(itl_s_p50=0.0, tpot_s_p50=0.0, goodput_requests_per_s=3 / figures["wall_s"])  # the old figures
    w.write_cell(CellRow(run_id="old", cell_id="c", backend="b", engine="vllm", engine_version="1", model="m",
                         workload="w", prompt_tokens=8, output_tokens=4, concurrency=1, kv_dtype="bf16", status="ok",
                         n_requests=3, n_ok=3, slo_tpot_s=0.2, **figures))
    lines = (w.root / "cells.jsonl").read_text().replace(f'"schema_version":{SCHEMA_VERSION}', '"schema_version":2')
    (w.root / "cells.jsonl").write_text(lines)
    return w.root


def test_recompute_says_what_changed_and_keeps_the_old_record(tmp_path):
    run = _run(tmp_path)
    before = (run / "cells.jsonl").read_text()
    result = rc.recompute(run)
    changed = {c["field"]: c for c in result.changes}
    assert set(changed) == {"itl_s_p50", "tpot_s_p50", "goodput_requests_per_s"}
    assert changed["itl_s_p50"]["old"] == 0.0 and changed["itl_s_p50"]["new"] == pytest.approx(0.1)
    # the request read in one go has no TPOT; the third's is (31.0 - 30.5) / 3
    assert changed["tpot_s_p50"]["new"] == pytest.approx(0.5 / 3 / 2 + 0.1 / 2)
    assert changed["goodput_requests_per_s"]["new"] == pytest.approx(changed["goodput_requests_per_s"]["old"] * 2 / 3)
    frame = rc.changes_frame(result)
    assert list(frame.columns) == ["cell", "rep", "figure", "old", "new", "change"] and len(frame) == 3
    assert "3 figures in 1 cells changed" in rc.summary(result)

    assert rc.write(result) == run / "cells.jsonl.bak"
    assert (run / "cells.jsonl.bak").read_text() == before
    info = json.loads((run / "run.json").read_text())
    assert info["recomputed"][0]["figures_changed"] == 3 and info["recomputed"][0]["schema_version"] == SCHEMA_VERSION
    cells = load(run)
    assert cells.itl_s_p50.iloc[0] == pytest.approx(0.1) and set(cells.schema_version) == {SCHEMA_VERSION}
    again = rc.recompute(run)
    assert again.changes == [] and rc.write(again) is None  # nothing to do: nothing written
    assert (run / "cells.jsonl.bak").read_text() == before


def test_report_recompute_option(tmp_path):
    run = _run(tmp_path)
    out = CliRunner().invoke(app, ["report", "--recompute", "--no-plots", "--raw", str(run)])
    assert out.exit_code == 0, out.output
    assert "3 figures in 1 cells changed" in out.output and "itl_s_p50" in out.output
    assert (run / "cells.jsonl.bak").exists()


def test_there_are_published_runs_to_recompute():
    assert len(PUBLISHED) >= 3, PUBLISHED


@pytest.mark.parametrize("path", PUBLISHED, ids=[p.name for p in PUBLISHED])
def test_every_published_run_matches_a_recompute(path):
    result = rc.recompute(path)  # reads only: rc.write would rewrite it
    assert result.cells_recomputed and result.changes == [], rc.summary(result)


@pytest.mark.parametrize("run, old", [("20261130-194844-cpu-default", {1024: 25, 2048: 14, 4096: 7, 8128: 4}),
                                      ("20261129-143003-cpu-default", {1024: None, 2048: None, 4096: None, 8128: None})])
def test_recompute_rederives_llamacpps_pool_sequences_from_its_log(tmp_path, run, old):
    """The published CPU defaults' llama.cpp pool (its log: 8,192 cells x 4/4 seqs) holds 4 sequences at
    every rung, one per slot; the record as the run wrote it (cells.jsonl.bak) had the old rule's figure."""
    import shutil

    folder = tmp_path / run
    shutil.copytree(RESULTS / "published" / run, folder)
    shutil.copy2(folder / "cells.jsonl.bak", folder / "cells.jsonl")
    result = rc.recompute(folder)
    llama = [r for r in result.rows if r["engine"] == "llamacpp"]
    assert {r["prompt_tokens"]: r["kv_pool_sequences_predicted"] for r in llama} == dict.fromkeys(old, 4)
    changed = {(c["cell_id"].split("_")[1], c["old"]) for c in result.changes if c["field"] == "kv_pool_sequences_predicted"}
    assert changed == {(f"p{p}", o) for p, o in old.items() if o != 4}
    # another engine's pool is not stated in its log: its figure stays as the run wrote it
    assert all(c["cell_id"].startswith("llamacpp") for c in result.changes if c["field"] == "kv_pool_sequences_predicted")
