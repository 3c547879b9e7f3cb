import json

import typer

from kvbench.common import ui
from kvbench.common.models import ModelError
from kvbench.common.suggest import with_hint
from kvbench.planner import PlanError, model_names
from kvbench.run.default_bench import DefaultBenchError, default_bench_for, default_model


def default_bench(
    model: str = typer.Option(None, help="The model the run will use (sizes the GPU ladder); default: "
                                         "Qwen/Qwen2.5-7B-Instruct on a GPU machine, smollm2 otherwise."),
    args: bool = typer.Option(False, "--args", help="Print only the `kvbench run` arguments (workload, context cap)."),
    make: bool = typer.Option(False, "--make", help="Print DEVICE=, ENGINES= and DEFAULT_ARGS= lines."),
    as_json: bool = typer.Option(False, "--json", help="Print the default benchmark as one JSON object."),
):
    """Which benchmark `make bench` runs here: the CPU default, or the GPU one sized for the card."""
    model = model or default_model()
    try:
        p = default_bench_for(model)
    except (DefaultBenchError, ModelError, PlanError) as exc:
        typer.echo(f"error: {with_hint(str(exc), model, model_names())}", err=True)  # stderr: --args output must stay clean for the Makefile
        raise typer.Exit(2)
    if args:
        print(" ".join(p.run_args()))
    elif make:
        print(p.make_vars())
    elif as_json:
        print(json.dumps({"device": p.name, "workload": p.workload, "engines": list(p.engines),
                          "max_context": p.max_context, "run_args": p.run_args(), "note": p.note,
                          "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes} for g in p.gpus]}))
    else:
        ui.console().print(f"[bold]{p.name} default[/]: {' '.join(p.engine_args())} {' '.join(p.run_args())}\n{p.note}")
