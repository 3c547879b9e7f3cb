"""What a run shows while it runs: an ETA from the calibrated estimate at once, a line inside each cell, and
the report at the end (against the fake OpenAI-compatible server, with the embedded model's tokenizer)."""
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress

from kvbench.run import progress as run_progress_module
from kvbench.run import measure as measure_step
from kvbench.run import warmup as warmup_step
from kvbench.run.backend_config import BackendConfig
from kvbench.run.progress import EstimatedRemainingColumn, remaining_s
from kvbench.run.runner import Runner, RunOptions
from kvbench.workloads import load
from tests.fakes.openai_server import FakeOpenAI
from tests.helpers import REPO

WORKLOAD = """name = "progress"
seed = 3
prompt_tokens = [32, 64]
output_tokens = 8
concurrency = [1]
rounds = 4
warmup_requests = 1
warmup_prompt_tokens = 16
"""


def test_remaining_seconds_scale_by_how_the_finished_cells_compared_with_their_estimates():
    assert remaining_s([10, 20, 30], 0, 0.0, 0) == 60
    assert remaining_s([10, 20, 30], 1, 20.0, 0) == pytest.approx(100)  # the first took twice its estimate
    assert remaining_s([10, 20, 30], 1, 20.0, 2) == pytest.approx(100 + 2 * 20 * 2)  # others at the mean, scaled
    assert remaining_s([], 0, 0.0, 5) == 0


def test_the_eta_column_reads_the_estimate_and_falls_back_to_rich():
    with Progress(console=Console(file=io.StringIO())) as progress:
        with_estimate = progress.add_task("a", total=10, eta_at=time.monotonic() + 100)
        without = progress.add_task("b", total=10)
        column = EstimatedRemainingColumn()
        shown = str(column.render(progress.tasks[with_estimate]))
        assert shown.startswith("~0:01:") and str(column.render(progress.tasks[without])) == "-:--:--"


def test_a_run_sets_the_eta_before_its_first_cell_and_shows_each_cells_requests(tmp_path, smollm2, monkeypatch):
    etas, lines = [], []

    def set_eta(progress, bar, estimates, since, done, cells):
        run_progress_module.set_eta(progress, bar, estimates, since, done, cells)
        etas.append((progress.tasks[bar].completed, progress.tasks[bar].fields.get("eta_at")))

    class Line(run_progress_module.CellProgress):
        def __call__(self, result):
            super().__call__(result)
            task = self.progress.tasks[self.progress.task_ids.index(self.task)]
            lines.append((task.completed, task.total, task.description))

    monkeypatch.setattr(warmup_step, "set_eta", set_eta)
    monkeypatch.setattr(measure_step, "CellProgress", Line)
    (tmp_path / "w.toml").write_text(WORKLOAD)
    with FakeOpenAI(token_delay_s=0.002) as fake:
        opts = RunOptions(model="smollm2", workload=load(str(tmp_path / "w.toml")), results_dir=tmp_path,
                          run_id="progress", backends=[BackendConfig.parse(f"openai:url={fake.url}")])
        Runner(opts, Console(file=io.StringIO())).run()
    # the estimate's ETA is there before any cell finished, and after each one
    assert etas[0][0] == 0 and etas[0][1] is not None and etas[0][1] > time.monotonic() - 60
    assert [done for done, _ in etas] == [0, 1, 2]
    # inside each of the two cells: requests done of 4, with the tokens per second so far
    assert [(done, total) for done, total, _ in lines] == [(k, 4) for k in range(1, 5)] * 2
    assert [d.split(":")[0].strip() for _, _, d in lines] == ["32 tok x1"] * 4 + ["64 tok x1"] * 4
    assert all(d.endswith(" tok/s") and float(d.split(": ")[1].split()[0].replace(",", "")) > 0 for _, _, d in lines)


def test_run_prints_the_report_at_the_end(tmp_path, smollm2):
    (tmp_path / "w.toml").write_text(WORKLOAD.replace("rounds = 4", "rounds = 1"))
    with FakeOpenAI() as fake:
        out = subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "-b", f"openai:url={fake.url}",
                              "--workload", str(tmp_path / "w.toml"), "--results-dir", str(tmp_path),
                              "--run-id", "printed"], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "COLUMNS": "120", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "kvbench run printed" in out.stdout and "Latency and throughput" in out.stdout
    assert out.stdout.index("Latency and throughput") < out.stdout.index("results: ")


def test_no_report_writes_the_results_folder_only(tmp_path, smollm2):
    """--no-report: the rows and the exit status as ever, no report printed or written; `kvbench report` makes it
    from the folder afterwards."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    (tmp_path / "w.toml").write_text(WORKLOAD.replace("rounds = 4", "rounds = 1"))
    with FakeOpenAI() as fake:
        out = subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "-b", f"openai:url={fake.url}",
                              "--workload", str(tmp_path / "w.toml"), "--results-dir", str(tmp_path),
                              "--run-id", "quiet", "--no-report"], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run = tmp_path / "quiet"
    assert "Latency and throughput" not in out.stdout
    assert f"results: {run}  (its report: kvbench report {run})" in out.stdout
    assert len((run / "cells.jsonl").read_text().splitlines()) == 2
    assert not any(p.name.startswith("report.") or p.name == "plots" for p in run.iterdir())
    made = CliRunner().invoke(app, ["report", str(run), "--no-plots"])
    assert made.exit_code == 0, made.output
    assert "Latency and throughput" in (run / "report.md").read_text()
