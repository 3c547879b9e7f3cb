import json

import typer
from rich.markup import escape
from rich.table import Table

from kvbench.common import ui
from kvbench.common.suggest import hint, with_hint
from kvbench.kv.geometry import KV_DTYPE_BYTES
from kvbench.kv.units import GIB, fmt_gib
from kvbench.planner import (
    PlanError,
    PlanInput,
    catalog_names,
    engine_rules,
    engines,
    measured_overhead,
    plan,
    resolve_model,
)
from kvbench.run.backend_config import ConfigError, parse_options


def plan_command(
    model: str = typer.Argument(..., help="A config.json, a model folder, a GGUF file, a hub id (org/name) or a "
                                          f"catalog name: {', '.join(catalog_names())}."),
    context: int = typer.Option(..., "--context", "-n", help="Tokens per sequence (prompt + output)."),
    # no -b: that is --backend in run, setup and validate
    batch: int = typer.Option(1, "--batch", help="Concurrent sequences."),
    kv_dtype: str = typer.Option("auto", help="KV cache dtype: auto (the engine's default for the model) or "
                                              f"{', '.join(sorted(KV_DTYPE_BYTES))}; each engine takes some."),
    tp: int = typer.Option(1, help="GPUs the model is split over (tensor parallel; llama.cpp splits layers)."),
    engine: str = typer.Option(None, help=f"Apply this engine's KV rules: {', '.join(engines())} "
                                          "(default: the plain formula)."),
    gpu: str = typer.Option(None, help="A GPU name (A100-80GB, H100-80GB, H200, L4, RTX-4090, ...) or a size such as 48GiB."),
    block_size: int = typer.Option(None, help="The engine's KV block size (default: its own; vLLM 16 on a GPU, "
                                              "128 on a CPU; TGI 1)."),
    device: str = typer.Option("gpu", help="gpu or cpu: the device the engine runs on (vLLM sizes blocks per device)."),
    engine_version: str = typer.Option(None, help="The engine's version, where its rules changed (default: the "
                                                  "version kvbench runs)."),
    engine_option: list[str] = typer.Option([], "--engine-option", help="KEY=VALUE for the engine's rules, e.g. "
                                                                       "hybrid_kv_cache=off (vLLM), unified=true "
                                                                       "(llama.cpp); repeat for several."),
    weights_dtype: str = typer.Option("bf16", help="Weights dtype when only a config gives the parameter count."),
    overhead_gib: float = typer.Option(None, help="Runtime overhead per GPU (CUDA context, activations, graphs); "
                                                  "default 1.5, an assumption, unless --overhead-from."),
    overhead_from: str = typer.Option(None, "--overhead-from", metavar="RUN",
                                      help="Take the overhead per GPU a GPU run measured (its largest over the cells "
                                           "of --engine, if given) instead of the 1.5 GiB assumption."),
    margin: float = typer.Option(0.10, help="Fraction of GPU memory kept free, from 0 to below 1."),
    allow_long_context: bool = typer.Option(False, help="Plan a context beyond the model's max_position_embeddings."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """How much KV a deployment needs, and whether it fits on a GPU."""
    try:
        options = parse_options(",".join(engine_option), "--engine-option")
        _check_engine_options(engine, options)
        if overhead_from is not None and overhead_gib is not None:
            raise PlanError("--overhead-gib and --overhead-from: give one")
        source = "assumed" if overhead_gib is None else "given"
        if overhead_from is not None:
            found = measured_overhead(overhead_from, engine)
            overhead_gib, source = found.bytes / GIB, found.source
        m = resolve_model(model, weights_dtype)
        result = plan(PlanInput(model=m, context=context, batch=batch, kv_dtype=kv_dtype, tp=tp, engine=engine,
                                gpu=gpu, overhead_gib=1.5 if overhead_gib is None else overhead_gib,
                                overhead_source=source, margin=margin, block_size=block_size,
                                device=device, engine_version=engine_version, engine_options=options,
                                allow_long_context=allow_long_context))
    except (PlanError, ConfigError) as exc:
        message = with_hint(str(exc), model, catalog_names()) if model in str(exc) else str(exc)
        if engine and engine in str(exc):
            message = with_hint(message, engine, engines())
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    t = Table(title=f"kvbench plan: {escape(result['model'])}", show_header=False)
    t.add_row("attention", escape(result["geometry"]))
    for note in result["notes"]:
        t.add_row("read", escape(note))
    t.add_row("KV per token (formula)", f"{result['kv_bytes_per_token_formula']:,.0f} B ({result['kv_dtype']}, all GPUs)")
    t.add_row(f"KV for {batch} x {context:,} tokens",
              f"{fmt_gib(result['kv_bytes'])} ({result['engine']}: {escape(result['engine_rule'])})")
    t.add_row("weights", (f"{fmt_gib(result['weights_bytes'])} " if result["weights_bytes"] else "")
              + f"({escape(result['weights_source'])})")
    if gpu:
        if result["fits"] is None:
            t.add_row("fits", "unknown: the weights are unknown (the KV figure above stands)")
        else:
            t.add_row("per GPU", f"weights {fmt_gib(result['weights_bytes_per_gpu'])} + KV "
                      f"{fmt_gib(result['kv_bytes_per_gpu'] + result['kv_pool_extra_bytes'])} + overhead "
                      f"{fmt_gib(result['overhead_bytes'])} = {fmt_gib(result['needed_bytes_per_gpu'])}")
            t.add_row("overhead", escape(result["overhead_source"]))
            t.add_row("usable", f"{fmt_gib(result['usable_bytes'])} of {result['gpu']} "
                      f"{fmt_gib(result['gpu_memory_bytes'])} ({result['margin']:.0%} kept free)")
            t.add_row("fits", "[green]yes[/]" if result["fits"] else "[red]no[/]")
            t.add_row(f"max concurrency at {context:,} tokens", str(result["max_batch"]))
            t.add_row(f"longest context at concurrency {batch}", f"{result['max_context_at_batch']:,} tokens"
                      + (" (the model's limit)" if result["max_context_at_batch"] == result["max_context"] else ""))
    ui.console().print(t)


def _check_engine_options(engine: str | None, options: dict) -> None:
    """--engine-option keys the engine's KV rules read (their ``rule_options``), not silently ignored."""
    if not options:
        return
    if engine is None:
        raise PlanError(f"--engine-option {', '.join(options)} needs --engine (the plain formula takes none)")
    allowed = engine_rules(engine).rule_options
    for key in options:
        if key not in allowed:
            raise PlanError(f"unknown --engine-option {key!r} for {engine}; {hint(key, allowed)}"
                            f"allowed: {', '.join(allowed) or 'none'}")
