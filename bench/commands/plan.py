import json

import typer
from rich.table import Table

from kvbench import ui
from kvbench.kvmodel import ENGINES, KV_DTYPE_BYTES, MissingConfigKeys, UnknownEngine, UnknownKVDtype
from kvbench.planner import GIB, PlanError, PlanInput, catalog_names, plan, resolve_model


def _gib(x) -> str:
    return f"{x / GIB:,.2f} GiB"


def plan_command(
    model: str = typer.Argument(..., help=f"config.json, model folder, GGUF file, or a catalog name: {', '.join(catalog_names())}."),
    context: int = typer.Option(..., "--context", "-n", help="Tokens per sequence (prompt + output)."),
    batch: int = typer.Option(1, "--batch", "-b", help="Concurrent sequences."),
    kv_dtype: str = typer.Option("bf16", help=f"KV cache dtype: {', '.join(sorted(KV_DTYPE_BYTES))}."),
    tp: int = typer.Option(1, help="Tensor-parallel GPUs."),
    engine: str = typer.Option(None, help=f"Apply this engine's allocation rules: {', '.join(ENGINES)} (default: the exact formula)."),
    gpu: str = typer.Option(None, help="A GPU name (A100-80GB, H100-80GB, H200, L4, RTX-4090, ...) or a size such as 48GiB."),
    block_size: int = typer.Option(None, help="vLLM/TGI block size (default: vLLM 16, TGI 1)."),
    weights_dtype: str = typer.Option("bf16", help="Weights dtype when only a config gives the parameter count."),
    overhead_gib: float = typer.Option(1.5, help="Runtime overhead per GPU (CUDA context, activations): an assumption."),
    margin: float = typer.Option(0.10, help="Fraction of GPU memory kept free."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """How much KV a deployment needs, and whether it fits on a GPU."""
    try:
        m = resolve_model(model, weights_dtype)
        result = plan(PlanInput(model=m, context=context, batch=batch, kv_dtype=kv_dtype, tp=tp, engine=engine,
                                gpu=gpu, overhead_gib=overhead_gib, margin=margin, block_size=block_size))
    except (PlanError, MissingConfigKeys, UnknownKVDtype, UnknownEngine, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    t = Table(title=f"kvbench plan: {result['model']}", show_header=False)
    t.add_row("attention", f"{result['attention']}, {result['layers']} layers, {result['kv_heads']} KV heads "
              f"({result['kv_heads_per_gpu']} per GPU), head_dim K {result['head_dim_k']} / V {result['head_dim_v']}"
              + (f", window {result['sliding_window']} on {result['sliding_layers']} layers" if result['sliding_layers'] else ""))
    t.add_row("KV per token (formula)", f"{result['kv_bytes_per_token_formula']:,.0f} B ({kv_dtype}, all GPUs)")
    t.add_row(f"KV for {batch} x {context:,} tokens", f"{_gib(result['kv_bytes'])} ({result['engine']}: {result['engine_rule']})")
    t.add_row("weights", f"{_gib(result['weights_bytes'])} ({result['weights_source']})")
    if gpu:
        t.add_row("per GPU", f"weights {_gib(result['weights_bytes_per_gpu'])} + KV {_gib(result['kv_bytes_per_gpu'])} "
                  f"+ overhead {_gib(result['overhead_bytes'])} = {_gib(result['needed_bytes_per_gpu'])}")
        t.add_row("usable", f"{_gib(result['usable_bytes'])} of {result['gpu']} {_gib(result['gpu_memory_bytes'])} "
                  f"({result['margin']:.0%} kept free)")
        t.add_row("fits", "[green]yes[/]" if result["fits"] else "[red]no[/]")
        t.add_row(f"max concurrency at {context:,} tokens", str(result["max_batch"]))
        t.add_row(f"longest context at concurrency {batch}", f"{result['max_context_at_batch']:,} tokens"
                  + (" (the model's limit)" if result["max_context_at_batch"] == result["max_context"] else ""))
    ui.console().print(t)
