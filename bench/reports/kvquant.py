"""The KV-quantisation section of a report: for each (engine, KV dtype, context) of a ``kv_quant`` run, the
bytes a quantised cache saves against the output it changes, beside the engine's own 16-bit cache on the
same prompts (docs/kv-quant.md).

Bytes per token are the engine's own pool (its bytes over its tokens: llama.cpp's log line, vLLM's blocks)
and its rules' prediction for the same pool; the sequences a fixed memory holds follow from the measured
figure. The output change is computed (kvbench.common.divergence) from the per-request records the run wrote
(logprobs/<cell_id>.json: the engine's own greedy tokens and top-k log-probabilities), pairing each
quantised cell with the baseline cell of the same prompts (same cell id, the baseline's KV dtype).
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from kvbench.common.divergence import Divergence, compare_requests
from kvbench.kv.units import GIB
from kvbench.store.readers import load_logprobs

FIXED_MEMORY = 1 * GIB  # the memory "sequences held" is counted in
RIGHT = {"context", "bytes/token measured", "predicted", "saved", "seqs in 1 GiB", "ITL p50", "identical",
         "first diff", "matched", "KL mean", "KL max", "positions", "PPL"}
INTRO = ("Each KV dtype is one engine start on the same prompts (greedy, ignore_eos) as the engine's own 16-bit "
         "cache, the baseline. Bytes/token measured = the engine's pool bytes over its tokens (its own log or "
         "blocks; transformers, which has no pool: its cache tensors' bytes at the end of generate over the "
         "tokens cached), predicted = its KV rules for that pool (or load); saved = against the baseline's measured figure; seqs "
         "in 1 GiB = sequences of the cell's prompt + output that 1 GiB of that cache holds (no engine rounding). "
         "ITL p50 at the cell's context, one request at a time. Output change against the baseline on the same "
         "prompts: identical = share of requests whose greedy tokens are all the same; first diff = the "
         "earliest position (0-based) where any differs; matched = mean share of positions before the first "
         "difference; KL = KL(baseline || quantised) in nats per position over the positions whose contexts "
         "are still identical, from the engines' own top-k log-probabilities (k stated: ids outside both top-k "
         "lists are pooled into one bucket per side, which makes it a lower bound on the full-vocabulary KL); "
         "PPL = teacher-forced perplexity of the prompts (natural text) baseline -> quantised, where the engine "
         "returns prompt log-probabilities. A quantised dtype whose pool is the baseline's size was declined by "
         "the engine: flagged.")


def baseline_cell(cell_id: str, dtype: str, baseline: str) -> str:
    """The baseline's cell of the same prompts: ``kv-<dtype>`` in the id replaced by ``kv-<baseline>``."""
    return cell_id.replace(f"_kv-{dtype}_", f"_kv-{baseline}_", 1)


def _fmt(v, spec: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def _kl(v: float | None) -> str:
    if v is None:
        return "not measured"
    return "0" if v == 0 else f"{v:.2e}"


def rows(run_dir: Path, cells: pd.DataFrame, baselines: dict[str, str]) -> list[dict]:
    """One dict per (backend, KV dtype, context) of the run's kv_quant cells, repeats pooled: the figures
    of the table and the plot, unformatted. ``baselines``: {backend label: its baseline KV dtype}."""
    records = load_logprobs(run_dir)
    cells = cells[cells.cell_id.str.contains("_kv-", regex=False) & cells.replica.fillna("").eq("")]
    out = []
    for (label, dtype, context), group in cells.groupby(["backend", "kv_dtype", "prompt_tokens"], sort=False):
        baseline = baselines.get(label)
        ok = group[group.status.isin(("ok", "flagged"))]
        base_cells = cells[(cells.backend == label) & (cells.kv_dtype == baseline) & (cells.prompt_tokens == context)]
        bpt, bpt_predicted = _measured(ok)
        base_bpt = _measured(base_cells)[0]
        mine, theirs = {}, {}
        for cell_id in ok.cell_id:
            other = baseline_cell(cell_id, dtype, baseline) if baseline else None
            if other is None or cell_id not in records or other not in records:
                continue
            mine.update({f"{cell_id}:{k}": v for k, v in records[cell_id].items()})
            theirs.update({f"{cell_id}:{k}": v for k, v in records[other].items()})
        div = compare_requests(theirs, mine) if mine else None
        per_seq = (bpt * (context + int(group.output_tokens.iloc[0]))) if bpt else None
        out.append({"backend": label, "engine": group.engine.iloc[0], "kv_dtype": dtype, "baseline": baseline,
                    "context": int(context), "bytes_per_token": bpt,
                    "bytes_per_token_predicted": bpt_predicted,
                    "saved": (1 - bpt / base_bpt) if bpt and base_bpt else None,
                    "sequences": int(FIXED_MEMORY // per_seq) if per_seq else None,
                    "itl_p50": ok.itl_s_p50.mean() if not ok.empty else None, "divergence": div,
                    "flags": [f for fl in group["flags"] for f in (fl or []) if "declined" in f],
                    "status": "ok" if not ok.empty else "not run" if set(group.status) == {"not run"} else "failed"})
    return out


def _measured(cells: pd.DataFrame) -> tuple[float | None, float | None]:
    """(measured, predicted) bytes per token of cells: the engine's pool over its tokens, and its rules for
    that pool; an engine without a pool (transformers' static batching): the cache tensors it held at the
    peak over the tokens cached, and its rules' answer for that load (KV dtypes of its own: a quantised
    cache's codes, scales and residual)."""
    measured = _per_token(cells.kv_pool_bytes_engine, cells.kv_pool_tokens_engine)
    if measured is not None:
        return measured, _per_token(cells.kv_pool_bytes_predicted, cells.kv_pool_tokens_engine)
    if "kv_in_use_peak_bytes" not in cells:
        return None, None
    gpus = cells.gpus_used.fillna(1).clip(lower=1) if "gpus_used" in cells else 1
    predicted = cells.kv_peak_bytes_per_gpu_predicted * gpus if "kv_peak_bytes_per_gpu_predicted" in cells else None
    return (_per_token(cells.kv_in_use_peak_bytes, cells.kv_in_use_peak_tokens),
            None if predicted is None else _per_token(predicted, cells.kv_in_use_peak_tokens))


def _per_token(num: pd.Series, den: pd.Series) -> float | None:
    pairs = [(a, b) for a, b in zip(num, den) if pd.notna(a) and pd.notna(b) and b]
    return sum(a / b for a, b in pairs) / len(pairs) if pairs else None


def table(data: list[dict], ppl_note: dict[str, str]) -> pd.DataFrame:
    """The section's table (display strings); ``ppl_note``: {backend: why its perplexity is not measured}."""
    lines = []
    for r in data:
        d: Divergence | None = r["divergence"]
        is_base = r["kv_dtype"] == r["baseline"]
        ppl = "-"
        if is_base and d and d.ppl_baseline is not None:  # its pairing is itself: the baseline's own perplexity
            ppl = f"{d.ppl_baseline:.4f}"
        elif d and d.ppl_baseline is not None and d.ppl_other is not None:
            ppl = f"{d.ppl_baseline:.4f} -> {d.ppl_other:.4f}"
        elif not is_base:
            ppl = ppl_note.get(r["backend"], "not measured")
        lines.append({
            "engine": r["backend"], "KV dtype": r["kv_dtype"] + (" (baseline)" if is_base else ""),
            "context": f"{r['context']:,}",
            "bytes/token measured": _fmt(r["bytes_per_token"], ",.1f", "not reported"),
            "predicted": _fmt(r["bytes_per_token_predicted"], ",.1f"),
            "saved": "-" if is_base else _fmt(r["saved"] * 100 if r["saved"] is not None else None, ".1f") + " %",
            "seqs in 1 GiB": _fmt(r["sequences"], ","),
            "ITL p50": _fmt(r["itl_p50"] * 1000 if r["itl_p50"] is not None else None, ".2f") + " ms",
            "identical": "-" if is_base or not d else f"{d.identical_share * 100:.0f} % of {d.requests}",
            "first diff": "-" if is_base or not d else ("none" if d.first_difference_min is None
                                                        else str(d.first_difference_min)),
            "matched": "-" if is_base or not d else f"{d.matched_share_mean * 100:.0f} %",
            "KL mean": "-" if is_base or not d else _kl(d.kl_mean) + (f" (top-{d.top_k})" if d.top_k else ""),
            "KL max": "-" if is_base or not d else _kl(d.kl_max),
            "positions": "-" if is_base or not d else str(d.kl_positions),
            "PPL": ppl,
            "flag": "; ".join(r["flags"]) or (r["status"] if r["status"] in ("failed", "not run") else ""),
        })
    return pd.DataFrame(lines)


def plot(data: list[dict], out: Path) -> Path | None:
    """Bytes saved against output change (mean KL, log scale), one point per (engine, KV dtype, context)."""
    import matplotlib.pyplot as plt

    from .plots import MARKERS, _save, color

    points = [r for r in data if r["kv_dtype"] != r["baseline"] and r["saved"] is not None and r["divergence"]
              and r["divergence"].kl_mean is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    contexts = sorted({r["context"] for r in points})
    floor = min([r["divergence"].kl_mean for r in points if r["divergence"].kl_mean > 0] or [1e-6]) / 10
    for r in points:
        kl = max(r["divergence"].kl_mean, floor)
        ax.scatter(r["saved"] * 100, kl, color=color(r["backend"]), s=60,
                   marker=MARKERS[contexts.index(r["context"]) % len(MARKERS)])
        ax.annotate(f"{r['kv_dtype']} @{r['context']}", (r["saved"] * 100, kl), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    for label in sorted({r["backend"] for r in points}):
        ax.scatter([], [], color=color(label), label=label)
    for i, c in enumerate(contexts):
        ax.scatter([], [], color="gray", marker=MARKERS[i % len(MARKERS)], label=f"context {c:,}")
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes per token saved against the engine's 16-bit cache (%, measured pool)")
    ax.set_ylabel("mean KL(baseline || quantised), nats per token (top-k)")
    ax.set_title("KV quantisation: bytes saved against output change")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)
