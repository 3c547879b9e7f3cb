"""`kvbench report RUN --format br` (issue 38): one llm-d Benchmark Report v0.2.1 per cell, validated and read
back by the llmd-benchmark-report package itself; the published runs' files are what the command makes."""
from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path

import pytest
from llmd_benchmark_report import BenchmarkReportV02, import_benchmark_report
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.reports import benchmark_report as br
from kvbench.store.schema import OK_STATUSES

from tests.helpers import REPO
from tests.synth import make_run

PUBLISHED = sorted(p.parent for folder in ("published", "gpu")
                   for p in (REPO / "results" / folder).glob("*/cells.jsonl"))


def kvbench(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def cells(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines() if line.strip()]


def reports(folder: Path) -> dict[str, BenchmarkReportV02]:
    return {p.name: import_benchmark_report(str(p)) for p in sorted(folder.glob(f"{br.FILE_PREFIX}*.yaml"))}


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda p: p.name)
def test_a_published_run_as_benchmark_reports(run, tmp_path):
    """Every cell gets one report that the package validates; each reads back to what was written; the
    percentiles are those of cells.jsonl (recomputed from the requests, not copied); the stages number the
    cells in the order they ran; the files beside the published report are byte for byte what the command
    makes now (generated, never edited)."""
    code, out, err = kvbench("report", run, "--format", "br", "-o", tmp_path)
    assert code == 0, err
    # read as kvbench reads them (libyaml, then the package's validation); the package's own file loader
    # (pure-Python YAML, 1 s per report of the boundary run) reads the first the same
    made = {p.name: br.read_back(p.read_text()) for p in sorted(tmp_path.glob(f"{br.FILE_PREFIX}*.yaml"))}
    first = next(iter(made))
    assert import_benchmark_report(str(tmp_path / first)).dump() == made[first].dump()
    rows = [c for c in cells(run) if not c.get("replica") and c["status"] != "not run"]
    assert [n.removeprefix(br.FILE_PREFIX).removesuffix(".yaml") for n in made] == sorted(r["cell_id"] for r in rows)
    by_cell = {r["cell_id"]: r for r in rows}
    eid = str(uuid.uuid5(uuid.NAMESPACE_URL, run.name))
    assert {m.run.eid for m in made.values()} == {eid}
    assert len({m.run.uid for m in made.values()}) == len(made)
    assert sorted(m.scenario.load.standardized.stage for m in made.values()) == list(range(len(rows)))
    for name, report in made.items():
        row = by_cell[name.removeprefix(br.FILE_PREFIX).removesuffix(".yaml")]
        assert report.version == "0.2.1"
        assert rows.index(row) == report.scenario.load.standardized.stage
        text = (tmp_path / name).read_text()
        engine = report.scenario.stack[0].standardized
        assert (engine.kind, engine.tool, engine.model.name) == ("inference_engine", row["engine"], row["model"])
        load = report.scenario.load.standardized
        assert (load.tool, load.input_seq_len.value, load.output_seq_len.value) == \
            ("kvbench", row["prompt_tokens"], row["output_tokens"])
        kv = report.results.observability.model_extra[br.KV_KEY]
        assert kv["units"] == "bytes"
        if row["kv_in_use_peak_bytes"] is not None:
            assert kv["peak_bytes_in_use"] == row["kv_in_use_peak_bytes"]
        if row["status"] in OK_STATUSES:
            latency = report.results.request_performance.aggregate.latency
            for p in (50, 90, 99):
                for figure, stat in (("ttft_s", latency.time_to_first_token), ("e2e_s", latency.request_latency),
                                     ("itl_s", latency.inter_token_latency)):
                    if row[f"{figure}_p{p}"] is None:  # not measured (no ITL sample): left out, never 0
                        assert stat is None, (name, figure)
                    else:
                        assert math.isclose(getattr(stat, f"p{p}"), row[f"{figure}_p{p}"], rel_tol=1e-9), \
                            (name, figure, p)
            assert report.results.request_performance.aggregate.requests.total == row["n_requests"]
        health = report.results.component_health[0]
        assert health.replica_health[0].healthy is (row["status"] != "failed")
        published = run / name
        assert published.read_text() == text, f"{published} is not what `kvbench report --format br` makes"
    assert sorted(p.name for p in run.glob(f"{br.FILE_PREFIX}*.yaml")) == sorted(made)


def _edit_run(run: Path, cell_edits: dict, info_edits: dict) -> None:
    rows = cells(run)
    (run / "cells.jsonl").write_text("".join(json.dumps({**r, **cell_edits}) + "\n" for r in rows))
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, **info_edits}))


def test_time_series_gpus_parallelism_and_a_failed_cell(tmp_path):
    """Where the cell's start in Unix time was recorded, each request's TTFT and E2E go into time series at
    their own instants, and the stage's time is the cell's own; the GPU and the engine's tensor-parallel split (its Backend.parallelism hook) fill the
    accelerator; the load processes come from the command; a failed cell has no latency and an unhealthy
    engine."""
    run = make_run(tmp_path, "br-synth", prompts=(1024,), concurrency=(2, 4), repeats=1, n_requests=6,
                   failed={("vllm-0.31.0", 1024, 4)})
    start = 1_800_000_000.0
    _edit_run(run, {"t_cell_start_unix": start, "gpus_used": 2},
              {"environment": {"cpu": "Synthetic CPU", "gpus": [{"name": "NVIDIA H200"}]},
               "backends": [{"engine": "vllm", "label": "vllm-0.31.0", "options": {"tp": 2}}],
               "command": "kvbench run -b vllm:tp=2 --load-workers 3", "finished_at": "2026-12-01T10:05:00+00:00"})
    code, _, err = kvbench("report", run, "--format", "br")
    assert code == 0, err
    made = reports(run)
    ok = made[br.file_name("vllm-0.31.0_p1024_c2_r0")]
    engine = ok.scenario.stack[0].standardized
    accelerator = engine.accelerator
    assert (accelerator.model, accelerator.count, accelerator.parallelism.tp) == ("NVIDIA H200", 2, 2)
    assert ok.scenario.load.standardized.parallelism == 3
    assert ok.scenario.load.standardized.concurrency == 2
    # the stage's own time: from the cell's start in Unix time to its last request's end
    row = next(r for r in cells(run) if r["cell_id"] == "vllm-0.31.0_p1024_c2_r0")
    ends = [r["t_done"] for r in map(json.loads, (run / "requests.jsonl").read_text().splitlines())
            if r["cell_id"] == row["cell_id"] and not r["warmup"]]
    assert ok.run.time.start.timestamp() == pytest.approx(start)
    assert ok.run.time.duration == f"PT{max(ends) - row['t_cell_start']:.3f}S"
    assert ok.run.time.end.timestamp() == pytest.approx(start + max(ends) - row["t_cell_start"], abs=1e-3)
    series = ok.results.request_performance.time_series.latency.time_to_first_token.series
    assert len(series) == 6
    assert all(start <= p.ts.timestamp() < start + 60 for p in series)
    observed = ok.results.observability.components[0]
    assert observed.aggregate.kv_cache_usage.units == "fraction" and observed.aggregate.kv_cache_usage.max <= 1
    assert observed.time_series.kv_cache_usage.series
    bad = made[br.file_name("vllm-0.31.0_p1024_c4_r0")]
    assert bad.results.request_performance is None
    assert bad.results.component_health[0].replica_health[0].healthy is False
    assert bad.results.component_health[0].failed_replicas == 1


def test_a_cpu_run_has_no_accelerator(tmp_path):
    run = make_run(tmp_path, "br-cpu", prompts=(1024,), concurrency=(1,), repeats=1, n_requests=3)
    assert kvbench("report", run, "--format", "br")[0] == 0
    (report,) = reports(run).values()
    accelerator = report.scenario.stack[0].standardized.accelerator
    assert accelerator.count == 0 and accelerator.model.startswith("none (CPU: Synthetic CPU")
    assert report.scenario.load.standardized.parallelism == 1  # no --load-workers: one process


def test_refused_outputs_and_flags(tmp_path):
    """A link or another program's file where a report goes, or --html with --format br: one line, exit 2,
    nothing written."""
    run = make_run(tmp_path, "br-refuse", prompts=(1024,), concurrency=(1,), repeats=1, n_requests=3)
    code, _, err = kvbench("report", run, "--format", "br", "--html", tmp_path / "x.html")
    assert code == 2 and len(err.strip().splitlines()) == 1
    target = run / br.file_name("vllm-0.31.0_p1024_c1_r0")
    target.write_text("someone else's notes\n")
    code, _, err = kvbench("report", run, "--format", "br")
    assert code == 2 and "error:" in err and len(err.strip().splitlines()) == 1
    assert target.read_text() == "someone else's notes\n"
    target.unlink()
    os.symlink(tmp_path / "elsewhere.yaml", target)
    code, _, err = kvbench("report", run, "--format", "br")
    assert code == 2 and "symbolic link" in err
    assert not (tmp_path / "elsewhere.yaml").exists()
    target.unlink()
    assert kvbench("report", run, "--format", "br")[0] == 0
    assert kvbench("report", run, "--format", "br")[0] == 0  # its own file is replaced


def test_statistics_keys_are_the_schemas():
    stats = br.statistics([1.0, 2.0, None, 3.0, float("nan")], "s")
    assert stats["p50"] == 2.0 and stats["min"] == 1.0 and stats["max"] == 3.0
    assert set(stats) - {"units"} <= set(BenchmarkReportV02.model_json_schema()["$defs"]["Statistics"]["properties"])
    assert br.statistics([None], "s") is None


def test_a_report_the_schema_refuses_is_never_written(tmp_path, monkeypatch):
    """The package's validators run before anything is written: a figure in a unit the schema does not take
    for it (seconds as a KV cache usage) stops the run's reports with one line, exit 1, and no file."""
    run = make_run(tmp_path, "br-invalid", prompts=(1024,), concurrency=(1, 2), repeats=1, n_requests=3)
    real = br.statistics
    monkeypatch.setattr(br, "statistics", lambda values, units: real(values, "s" if units == "fraction" else units))
    code, _, err = kvbench("report", run, "--format", "br")
    assert code == 1 and "did not validate" in err and "observability" in err
    assert len(err.strip().splitlines()) == 1
    assert not list(run.glob(f"{br.FILE_PREFIX}*"))
