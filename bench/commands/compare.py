import json
from pathlib import Path

import typer

from kvbench.common.files import (OutputRefused, atomic_write_text, check_output, check_output_folder, kvbench_html,
                                  kvbench_json, kvbench_markdown, kvbench_png)
from kvbench.compare.render import markdown, write_html, write_outputs
from kvbench.compare.runs import CompareError, load_config, load_side
from kvbench.compare.runs import compare as run_compare
from kvbench.store.errors import ResultsReadError


def compare(
    runs: list[Path] = typer.Argument(..., metavar="RUN_DIR", help="BASELINE CANDIDATE run folders, or one run holding both "
                                                "(with --baseline-backend and --candidate-backend)."),
    baseline_backend: str = typer.Option(None, "--baseline-backend", help="Backend label of the baseline, e.g. vllm-0.31.0."),
    candidate_backend: str = typer.Option(None, "--candidate-backend", help="Backend label of the candidate, e.g. vllm-0.32.0."),
    tolerances: Path = typer.Option(None, "--tolerances", help="TOML file laid over bench/compare/compare_tolerances.toml."),
    match_on: str = typer.Option(None, "--match-on", help="Comma-separated cell fields that must agree "
                                                          "(default: the cell configuration minus engine_version)."),
    json_file: Path = typer.Option(None, "--json", help="Also write the result as JSON to this file."),
    html_file: Path = typer.Option(None, "--html", help="Also write an HTML page with the forest plot to this file."),
    output_dir: Path = typer.Option(None, "--output", "-o", help="Write compare.md, compare.json, compare.html and "
                                                                 "compare_forest.png into this folder."),
    output_format: str = typer.Option("table", "--format", help="table (Markdown) or json, on stdout."),
    allow_different_hardware: bool = typer.Option(
        False, "--allow-different-hardware", help="Compare runs from different machines (CPU model or flags, cores, "
                                                   "GPUs, driver) with a warning instead of refusing."),
    allow_cache_mismatch: bool = typer.Option(
        False, "--allow-cache-mismatch", help="Compare a cell served from the prefix cache (warm) with one that was "
                                               "not (cold) instead of leaving it out: the change is then the cache's."),
    pass_unless_regression: bool = typer.Option(
        False, "--pass-unless-regression", help="Exit 0 for an inconclusive or improved comparison too: a gate that "
                                                 "asks only for no evidence of a regression."),
):
    """Compare a candidate run with a baseline, cell by cell: the verdict first, then the change and confidence
    interval of every headline metric. Exit code 0: unchanged (every metric within its tolerance);
    1: a regression (or a cell that failed only on the candidate); 3: inconclusive (an interval wider than
    its tolerance: the verdict says how many repeats would settle it); 4: an improvement and nothing worse;
    2: bad input (unreadable runs, a run compared with itself, different hardware) or nothing to compare."""
    if output_format not in ("table", "json"):
        raise typer.BadParameter("--format must be table or json")
    try:  # only new files or kvbench's own: never through a link, onto a device or over another's file
        _check_outputs(output_dir, json_file, html_file)
    except (OutputRefused, OSError, ValueError) as exc:  # ValueError: a path holding a NUL
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    try:
        if len(runs) == 1:
            if not (baseline_backend and candidate_backend):
                raise CompareError("one run: say which backends to compare with --baseline-backend and "
                                   "--candidate-backend (e.g. vllm-0.31.0 and vllm-0.32.0)")
            runs = [runs[0], runs[0]]
        elif len(runs) != 2:
            raise CompareError(f"give BASELINE and CANDIDATE (two run folders) or one run with backends, not {len(runs)}")
        config = load_config(tolerances, match_on.split(",") if match_on else None)
        base = load_side("baseline", [runs[0]], baseline_backend)
        cand = load_side("candidate", [runs[1]], candidate_backend)
        result = run_compare(base, cand, config, allow_different_hardware, pass_unless_regression,
                             allow_cache_mismatch)
    except (CompareError, ResultsReadError) as exc:  # ResultsReadError: a run folder that cannot be read
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    except Exception as exc:  # noqa: BLE001 - input of a shape nothing foresaw: never exit 1, which means REGRESSION
        typer.echo(f"error: the runs could not be compared ({type(exc).__name__}: {str(exc)[:200]}): a run folder "
                   f"holds data of an unexpected shape (bad input, exit 2)", err=True)
        raise typer.Exit(2)
    try:
        for warning in result["warnings"]:
            typer.echo(f"WARNING: {warning}", err=True)
        text = markdown(result)
        if output_dir:
            write_outputs(result, text, output_dir)
        if json_file:
            atomic_write_text(json_file, json.dumps(result, indent=2))
        if html_file:
            write_html(result, html_file)
        typer.echo(json.dumps(result, indent=2) if output_format == "json" else text)
    except OSError as exc:
        typer.echo(f"error: writing the output: {exc}", err=True)
        raise typer.Exit(2)
    except Exception as exc:  # noqa: BLE001 - rendering what was compared failed: never exit 1 (REGRESSION)
        typer.echo(f"error: the runs were compared (verdict: {VERDICTS.get(result.get('exit_code'), 'unknown')}) "
                   f"but the report could not be written ({type(exc).__name__}: {str(exc)[:200]}): exit 2, as for "
                   f"every error", err=True)
        raise typer.Exit(2)
    raise typer.Exit(result["exit_code"])


#: compare's exit codes, for a line that cannot give the whole report
VERDICTS = {0: "unchanged", 1: "REGRESSION", 3: "inconclusive", 4: "improved"}


def _check_outputs(output_dir: Path | None, json_file: Path | None, html_file: Path | None) -> None:
    if output_dir:
        check_output_folder(output_dir, "compare folder",
                            {"compare.md": kvbench_markdown, "compare.json": kvbench_json, "compare.html": kvbench_html,
                             "compare_forest.png": kvbench_png})
    if json_file:
        check_output(json_file, kvbench_json, "JSON file")
    if html_file:
        check_output(html_file, kvbench_html, "HTML page")
        check_output(html_file.with_name(html_file.stem + "_forest.png"), kvbench_png, "plot")
