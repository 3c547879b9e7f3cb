"""The report's figures and captions agree with what they show: a failed cell's failure in a column of its
own, the terminal layout within 120 columns, the allocated pool beside KV in use, timeline titles that say
the cell once."""
import io
import subprocess
import sys
from pathlib import Path

import pandas as pd

from kvbench.reports import build, tables, terminal
from kvbench.store.readers import load_cells
from rich.console import Console

from tests.synth import make_run
from tests.helpers import REPO

PUBLISHED = REPO / "results/published/20261130-194844-cpu-default"


def test_a_failed_cell_has_its_failure_in_a_failure_column_not_in_a_figure(tmp_path):
    run = make_run(tmp_path, "r", prompts=(1024,), concurrency=(1, 4), repeats=1, failed={("vllm-0.31.0", 1024, 4)})
    agg = tables.aggregate(load_cells(run))
    for frame, first in ((tables.kv_table(agg), "bytes/token (formula)"),
                         (tables.boundary_table(agg), "KV needed (predicted)")):
        failed = frame[frame.conc == "4"].iloc[0]
        assert failed["failure"] == "failed: engine failed to start" and failed[first] == ""
        assert frame[frame.conc == "1"].iloc[0]["failure"] == "" and frame[frame.conc == "1"].iloc[0][first] != ""


def test_the_terminal_report_fits_120_columns_without_wrapping_a_figure():
    out = io.StringIO()
    terminal.render(build([PUBLISHED]), Console(file=out, width=120))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 120
    cells = load_cells(PUBLISHED)
    # every row of the KV table on one line: its backend, prompt and the engine's peak together
    for r in cells.itertuples():
        peak = tables.fmt_bytes(r.kv_in_use_peak_bytes)
        assert any(r.backend in line and f" {r.prompt_tokens} " in line and peak in line for line in lines), (r.backend, peak)
    # the source column is a key; the sources are listed once under the table
    assert sum("max of the polls of /slots" in line for line in lines) == 1


def test_kvbench_report_prints_within_120_columns_in_a_pipe(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(PUBLISHED, run)
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "kvbench.cli", "report", str(run), "--no-plots"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    report = out.stdout.split("\nreport written to ")[0]  # the paths printed after it are as long as they are
    assert "Latency and throughput" in report and max(len(line) for line in report.splitlines()) <= 120


def _captured(monkeypatch):
    """kvbench.reports.plots, its figures kept instead of saved (the list). Imported here: matplotlib took 0.4 s
    of CPU in every test worker that collected this module."""
    from kvbench.reports import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: figures.append(fig) or out)
    return plots, figures


def test_the_kv_plot_shows_the_allocated_pool_beside_kv_in_use(tmp_path, monkeypatch):
    plots, figures = _captured(monkeypatch)
    agg = tables.aggregate(load_cells(PUBLISHED)).assign(label=lambda a: a.backend)
    assert plots.kv_vs_context(agg, tmp_path / "kv.png")
    labels = [t.get_text() for ax in figures[0].axes for t in ax.get_legend().get_texts()]
    assert "llamacpp-0.3.36: pool allocated (engine)" in labels and "vllm-0.32.0: pool allocated (engine)" in labels
    assert "llamacpp-0.3.36: in use (engine)" in labels
    assert not any(label.startswith("hf-5.24.0: pool") for label in labels)  # transformers has no pool
    pool_line = next(line for line in figures[0].axes[0].get_lines()
                     if line.get_label() == "llamacpp-0.3.36: pool allocated (engine)")
    assert set(pool_line.get_ydata()) == {720.0}  # MiB, as its log line says


def test_a_timeline_title_says_the_cell_once(tmp_path, monkeypatch):
    plots, figures = _captured(monkeypatch)
    cells = load_cells(PUBLISHED).assign(label=lambda a: a.backend)
    cell = cells[(cells.backend == "llamacpp-0.3.36") & (cells.prompt_tokens == 8128) & (cells.concurrency == 4)].iloc[0]
    cell = pd.concat([cell, pd.Series({"run_dir": str(PUBLISHED)})])
    assert plots.memory_timeline(PUBLISHED, cell, pd.DataFrame(), tmp_path / "t.png")
    title = figures[0].axes[0].get_title()
    assert title == "llamacpp-0.3.36: prompt 8128, x4" and cell.cell_id not in title
