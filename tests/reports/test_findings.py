"""The report opens with what the run found (issue 36): per engine, a few lines whose every figure the tables
below hold, in Markdown, HTML and on the terminal."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from kvbench import reports
from kvbench.reports import findings, html, markdown, terminal

from tests.helpers import REPO
from tests.synth import make_run

PUBLISHED = sorted(p.parent for folder in ("published", "gpu")
                   for p in (REPO / "results" / folder).glob("*/cells.jsonl"))
# a figure as the tables write it: a decimal (ratio, seconds, ms, tok/s) or a size
FIGURE = re.compile(r"\d[\d,]*\.\d+(?: [KMGT]iB)?")


def sections_text(report, skip: str) -> str:
    """The Markdown of every section but ``skip``: what a finding's figures must be found in."""
    rest = reports.Report(report.title, [], [s for s in report.sections if s.id != skip], [])
    return markdown.render(rest, Path("."))


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda p: p.name)
def test_findings_come_first_and_the_tables_back_them(run):
    report = reports.build([run])
    assert report.sections[0].id == "findings"
    found = findings.lines(reports.tables.aggregate(reports.load([run], what="cells")).assign(
        label=lambda f: f.backend))
    engines = {json.loads(line)["backend"] for line in (run / "cells.jsonl").read_text().splitlines() if line.strip()}
    assert set(found) == engines  # every engine, no other
    below = sections_text(report, "findings")
    for engine, lines in found.items():
        assert 2 <= len(lines) <= 3 + findings.MAX_TOP_CELLS
        for line in lines:
            for figure in FIGURE.findall(line):
                assert figure in below, f"{engine}: {figure!r} of {line!r} is in no table"


def test_where_the_pool_saturated_is_the_first_cell_that_queued():
    """In the KV-boundary run, the line names the lightest load at which the engine's own counters found a
    request waiting, with its running and waiting peaks (read here from cells.jsonl)."""
    run = REPO / "results" / "published" / "20261204-kv-boundary-cpu"
    rows = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines() if line.strip()]
    found = findings.lines(reports.tables.aggregate(reports.load([run], what="cells")).assign(
        label=lambda f: f.backend))
    for engine, lines in found.items():
        queued = sorted((r for r in rows if r["backend"] == engine and (r["requests_waiting_peak"] or 0) > 0),
                        key=lambda r: r["concurrency"])
        (pool_line,) = [line for line in lines if "KV pool" in line]
        first = queued[0]
        assert f"saturated first at prompt {first['prompt_tokens']}, x{first['concurrency']}:" in pool_line
        assert f"{first['requests_waiting_peak']:g} waited" in pool_line
        assert f"{len(queued)} of {len(rows_of(rows, engine))} cells queued" in pool_line


def rows_of(rows, engine):
    return [r for r in rows if r["backend"] == engine]


def test_a_failed_cell_and_every_layout(tmp_path):
    """A failed cell is counted with its error; the section leads the Markdown, the HTML (as a list) and the
    terminal's output."""
    run = make_run(tmp_path, "findings", backends=(("vllm", "0.31.0"), ("llamacpp", "0.3.36")), prompts=(1024, 2048),
                   concurrency=(1, 4), repeats=1, n_requests=4, failed={("llamacpp-0.3.36", 2048, 4)})
    report = reports.build([run])
    lines = findings.lines(reports.tables.aggregate(reports.load([run], what="cells")).assign(
        label=lambda f: f.backend))
    assert lines["llamacpp-0.3.36"][-1].startswith("1 of 4 cells failed (first: prompt 2048, x4, failed: engine failed")
    assert lines["vllm-0.31.0"][-1] == "All 4 cells ran with every request as asked."
    assert any(line.startswith("At the top load (prompt 2048, x4)") for line in lines["vllm-0.31.0"])
    assert not any(line.startswith("At the top load (prompt 2048") for line in lines["llamacpp-0.3.36"])
    text = markdown.render(report, tmp_path)
    assert text.index("## What the run found") < text.index("## KV cache")
    page = html.render(report)
    assert page.index("What the run found") < page.index("KV cache: predicted")
    assert page.count("<li>") >= len(lines["vllm-0.31.0"]) + len(lines["llamacpp-0.3.36"])
    out = io.StringIO()
    terminal.render(report, Console(file=out, width=120, force_terminal=False))
    shown = out.getvalue()
    assert shown.index("What the run found") < shown.index("KV cache: predicted")
    assert "1 of 4 cells failed" in shown
