"""``kvbench run``: the run's steps (bench/run/runner.py) behind its flags, then the report.

The flags are the run options' (bench/run/options.py): this module makes a typer option of each and
gives the values back to :func:`~kvbench.run.resolve.options_from_flags`; it adds no option of its own.
"""
import inspect
import signal
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from kvbench.common import ui
from kvbench.common.models import ModelError, locate
from kvbench.common.suggest import with_hint
from kvbench.planner import model_names
from kvbench.run.option_fields import Flag, FlagError, flags
from kvbench.run.options import RunOptions
from kvbench.run.home import home_refusal, recipes_needed
from kvbench.run.resolve import options_from_flags
from kvbench.store.errors import ResultsReadError, ResultsWriteError, RunFolderError
from kvbench.workloads import WorkloadError, available


def run(**given):
    """Run a workload on each backend and write the results folder, then print the report."""
    console = ui.console()
    options, plan = resolve_and_plan(given)
    # the runner's side (pandas, pyarrow, the engines' clients) after the refusals: a refused run took 0.9 s
    # of CPU, most of it these imports
    from kvbench.load.owner import OwnerError
    from kvbench.run.runner import Runner
    from kvbench.store.readers import load_cells

    # errors print with soft_wrap: one line even past the console width (greppable in CI logs)
    try:
        runner = Runner(options, console, plan=plan)
    except (RunFolderError, ResultsReadError, OwnerError) as exc:  # an existing run, a damaged one to resume,
        # or a --load-owner address share 0 cannot serve at
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2)
    except ResultsWriteError as exc:  # --results-dir read-only, not permitted, full
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1)
    try:
        run_dir = runner.run()
    except ModelError as exc:
        console.print(f"[red]error:[/] {escape(with_hint(str(exc), options.model, model_names()))}", soft_wrap=True)
        raise typer.Exit(2)
    except RunFolderError as exc:  # an engine that is not the one the run's cells ran on: refused, exit 2
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2)
    except ResultsWriteError as exc:  # the runner stopped: say the first write error, once
        console.print(f"[red]error:[/] {escape(str(runner.writer.failed or exc))}", soft_wrap=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        # ignored from here on: at exit Python puts its own handlers back to the default, and a second Ctrl-C
        # then would end the process by the signal (status -2) instead of exit 130
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        console.print(f"[yellow]interrupted; finished cells are in {runner.run_dir}[/]")
        raise typer.Exit(130)
    if options.report:
        report(run_dir, console)
    else:
        console.print(f"\nresults: {run_dir}  (its report: kvbench report {run_dir})")
    cells = load_cells(run_dir)
    if cells.empty or (cells.status == "failed").all():
        raise typer.Exit(1)


def resolve_and_plan(given: dict):
    """Steps "resolve" and "plan" before a run folder exists: the options from the flags, the model located
    and, where its limit is known, the plan. A refusal is one line, exit 2, nothing created."""
    try:
        options = options_from_flags(given)
    except FlagError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.flag) from None
    except ValueError as exc:  # ConfigError, WorkloadError among them
        text = with_hint(str(exc), given["workload"], available()) if isinstance(exc, WorkloadError) else str(exc)
        typer.echo(f"error: {text}", err=True)
        raise typer.Exit(2)
    try:
        # a model that is not there is refused before a run folder exists
        path = locate(options.model, weights=options.needs_weights)
    except ModelError as exc:
        typer.echo(f"error: {with_hint(str(exc), options.model, model_names())}", err=True)
        raise typer.Exit(2)
    if refusal := home_refusal(recipes_needed(options.backends), path):  # a file, read-only: before the folder
        typer.echo(f"error: {refusal}", err=True)
        raise typer.Exit(2)
    # the cells and their load profiles (numpy, the engines' HTTP client) only once the input is sound
    from kvbench.run.cells import NothingFits
    from kvbench.run.plan import plan_early

    try:
        return options, plan_early(options, path)
    except NothingFits as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


def report(run_dir: Path, console: Console) -> None:
    """Step "report": the run's report written and printed, as `kvbench report` does (and --help promises)."""
    from kvbench import reports  # matplotlib: imported here, not before a refusal (1.4 s of every `kvbench run`)

    try:
        md, page, _, built = reports.write_report([run_dir])
        from kvbench.reports import terminal

        terminal.render(built, console)
    except ResultsWriteError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}; the results are in {escape(str(run_dir))}", soft_wrap=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:  # the run is whole; each report file is replaced atomically or not at all
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        console.print(f"[yellow]interrupted while writing the report; the run is finished in {run_dir} "
                      f"(kvbench report {run_dir})[/]")
        raise typer.Exit(130)
    console.print(f"\nresults: {run_dir}\nreport:  {md} and {page}  (kvbench report {run_dir})")


def typer_parameter(flag: Flag) -> inspect.Parameter:
    """A run option's flag as typer reads a parameter: its type, and its default, names and help."""
    extra = {k: v for k, v in (("metavar", flag.metavar), ("min", flag.min)) if v is not None}
    return inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, annotation=flag.kind,
                             default=typer.Option(flag.default, *flag.names, help=flag.help, **extra))


# typer reads the command's parameters from its signature: the run options' flags, in their order
run.__signature__ = inspect.Signature([typer_parameter(flag) for flag in flags(RunOptions)])
run.__annotations__ = {flag.param: flag.kind for flag in flags(RunOptions)}
