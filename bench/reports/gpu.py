"""The report's GPU sections (issue 15): memory per GPU beside the KV per GPU and the overhead measured, and
the planner's prediction beside the largest load each engine served. Only rows measured on a GPU (NVML's
per-device figures) appear: a CPU run has neither section."""
from __future__ import annotations

import pandas as pd

from kvbench.kv.units import GIB
from kvbench.store.schema import OK_STATUSES

from .tables import _lead, _missing, fmt_bytes, fmt_int, fmt_ratio

GPU_MEMORY_INTRO = (
    "Memory per GPU (NVML, over the idle baseline taken before the engine started), for every GPU the engine "
    "was split over (`gpus_used`: vLLM `tp`, TGI `num_shard`, llama.cpp's layer split, transformers "
    "`device_map`). KV per GPU: the engine's KV in use on one GPU at its peak, against what its KV rules give "
    "for one GPU at the same load (`kvbench plan --tp N`'s per-GPU figure). Overhead per GPU: the fullest "
    "GPU's use minus the weights the engine reported and its KV pool there (CUDA context, graphs, activations, "
    "allocator slack); `kvbench plan --overhead-from RUN` plans with it instead of the 1.5 GiB assumption.")
PLANNER_INTRO = (
    "The planner against the real boundary: per engine and sequence length (prompt + output), the largest "
    "concurrency the engine served with every request within the token contract, none waiting and none "
    "preempted (its own counters), beside what `kvbench plan` predicts fits the same GPU (weights + KV by the "
    "engine's rules + overhead, {margin:.0%} of the GPU kept free; the overhead this run measured where it did, "
    "else the 1.5 GiB assumption). Measured below predicted: the planner is optimistic at this length; above: "
    "it leaves memory unused. Only the concurrencies the workload ran can be served, so 'served' is a lower "
    "bound where the largest one ran without queueing.")
MARGIN = 0.10


def gpu_rows(agg: pd.DataFrame) -> pd.DataFrame:
    """The aggregated rows measured with NVML's per-device figures."""
    if "gpu_devices" not in agg:
        return agg.iloc[0:0]
    return agg[[isinstance(d, list) and len(d) > 0 for d in agg.gpu_devices]]


def _devices(devices: list[dict]) -> str:
    return ", ".join(f"GPU{d.get('index', i)} {fmt_bytes(d.get('over_baseline_peak_bytes'))}"
                     for i, d in enumerate(devices))


def gpu_memory_table(agg: pd.DataFrame) -> pd.DataFrame | None:
    rows = gpu_rows(agg)
    if rows.empty:
        return None
    out = _lead(agg).loc[rows.index]
    out["mode"] = [m or "-" for m in rows.engine_mode]
    out["GPUs"] = rows.gpus_used.map(fmt_int)
    out["use over baseline per GPU (peak)"] = [_devices(d) for d in rows.gpu_devices]
    out["weights (engine)"] = rows.weights_bytes_engine.map(fmt_bytes)
    out["KV per GPU in use"] = rows.kv_in_use_peak_bytes_per_gpu.map(fmt_bytes)
    out["KV per GPU (rules)"] = rows.kv_peak_bytes_per_gpu_predicted.map(fmt_bytes)
    out["in use / rules"] = [fmt_ratio(a / b) if not _missing(a) and not _missing(b) and b else "-"
                             for a, b in zip(rows.kv_in_use_peak_bytes_per_gpu, rows.kv_peak_bytes_per_gpu_predicted)]
    out["overhead per GPU"] = rows.gpu_overhead_bytes_per_gpu.map(fmt_bytes)
    return out


GPU_MEMORY_RIGHT = {"GPUs", "weights (engine)", "KV per GPU in use", "KV per GPU (rules)", "in use / rules",
                    "overhead per GPU"}


def served(group: pd.DataFrame) -> tuple[int | None, int | None]:
    """(largest concurrency served without queueing, preemption or failure; the smallest that was not) of
    one engine's cells at one length."""
    def clean(r) -> bool:
        return (r.status in OK_STATUSES and not r.n_truncated and not r.n_short
                and (_missing(r.requests_waiting_peak) or r.requests_waiting_peak <= 0)
                and (_missing(r.preemptions) or r.preemptions <= 0))
    ok = [int(r.concurrency) for r in group.itertuples() if not _missing(r.concurrency) and clean(r)]
    bad = [int(r.concurrency) for r in group.itertuples() if not _missing(r.concurrency) and not clean(r)]
    return (max(ok) if ok else None), (min(bad) if bad else None)


def predicted_batch(r, context: int, overhead_bytes: float | None, resolve=None) -> tuple[int | None, str]:
    """kvbench plan's largest batch at ``context`` on the GPU this row ran on (its device size, its split, its
    engine's KV rules, the weights the engine reported), and what it rests on; None where the model cannot be
    read here."""
    from kvbench.planner import PlanError, PlanInput, plan
    from kvbench.planner.overhead import ASSUMED_GIB

    try:
        model = (resolve or _resolve)(r.model)
    except Exception as exc:  # a model this machine cannot read (not cached, offline): no prediction
        return None, f"model not readable here: {str(exc).splitlines()[0][:80]}"
    if not _missing(r.weights_bytes_engine):
        from dataclasses import replace

        from kvbench.kv.weights import Weights

        model = replace(model, weights=Weights(float(r.weights_bytes_engine), "the engine's report", exact=True))
    devices = r.gpu_devices or []
    total = max((d.get("total_bytes") or 0) for d in devices) if devices else 0
    if not total:
        return None, "GPU size not recorded"
    overhead = overhead_bytes / GIB if overhead_bytes is not None else ASSUMED_GIB
    try:
        out = plan(PlanInput(model, context=context, batch=1, kv_dtype=r.kv_dtype if r.kv_dtype else "auto",
                             tp=int(r.gpus_used or 1), engine=r.engine, gpu=f"{total / GIB:.6f}GiB",
                             overhead_gib=max(0.0, overhead), margin=MARGIN, allow_long_context=True))
    except PlanError as exc:
        return None, str(exc)[:80]
    return out["max_batch"], ("measured overhead" if overhead_bytes is not None else "assumed 1.5 GiB overhead")


def _resolve(name: str):
    from kvbench.common import models
    from kvbench.planner import resolve_model

    return resolve_model(str(models.embedded_gguf(name)) if name in models.EMBEDDED else name)


def planner_table(agg: pd.DataFrame, resolve=None) -> pd.DataFrame | None:
    rows = gpu_rows(agg)
    if rows.empty:
        return None
    out = []
    keys = ["run_id", "backend", "engine_mode", "prompt_tokens", "output_tokens"]
    for (_, backend, mode, prompt, output), group in rows.groupby(keys, sort=False, dropna=False):
        first = group.iloc[0]
        largest, refused = served(group)
        measured = group.gpu_overhead_bytes_per_gpu.dropna()
        overhead = float(measured.max()) if not measured.empty else None
        predicted, basis = predicted_batch(first, int(prompt + output), overhead, resolve)
        out.append({"backend": backend, "mode": mode or "-", "GPUs": fmt_int(first.gpus_used),
                    "context (prompt + output)": f"{int(prompt + output):,}",
                    "largest served (no queue, no preemption)": fmt_int(largest),
                    "smallest not served cleanly": fmt_int(refused),
                    "planner's max concurrency": fmt_int(predicted), "planner used": basis,
                    "verdict": verdict(largest, refused, predicted)})
    return pd.DataFrame(out)


def verdict(largest: int | None, refused: int | None, predicted: int | None) -> str:
    """The planner's prediction against the boundary the engine showed (largest served cleanly, smallest not)."""
    if predicted is None or (largest is None and refused is None):
        return "-"
    if refused is not None and refused <= predicted:
        return "planner optimistic"
    if largest is not None and largest > predicted:
        return "planner pessimistic"
    if largest == predicted or (refused is not None and (largest or 0) < predicted < refused):
        return "agrees"
    return "not reached by the workload"


PLANNER_RIGHT = {"GPUs", "context (prompt + output)", "largest served (no queue, no preemption)",
                 "smallest not served cleanly", "planner's max concurrency"}
