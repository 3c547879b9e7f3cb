from pathlib import Path

import typer
from rich.markdown import Markdown

from kvbench import reports, ui
from kvbench.results import ensure_parquet, not_a_run_dir


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
        if problem := not_a_run_dir(run_dir):
            raise typer.BadParameter(problem, param_hint="RUN_DIR")
    for run_dir in run_dirs:  # all checked before any is written to
        ensure_parquet(run_dir)
    output, target_html, text = reports.write(run_dirs, output, html_file, plots)
    if raw:
        print(text)
    else:
        ui.console().print(Markdown(text))
    print(f"\nreport written to {output} and {target_html}")
