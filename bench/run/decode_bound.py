"""A cell's decode bound (bench/common/bandwidth.py): the bytes one decode step reads by kvbench's model, over the
read bandwidth measured at the run's start, beside the ITL the cell measured. docs/metrics.md, "Decode bound"."""
from __future__ import annotations

from kvbench.backends.types import StepBytesCounters
from kvbench.common.bandwidth import decode_bound
from kvbench.kv.geometry import KVGeometry, UnknownKVDtype, kv_bytes_for_sequence
from kvbench.kv.units import fmt_bytes
from kvbench.planner.decode import experts_read
from kvbench.store.schema import CellRow


def decode_bound_columns(row: CellRow, geometry: KVGeometry, bandwidth: dict | None, checkpoint_bytes: int | None,
                         output_tokens: int, moe: dict | None = None) -> None:
    """Fill the row's ``decode_*`` and ``itl_s_bound`` where the run measured a bandwidth, the weights are known
    (the engine's own figure, else the checkpoint as stored) and the KV dtype has a size; else leave them None
    and say why in ``decode_bound_source``. A MoE model's step (``moe``: run.json's ``model.moe``) reads the rest
    of the weights whole and the share of its routed experts that its sequences' tokens take, as `kvbench plan
    --bandwidth` counts them (kvbench.planner.decode.experts_read)."""
    if not bandwidth or not bandwidth.get("bytes_per_s"):
        row.decode_bound_source = "not measured: " + ((bandwidth or {}).get("not_measured")
                                                      or "no bandwidth was probed at the run's start")
        return
    weights, weights_from = row.weights_bytes_engine, row.weights_source
    if not weights:
        weights, weights_from = checkpoint_bytes, "the checkpoint's tensors as stored"
    if not weights:
        row.decode_bound_source = "not measured: the engine reported no weights and the checkpoint is not safetensors"
        return
    # at a decode step a sequence has its prompt and, on average over its decode, half its output cached
    attended = row.prompt_tokens + (output_tokens - 1) // 2
    sequences = max(1, row.max_in_flight or row.concurrency or 1)  # the most the cell had in flight
    experts = ""
    if (read := experts_read(moe, sequences)) is not None:
        weights = weights * ((1 - moe["expert_share"]) + moe["expert_share"] * read)
        experts = (f", of which the routed experts ({moe['expert_share']:.0%}) read at {read:.0%}: {sequences} "
                   f"token{'s' * (sequences > 1)} a step taking {moe['experts_per_token']} of {moe['routed_experts']} each")
    try:
        per_sequence = kv_bytes_for_sequence(geometry, row.kv_dtype, attended)
    except UnknownKVDtype:
        row.decode_bound_source = f"not measured: no element size for the KV dtype {row.kv_dtype}"
        return
    # on a GPU the figure is per GPU, and each of the GPUs the engine is split over reads its share at once
    rate = bandwidth["bytes_per_s"] * (max(1, row.gpus_used or 1) if bandwidth.get("device") == "gpu" else 1)
    bound = decode_bound(weights, per_sequence, sequences, rate)
    row.decode_step_bytes, row.decode_kv_share, row.itl_s_bound = bound.step_bytes, bound.kv_share, bound.itl_s
    if row.itl_s_p50:
        row.decode_efficiency = bound.itl_s / row.itl_s_p50
    row.decode_bound_source = (f"weights {fmt_bytes(weights)} ({weights_from}{experts}); KV of {sequences} x "
                               f"{attended:,} tokens by kvbench's formula; read bandwidth "
                               f"{rate / 1e9:,.1f} GB/s ({_said(bandwidth, row)})")


def _said(bandwidth: dict, row: CellRow) -> str:
    label = bandwidth.get("label") or f"{bandwidth.get('threads', '?')} threads, measured at the run's start"
    gpus = max(1, row.gpus_used or 1) if bandwidth.get("device") == "gpu" else 1
    return label + (f", x {gpus} GPUs" if gpus > 1 else "")



#: kvbench's bytes a decode step over the engine's own estimate further than this from 1 is flagged
DISAGREE = 0.05


def engine_step_bytes_columns(row: CellRow, before: StepBytesCounters | None, after: StepBytesCounters | None) -> None:
    """The engine's own bytes a step over the cell, beside kvbench's bound: its counters' rise over the steps
    it took (``engine_step_*``), or why there is none in ``engine_step_bytes_source`` (None: the engine keeps
    no such estimate). An attached server's counters also count other clients' steps."""
    if before is None or after is None:
        row.engine_step_bytes_source = None if before is None and after is None else "not read: a read failed"
        return
    if before.steps is None or after.steps is None or after.steps <= before.steps:
        row.engine_step_bytes_source = f"not measured: no step counted over the cell ({after.source})"
        return
    steps = after.steps - before.steps
    row.engine_step_read_bytes = (after.read_bytes - before.read_bytes) / steps
    row.engine_step_write_bytes = (after.write_bytes - before.write_bytes) / steps
    row.engine_step_bytes_source = f"{after.source}: {steps:,.0f} steps over the cell"
    if row.decode_step_bytes and row.engine_step_read_bytes and \
            abs(row.decode_step_bytes / row.engine_step_read_bytes - 1) > DISAGREE:
        row.flags.append(f"decode bytes disagree: kvbench reads {fmt_bytes(row.decode_step_bytes)} a decode step, "
                         f"the engine's own estimate {fmt_bytes(row.engine_step_read_bytes)} a step (its prefill "
                         f"steps among them): {row.decode_step_bytes / row.engine_step_read_bytes:.2f} x")
