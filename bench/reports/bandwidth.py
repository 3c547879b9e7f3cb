"""Decode against the memory-bandwidth limit (bench/common/bandwidth.py, bench/run/decode_bound.py): per cell the
bytes one decode step reads, the fastest ITL those bytes allow at the run's measured read bandwidth, the ITL the
cell measured, and the efficiency (bound / measured); plots.py draws ITL against context with the bound under it,
so a reader sees the KV's reads grow with context. docs/metrics.md, "Decode bound", defines each term."""
from __future__ import annotations

import pandas as pd

from kvbench.kv.units import MIB
from kvbench.store.schema import OK_STATUSES

from .tables import LEAD_RIGHT, _lead, _missing, fmt_num, with_failures

SECTION = "decode_bound"  # plots.py DECODE_BOUND_SECTION draws its figure
TITLE = "Decode against the memory-bandwidth limit"
INTRO = ("A decode step reads every weight once and the cached K/V of every sequence running, so no step is "
         "faster than those bytes over the memory's read bandwidth (measured at the run's start, run.json "
         "`memory_bandwidth`). Read per step: the weights (the engine's own figure, else the checkpoint's) and "
         "the KV of the most requests the cell had in flight, each at its mean decode position (prompt + half "
         "the output). ITL bound: those bytes over the bandwidth. Efficiency: the bound over the median ITL "
         "measured; 100 % is the hardware's limit, and the rest is the engine's (compute, scheduling, the "
         "client). KV share: the KV's part of the bytes read, which grows with context and load. Where the "
         "engine keeps its own estimate (vLLM's --enable-mfu-metrics): the bytes its passes read over the cell "
         "per step it took (its prefill steps among them), and kvbench's bytes a decode step over it.")


def measured(agg: pd.DataFrame) -> bool:
    return "itl_s_bound" in agg and bool(agg.itl_s_bound.notna().any())


def not_measured_note(agg: pd.DataFrame) -> str:
    """Why no cell has a bound (a run before schema v10, the probe switched off, a GPU machine)."""
    reasons = sorted({s for s in agg.get("decode_bound_source", pd.Series(dtype=object))
                      if isinstance(s, str) and s})
    return "; ".join(reasons) or "not measured: this run predates the bandwidth probe (results schema 10)"


def bound_table(agg: pd.DataFrame) -> pd.DataFrame:
    out = _lead(agg)
    columns = {k: [] for k in ("weights MiB", "KV read MiB", "KV share", "ITL bound ms", "ITL p50 ms",
                               "efficiency")}
    for r in agg.itertuples():
        kv = None if _missing(r.decode_step_bytes) else r.decode_step_bytes * r.decode_kv_share
        weights = None if kv is None else r.decode_step_bytes - kv
        columns["weights MiB"].append(fmt_num(weights, 1 / MIB, 1))
        columns["KV read MiB"].append(fmt_num(kv, 1 / MIB, 1))
        columns["KV share"].append("-" if _missing(r.decode_kv_share) else f"{r.decode_kv_share:.1%}")
        columns["ITL bound ms"].append(fmt_num(r.itl_s_bound, 1000, 2))
        columns["ITL p50 ms"].append(fmt_num(r.itl_s_p50, 1000, 2))
        columns["efficiency"].append("-" if _missing(r.decode_efficiency) else f"{r.decode_efficiency:.0%}")
    if "engine_step_read_bytes" in agg and agg.engine_step_read_bytes.notna().any():  # the engine's own estimate
        columns[ENGINE] = [fmt_num(b, 1 / MIB, 1) for b in agg.engine_step_read_bytes]
        columns[KVBENCH_OVER_ENGINE] = ["-" if _missing(b) or _missing(k) else f"{k / b:.2f}"
                                        for k, b in zip(agg.decode_step_bytes, agg.engine_step_read_bytes)]
    for k, v in columns.items():
        out[k] = v
    return with_failures(out, agg, ~agg.status.isin(OK_STATUSES), "weights MiB")


ENGINE, KVBENCH_OVER_ENGINE = "engine's read MiB a step", "kvbench / engine"
RIGHT = LEAD_RIGHT | {"weights MiB", "KV read MiB", "KV share", "ITL bound ms", "ITL p50 ms", "efficiency", ENGINE,
                      KVBENCH_OVER_ENGINE}
