"""Outputs at a path the user gave (issue 22): `kvbench report -o/--html`, `kvbench compare -o/--json/--html`
and `kvbench validate --into` write only new regular files or over files kvbench made, never through a
symbolic link, onto a FIFO or device, or over another program's file (refused: one line, exit 2, nothing
written); each report keeps its plots in a folder of its own."""
from __future__ import annotations

import errno
import os
import re
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.common.files import OutputRefused, atomic_write_text, check_output, kvbench_markdown, kvbench_png

from tests.synth import make_run


@dataclass
class Done:
    returncode: int
    stderr: str


def kvbench(*args):
    """The CLI, in this process."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return Done(result.exit_code, result.stderr)


def kvbench_process(*args, timeout=60):
    """The CLI in a process of its own: a FIFO opened for writing would block it, not the test."""
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def refused(out, *words):
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs"), "a", prompts=(1024,), concurrency=(1,), repeats=1, n_requests=2)


def written(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_an_existing_file_kvbench_did_not_write_is_refused_and_left(tmp_path, run_a):
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n")
    line = refused(kvbench("report", run_a, "-o", notes), str(notes), "kvbench did not write it")
    assert "remove it" in line and notes.read_text() == "my notes\n"
    assert written(tmp_path) == {"notes.md"} and not (run_a / "cells.parquet").exists()  # nothing written anywhere
    page = tmp_path / "page.html"
    page.write_text("<html>mine</html>")
    refused(kvbench("report", run_a, "-o", tmp_path / "r.md", "--html", page), "HTML page", "kvbench did not write it")
    assert page.read_text() == "<html>mine</html>" and written(tmp_path) == {"notes.md", "page.html"}


def test_a_symbolic_link_is_never_written_through(tmp_path, run_a):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    for link_name in ("link.md", "report.md"):  # another program's file, and kvbench's own report's name
        link = tmp_path / link_name
        link.symlink_to(victim)
        refused(kvbench("report", run_a, "-o", link), str(link), "symbolic link")
        assert link.is_symlink() and victim.read_text() == "keep me\n"
    # a link planted in the plots folder, under a plot's name
    plots = tmp_path / "out_plots"
    plots.mkdir()
    (plots / "kv_vs_context.png").symlink_to(victim)
    refused(kvbench("report", run_a, "-o", tmp_path / "out.md"), "kv_vs_context.png", "symbolic link")
    assert victim.read_text() == "keep me\n" and not (tmp_path / "out.md").exists()


def test_a_fifo_is_refused_without_being_opened(tmp_path, run_a):
    fifo = tmp_path / "report.md"
    os.mkfifo(fifo)
    started = time.monotonic()
    refused(kvbench_process("report", run_a, "-o", fifo), "is a FIFO, not a regular file")
    assert time.monotonic() - started < 30  # opened for writing, it would block until a reader came
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and written(tmp_path) == {"report.md"}
    html_fifo = tmp_path / "page.html"
    os.mkfifo(html_fifo)
    refused(kvbench("report", run_a, "-o", tmp_path / "x.md", "--html", html_fifo), "HTML page", "FIFO")
    assert stat.S_ISFIFO(os.lstat(html_fifo).st_mode) and not (tmp_path / "x.md").exists()


def test_dev_null_is_refused_and_stays_a_device(run_a):
    before = os.lstat("/dev/null")
    refused(kvbench("report", run_a, "-o", "/dev/null"), "/dev/null is a character device")
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_rdev, after.st_ino) == (before.st_rdev, before.st_ino)
    assert not Path("/dev/null.html").exists() and not Path("/dev/null_plots").exists()


def test_a_folder_as_the_report_or_one_file_for_both_is_refused(tmp_path, run_a):
    refused(kvbench("report", run_a, "-o", tmp_path), "is a folder")
    refused(kvbench("report", run_a, "-o", tmp_path / "r.html"), "the Markdown and the HTML page would be one file")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    refused(kvbench("report", run_a, "-o", fifo / "r.md"), "report folder", "is a FIFO, not a folder")
    (tmp_path / "notes").write_text("a file where the report's folder would be")
    refused(kvbench("report", run_a, "-o", tmp_path / "notes" / "r.md"), "report folder", "is a file, not a folder")
    assert written(tmp_path) == {"pipe", "notes"}


def test_two_reports_in_one_folder_each_have_their_own_plots(tmp_path):
    runs = tmp_path / "runs"
    a = make_run(runs, "a", prompts=(1024,), concurrency=(1,), repeats=1, n_requests=2, seed=1)
    b = make_run(runs, "b", prompts=(1024, 2048), concurrency=(1,), repeats=1, n_requests=2, seed=2,
                 scale={"vllm-0.31.0": {"kv": 2.0}})
    out = tmp_path / "out"
    for run, name in ((a, "a.md"), (b, "b.md")):
        done = kvbench("report", run, "-o", out / name, "--raw")
        assert done.returncode == 0, done.stderr
    for name in ("a", "b"):
        md = (out / f"{name}.md").read_text()
        links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)
        assert links and all(link.startswith(f"{name}_plots/") for link in links), links
        assert all((out / link).read_bytes()[:4] == b"\x89PNG" for link in links)
    # each report shows its own run: b's KV plot has another prompt length and twice the KV
    assert (out / "a_plots" / "kv_vs_context.png").read_bytes() != (out / "b_plots" / "kv_vs_context.png").read_bytes()
    assert not (out / "plots").exists()
    # a report, page and plots kvbench wrote are replaced (recognised as its own), no temp file left
    before = (out / "a_plots" / "kv_vs_context.png").stat().st_mtime_ns
    done = kvbench("report", a, "-o", out / "a.md", "--raw")
    assert done.returncode == 0, done.stderr
    assert (out / "a_plots" / "kv_vs_context.png").stat().st_mtime_ns > before
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_compare_outputs_are_checked_before_anything_is_written(tmp_path):
    runs = tmp_path / "runs"
    base = make_run(runs, "base", prompts=(1024,), concurrency=(1,), repeats=3, n_requests=4, seed=1)
    cand = make_run(runs, "cand", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(1,), repeats=3,
                    n_requests=4, seed=2)
    folder = tmp_path / "cmp"
    folder.mkdir()
    (folder / "compare.md").write_text("someone's notes\n")
    refused(kvbench("compare", base, cand, "-o", folder), "compare.md", "kvbench did not write it")
    assert written(folder) == {"compare.md"} and (folder / "compare.md").read_text() == "someone's notes\n"
    fifo = tmp_path / "result.json"
    os.mkfifo(fifo)
    refused(kvbench_process("compare", base, cand, "--json", fifo), "JSON file", "FIFO")
    refused(kvbench("compare", base, cand, "--html", "/dev/null"), "character device")
    (folder / "compare.md").unlink()
    done = kvbench("compare", base, cand, "-o", folder)
    assert done.returncode in (0, 1, 3, 4), done.stderr  # a verdict: the outputs were written
    assert {"compare.md", "compare.json", "compare.html", "compare_forest.png"} <= written(folder)
    # kvbench's own are replaced: its Markdown, JSON, page and plot are each recognised
    again = kvbench("compare", base, cand, "-o", folder, "--json", folder / "compare.json")
    assert again.returncode == done.returncode, again.stderr


def test_validate_into_refuses_a_foreign_table_before_touching_an_engine(tmp_path):
    into = tmp_path / "run"
    into.mkdir()
    (into / "kv_validation.jsonl").write_text("not kvbench's\n")
    started = time.monotonic()
    refused(kvbench("validate", "-b", "hf", "--into", into), "kv_validation.jsonl", "kvbench did not write it")
    assert time.monotonic() - started < 60 and written(into) == {"kv_validation.jsonl"}
    link = tmp_path / "elsewhere"
    (into / "kv_validation.jsonl").unlink()
    (into / "kv_validation.jsonl").symlink_to(link)
    refused(kvbench("validate", "-b", "hf", "--into", into), "symbolic link")
    assert not link.exists()


def test_the_checks_themselves(tmp_path):
    assert check_output(tmp_path / "new.md", kvbench_markdown) is None
    empty = tmp_path / "empty.md"
    empty.write_text("")
    assert check_output(empty, kvbench_markdown) is None  # an empty file holds nothing to lose
    png = tmp_path / "p.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)  # a PNG, but not one matplotlib drew
    with pytest.raises(OutputRefused, match="did not write it"):
        check_output(png, kvbench_png)
    sock_dir = Path("/tmp") / f"kvb-sock-{os.getpid()}"  # a socket's path must be short
    sock_dir.mkdir()
    try:
        import socket

        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(sock_dir / "s.md"))
            with pytest.raises(OutputRefused, match="is a socket"):
                check_output(sock_dir / "s.md", kvbench_markdown)
    finally:
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()
    # the low-level writer never replaces a link or special file either (a run folder's own files)
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as info:
        atomic_write_text(fifo, "{}")
    assert info.value.errno == errno.EEXIST and "FIFO" in str(info.value) and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_forest_plot_draws_changes_past_its_axis_at_its_ends(tmp_path):
    """A metric of a hostile run (1e300 where a latency was) changes by +1e300 %, one of a collapsed run by -100 %
    and beyond: each is drawn at the axis's end (-99 %, +9,900 %) with an arrowhead; a NaN one is left out. The
    axis had been set to infinity and the whole comparison's report refused (a property test found it)."""
    from kvbench.reports.plots import FOREST_END, forest

    def metric(name, change, low, high):
        return {"metric": name, "worse": "higher", "change": change, "ci_low": low, "ci_high": high,
                "tolerance": 0.05, "verdict": "regression"}

    result = {"confidence": 0.95, "verdict": "REGRESSION", "cells": [{"key": "c1", "metrics": [
        metric("ttft", 1e300, 1e299, float("inf")), metric("itl", -1.5, float("-inf"), -0.9),
        metric("e2e", float("nan"), float("nan"), float("nan")), metric("tpot", 0.02, -0.01, 0.04)]}]}
    out = forest(result, tmp_path / "forest.png")
    assert out.stat().st_size > 5000 and FOREST_END == 100.0
