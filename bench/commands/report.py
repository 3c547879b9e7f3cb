from pathlib import Path

import typer
from rich.markdown import Markdown

from bench import ui
from bench import reports
from bench.results import ensure_parquet


def report(
    run_dirs: list[Path] = typer.Argument(..., help="One or more run folders under results/runs/ "
                                                    "(or any folder with run.json and cells.jsonl)."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the Markdown here (default: RUN_DIR/report.md "
                                                             "for one run, results/reports/<ids>/report.md for several)."),
    html_file: Path = typer.Option(None, "--html", help="Write the HTML page here (default: beside the Markdown)."),
    raw: bool = typer.Option(False, "--raw", help="Print the Markdown source instead of rendering it."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Make the PNG plots (into plots/ beside the Markdown)."),
):
    """Turn one or more runs into Markdown tables (KV predicted vs engine vs measured, latency and throughput,
    the KV boundary, failures), PNG plots and one self-contained HTML page; also writes each run's Parquet
    copy (cells.parquet, requests.parquet) when it is missing or stale."""
    for run_dir in run_dirs:
        if not (run_dir / "cells.jsonl").exists() or not (run_dir / "run.json").exists():
            raise typer.BadParameter(f"{run_dir} has no run.json/cells.jsonl: not a kvbench run folder",
                                     param_hint="RUN_DIR")
    for run_dir in run_dirs:
        ensure_parquet(run_dir)
    output, target_html, text = reports.write(run_dirs, output, html_file, plots)
    if raw:
        print(text)
    else:
        ui.console().print(Markdown(text))
    print(f"\nreport written to {output} and {target_html}")
