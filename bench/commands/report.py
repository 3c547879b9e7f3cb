import sys
import warnings
from enum import Enum
from pathlib import Path

import typer

from kvbench import reports
from kvbench.common import ui
from kvbench.common.files import OutputRefused
from kvbench.store.errors import ResultsReadError, ResultsWarning, ResultsWriteError
from kvbench.store.readers import ensure_parquet, not_a_run_dir


class ReportFormat(str, Enum):
    md = "md"  # the Markdown and HTML report, printed on the terminal
    br = "br"  # llm-d Benchmark Reports v0.2.1, one YAML per cell (bench/reports/benchmark_report.py)


def report(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR", help="One or more run folders under results/runs/ "
                                                    "(or any folder with run.json and cells.jsonl)."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the Markdown here (default: RUN_DIR/report.md "
                                                             "for one run, results/reports/<ids>/report.md for several); "
                                                             "with -o nothing is written into the run folders."),
    html_file: Path = typer.Option(None, "--html", help="Write the HTML page here (default: beside the Markdown)."),
    raw: bool = typer.Option(False, "--raw", help="Print the Markdown source instead of rendering it."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Make the PNG plots (into plots/ beside a report.md, "
                                                                 "NAME_plots/ beside NAME.md: each report its own)."),
    recompute: bool = typer.Option(False, "--recompute", help="First rebuild every cell's figures from requests.jsonl "
                                                              "under today's definitions and say what changed "
                                                              "(cells.jsonl rewritten, the old one kept as cells.jsonl.bak)."),

    output_format: ReportFormat = typer.Option(
        ReportFormat.md, "--format", help="md: the report (Markdown, HTML, terminal); br: one llm-d Benchmark Report "
                                          "v0.2.1 per cell, validated by the llmd-benchmark-report package, as "
                                          "RUN_DIR/benchmark_report_v0.2,_<cell>.yaml (with -o: into that folder)."),
):
    """Turn one or more runs into Markdown tables (KV predicted vs engine vs measured, latency and throughput,
    the KV boundary, failures), PNG plots and one self-contained HTML page; without -o also writes each run's
    Parquet copy (cells.parquet, requests.parquet) when it is missing or stale. A damaged line of a run's
    records (a crash's torn last line) is skipped and named in the report. Outputs are written only as new
    files or over kvbench's own: a symbolic link, a FIFO or device, or another program's file at an output
    path is refused (exit 2, nothing written)."""
    for run_dir in run_dirs:
        if problem := not_a_run_dir(run_dir):
            raise typer.BadParameter(problem, param_hint="RUN_DIR")
    if output_format is ReportFormat.br:
        return _benchmark_reports(run_dirs, output, html_file, raw, recompute)
    try:  # before anything is written (a Parquet copy, a recomputed cells.jsonl)
        reports.check_outputs(*reports.output_paths(run_dirs, output, html_file, plots))
    except OutputRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    if recompute:  # rebuild the figures first, so the report shows today's definitions
        from kvbench.store.recompute import recompute_runs

        if code := recompute_runs(run_dirs):
            raise typer.Exit(code)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResultsWarning)
        try:
            if output is None:  # with -o the run folders are only read (they may be full or read-only)
                for run_dir in run_dirs:  # all checked before any is written to
                    try:
                        ensure_parquet(run_dir)
                    except ResultsWriteError as exc:  # a derived copy: the report reads the JSONL instead
                        print(f"warning: Parquet copy not written: {exc}", file=sys.stderr)
            output, target_html, text, built = reports.write_report(run_dirs, output, html_file, plots)
        except (ResultsReadError, OutputRefused) as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2)
        except ResultsWriteError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(1)
        except (KeyboardInterrupt, OSError):
            raise
        except Exception as exc:  # noqa: BLE001 - a run folder of a shape nothing foresaw: one line, bad input
            print(f"error: the report could not be made ({type(exc).__name__}: {str(exc)[:200]}): a run folder "
                  f"holds data of an unexpected shape", file=sys.stderr)
            raise typer.Exit(2)
    for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, ResultsWarning)):
        print(f"warning: {message}", file=sys.stderr)
    for w in caught:  # anything else as Python would have shown it
        if not issubclass(w.category, ResultsWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if raw:
        print(text)
    else:
        from kvbench.reports import terminal

        terminal.render(built, ui.console())  # within 120 columns: wide tables in parts
    print(f"\nreport written to {output} and {target_html}")


def _benchmark_reports(run_dirs: list[Path], output: Path | None, html_file: Path | None, raw: bool,
                       recompute: bool) -> None:
    """``--format br``: each cell of each run as an llm-d Benchmark Report (``-o``: the folder they go to)."""
    from pydantic import ValidationError

    from kvbench.reports import benchmark_report

    if html_file is not None or raw:
        print("error: --html and --raw belong to --format md; --format br writes YAML files only", file=sys.stderr)
        raise typer.Exit(2)
    try:
        benchmark_report.check_outputs(run_dirs, output)
    except OutputRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    if recompute:
        from kvbench.store.recompute import recompute_runs

        if code := recompute_runs(run_dirs):
            raise typer.Exit(code)
    try:
        written = benchmark_report.write(run_dirs, output)
    except (ResultsReadError, OutputRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    except ValidationError as exc:  # kvbench built a report the schema refuses: a bug, said in one line
        first = exc.errors()[0]
        print(f"error: a Benchmark Report did not validate: {'.'.join(map(str, first['loc']))}: {first['msg']}",
              file=sys.stderr)
        raise typer.Exit(1)
    except (ResultsWriteError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(1)
    folders = sorted({str(p.parent) for p in written})
    print(f"{len(written)} Benchmark Reports (v0.2.1) written to {', '.join(folders) or '(no cells)'}")
