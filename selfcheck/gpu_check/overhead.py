"""(d) The runtime overhead per model (CUDA context, allocator slack, activations: memory besides weights and
KV) against ``kvbench plan``'s 1.5 GiB assumption, from (b)'s probes."""
from __future__ import annotations

from kvbench.kv.units import GIB, fmt_bytes, fmt_gib

from .common import fmt_ratio, ratio

PLANNER_OVERHEAD = 1.5 * GIB  # kvbench plan's assumption (PlanInput.overhead_gib): what (d) measures


def overhead_row(model: str, idle: dict, ready: dict, loaded_event: dict, loaded: dict, kv_rows: list[dict]) -> dict:
    """(d) for one model, from NVML at three moments of its probe (idle: before it started; ready: CUDA context
    up, nothing allocated; loaded: weights in place, kernels warmed) and its cells: memory besides weights and
    KV. ``overhead`` is what the planner's 1.5 GiB stands for: everything on the GPU at the largest cell's peak
    but the weights and the KV (the CUDA context and libraries, the allocator's slack, the activations)."""
    weights = loaded_event.get("allocated")
    context = ready["device_used"] - idle["device_used"]
    at_load = loaded["device_used"] - idle["device_used"]
    cells = [r for r in kv_rows if "error" not in r and r.get("model") == model]
    activations = max((r["allocator_peak_delta_bytes"] - r["cache_bytes"] for r in cells), default=None)
    overhead = at_load - weights + activations if weights is not None and activations is not None else None
    return {"model": model, "context_bytes": context, "weights_bytes": weights, "loaded_device_delta_bytes": at_load,
            "at_load_bytes": at_load - weights if weights is not None else None,
            "activations_peak_bytes": activations, "overhead_bytes": overhead,
            "largest_cell": max(((r["prompt_tokens"], r["batch"]) for r in cells),
                                key=lambda c: c[0] * c[1], default=None),
            "over_assumption": ratio(overhead, PLANNER_OVERHEAD)}


def markdown(result: dict) -> list[str]:
    lines = ["", "## (d) runtime overhead: memory besides weights and KV (issue 15 item 4)", "",
             "Per model, NVML's device use over the idle device: at `ready` (the CUDA context, nothing "
             "allocated) and at `loaded` (weights in place, kernels warmed, cached blocks released); weights = "
             "the allocator's live bytes at `loaded`; activations = the largest cell's allocator peak during "
             "`generate` minus its cache; overhead = (loaded - weights) + activations, what `kvbench plan` "
             f"assumes is {fmt_gib(PLANNER_OVERHEAD)} per GPU (`kvbench plan --overhead-from` takes an engine run's "
             "figure instead).", "",
             "| model | CUDA context | weights | loaded - weights | activations peak (cell) | overhead | "
             "overhead / 1.5 GiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for o in result.get("overhead", []):
        cell = f" ({o['largest_cell'][0]} x{o['largest_cell'][1]})" if o.get("largest_cell") else ""
        lines.append(f"| {o['model']} | {fmt_bytes(o['context_bytes'])} | {fmt_bytes(o['weights_bytes'])} "
                     f"| {fmt_bytes(o['at_load_bytes'])} | {fmt_bytes(o['activations_peak_bytes'])}{cell} "
                     f"| {fmt_bytes(o['overhead_bytes'])} | {fmt_ratio(o['over_assumption'])} |")
    if not result.get("overhead"):
        lines.append("| not measured | | | | | | |")
    return lines
