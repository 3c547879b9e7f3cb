from pathlib import Path

import typer
from bench import ui
from rich.markdown import Markdown

from bench.report import render


def report(
    run_dir: Path = typer.Argument(..., help="A run folder under results/runs/ (or any folder with cells.jsonl)."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the Markdown here (default: RUN_DIR/report.md)."),
    raw: bool = typer.Option(False, "--raw", help="Print the Markdown source instead of rendering it."),
):
    """Turn a run into Markdown tables (KV predicted vs engine, latency and throughput, failures)."""
    if not (run_dir / "cells.jsonl").exists() or not (run_dir / "run.json").exists():
        raise typer.BadParameter(f"{run_dir} has no run.json/cells.jsonl: not a kvbench run folder", param_hint="RUN_DIR")
    text = render(run_dir)
    target = output or run_dir / "report.md"
    target.write_text(text)
    if raw:
        print(text)
    else:
        ui.console().print(Markdown(text))
    print(f"\nreport written to {target}")
