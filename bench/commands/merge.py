import sys
from pathlib import Path

import typer

from kvbench.store.errors import ResultsReadError, ResultsWriteError, RunExistsError, RunFolderError


def merge(
    folders: list[Path] = typer.Argument(..., metavar="DIR", help="The run folders of every load share "
                                                                  "(kvbench run --load-share I/N), one per process."),
    into: Path = typer.Option(..., "--into", metavar="RUN", help="The merged run's folder (new)."),
    accept_lost: bool = typer.Option(False, "--accept-lost", help="Merge a share whose folder lacks a cell (its pod "
                                                                  "died mid-run) with the requests it never recorded "
                                                                  "as lost, instead of refusing."),
):
    """Join the run folders of one experiment's load shares (kvbench run --load-share I/N, one per machine or pod)
    into one run: every request accounted for (each share's ordinals exactly its share, all of them a
    permutation of the cell's), every percentile computed again from the raw records, on the run owner's
    clock. Folders of another workload, model, backends, seed or prompt salt, or shares missing, are refused
    (exit 2) in one line naming the difference."""
    from kvbench.run.merge import MergeError
    from kvbench.run.merge import merge as join

    command = " ".join(["kvbench merge", *sys.argv[2:]]) if len(sys.argv) > 1 else "kvbench merge"
    try:
        done = join(folders, into, accept_lost, command)
    except (MergeError, ResultsReadError, RunExistsError, RunFolderError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    except ResultsWriteError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)
    for note in done.notes:  # what was left out of the copy (a link, a special file): said, and in run.json
        typer.echo(f"warning: {note}", err=True)
    lost = f", {done.lost} of them lost with their load process" if done.lost else ""
    typer.echo(f"merged {len(done.shares)} load shares ({', '.join(str(s.path) for s in done.shares)}): "
               f"{done.cells} cells, {done.requests} requests{lost} -> {done.into}")
