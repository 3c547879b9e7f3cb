import json

import typer

from bench import ui
from bench.models import ModelError
from bench.planner import PlanError
from bench.profiles import ProfileError, profile_for


def profile(
    model: str = typer.Option("smollm2", help="The model the run will use (sizes the GPU ladder)."),
    args: bool = typer.Option(False, "--args", help="Print only the `kvbench run` arguments (workload, context cap)."),
    make: bool = typer.Option(False, "--make", help="Print PROFILE=, ENGINES= and PROFILE_ARGS= lines."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as one JSON object."),
):
    """Which benchmark `make bench` runs here: the CPU default, or the GPU profile sized for the card."""
    try:
        p = profile_for(model)
    except (ProfileError, ModelError, PlanError) as exc:
        typer.echo(f"error: {exc}", err=True)  # stderr: --args output must stay clean for the Makefile
        raise typer.Exit(2)
    if args:
        print(" ".join(p.run_args()))
    elif make:
        print(p.make_vars())
    elif as_json:
        print(json.dumps({"profile": p.name, "workload": p.workload, "engines": list(p.engines),
                          "max_context": p.max_context, "run_args": p.run_args(), "note": p.note,
                          "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes} for g in p.gpus]}))
    else:
        ui.console().print(f"[bold]profile {p.name}[/]: {' '.join(p.engine_args())} {' '.join(p.run_args())}\n{p.note}")
