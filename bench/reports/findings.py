"""What a run found, per engine, in a few lines: the report's first section (issue 36).

Each line is made of the same aggregated cells as the tables below it (``aggregate``, a deployment's
total rows) and every figure is written as the tables write it (``fmt_*``), so a reader finds each one
again in the KV, boundary, latency or failures table: KV in use against the formula, where the engine's KV
pool saturated (or how full it got), throughput and latency at the top load, and the cells that failed.
"""
from __future__ import annotations

import pandas as pd

from kvbench.common.markdown import md_text
from kvbench.load.self_probe import NEAR_LIMIT
from kvbench.store.schema import OK_STATUSES

from .tables import (NOT_MEASURED, failure_text, fmt_bytes, fmt_int, fmt_num, fmt_ratio, load_label, pool_label,
                     sequences_fitting, totals)

TITLE = "What the run found"
MAX_TOP_CELLS = 4  # variants at the top load shown; the rest are in the latency table
INTRO = ("Per engine, from the tables below: KV in use against the formula, where the KV pool saturated, "
         "throughput and latency at the highest load, and the cells that failed.")


def _missing(x) -> bool:
    return x is None or (not isinstance(x, str) and pd.isna(x))


def _cell(r, with_variant: bool) -> str:
    """A cell as the tables' leading columns name it: prompt, load[, variant][, KV dtype]."""
    words = f"prompt {int(r.prompt_tokens)}, {load_label(r)}"
    if with_variant and isinstance(r.variant, str) and r.variant:
        words += f", {r.variant}"
    return words


def _kv_line(ok: pd.DataFrame, with_variant: bool) -> str:
    measured = ok[ok.kv_measured_over_predicted.notna()]
    if measured.empty:
        return "KV in use: not measured."
    low, high = measured.kv_measured_over_predicted.min(), measured.kv_measured_over_predicted.max()
    top = measured.loc[measured.kv_measured_over_predicted.idxmax()]
    spread = (f"{fmt_ratio(low)}" if fmt_ratio(low) == fmt_ratio(high) else
              f"{fmt_ratio(low)} to {fmt_ratio(high)}")
    return (f"KV in use at the peak is {spread} x the formula's prediction over {len(measured)} cell"
            f"{'s' if len(measured) != 1 else ''} (highest at {_cell(top, with_variant)}: "
            f"{fmt_bytes(top.kv_in_use_peak_bytes)} against {fmt_bytes(top.kv_bytes_peak_predicted)}).")


def _order(frame: pd.DataFrame) -> pd.DataFrame:
    """Cells from the lightest load to the heaviest: prompt, then concurrency (or rate)."""
    return frame.assign(_load=frame.request_rate.fillna(frame.concurrency).fillna(0)).sort_values(
        ["prompt_tokens", "_load"], kind="stable")


def _pool_full(r) -> bool:
    """Whether a cell that queued did so on a full pool: a request preempted, or as many running as it holds."""
    held = sequences_fitting(r)
    return (not _missing(r.preemptions) and r.preemptions > 0) or held is None or \
        _missing(r.requests_running_peak) or r.requests_running_peak >= held


def _pool_line(ok: pd.DataFrame, with_variant: bool) -> str:
    pooled = ok[ok.kv_pool_bytes_engine.notna()]
    if pooled.empty:
        labels = {pool_label(r) for r in ok.itertuples()}
        return f"KV pool: {', '.join(sorted(labels)) if labels else NOT_MEASURED}."
    queued = _order(pooled[(pooled.requests_waiting_peak.fillna(0) > 0) | (pooled.preemptions.fillna(0) > 0)])
    # a wait with fewer running than the pool holds is the scheduler's batch limit, not a full pool
    full = queued[[_pool_full(r) for r in queued.itertuples()]] if not queued.empty else queued
    if not queued.empty and full.empty:
        r = queued.iloc[0]
        return (f"Requests waited at {_cell(r, with_variant)} with {r.requests_running_peak:g} running, fewer than the "
                f"{fmt_int(sequences_fitting(r))} sequences of this length the KV pool ({pool_label(r)}) holds: the "
                f"engine's scheduler limited the batch, not the pool (no request preempted; {len(queued)} of "
                f"{len(pooled)} cells queued).")
    queued = full
    if not queued.empty:
        r = queued.iloc[0]
        held = sequences_fitting(r)
        what = [f"{r.requests_running_peak:g} ran at once" if not _missing(r.requests_running_peak) else None,
                f"{r.requests_waiting_peak:g} waited" if not _missing(r.requests_waiting_peak) and
                r.requests_waiting_peak > 0 else None,
                f"{r.preemptions:g} preempted" if not _missing(r.preemptions) and r.preemptions > 0 else None]
        return (f"The KV pool ({pool_label(r)}" + (f", {fmt_int(held)} sequences of this length"
                                                           if held is not None else "") +
                f") saturated first at {_cell(r, with_variant)}: " + ", ".join(w for w in what if w) +
                f" (the engine's counters; {len(queued)} of {len(pooled)} cells queued or preempted).")
    beyond = [r for r in _order(pooled).itertuples()
              if (fits := sequences_fitting(r)) is not None and not _missing(r.concurrency)
              and r.concurrency > fits]
    fullest = pooled.loc[pooled.kv_in_use_peak_bytes.fillna(-1).idxmax()]
    fill = (f"at most {fmt_bytes(fullest.kv_in_use_peak_bytes)} of its {pool_label(fullest)} in use "
            f"({_cell(fullest, with_variant)})" if not _missing(fullest.kv_in_use_peak_bytes) else
            f"its size {pool_label(fullest)}, KV in use not measured")
    if beyond:
        r = beyond[0]
        return (f"The KV pool holds {fmt_int(sequences_fitting(r))} sequences of prompt "
                f"{int(r.prompt_tokens)} by the KV model, fewer than the {int(r.concurrency)} asked at "
                f"{_cell(r, with_variant)}; the engine's queue was not measured; {fill}.")
    queue_measured = pooled.requests_waiting_peak.notna().any()
    return (f"The KV pool never saturated" + (" (no request waited or was preempted)" if queue_measured else
                                               " by the KV model (the engine's queue was not measured)") +
            f": {fill}.")


def _top_load_lines(ok: pd.DataFrame, with_variant: bool) -> list[str]:
    if ok.empty:
        return []
    loads = ok.request_rate.fillna(ok.concurrency)
    top = ok[loads == loads.max()]
    top = top[top.prompt_tokens == top.prompt_tokens.max()]
    lines = []
    for r in top.head(MAX_TOP_CELLS).itertuples():
        lines.append(f"At the top load ({_cell(r, with_variant)}"
                     + (f", KV {r.kv_dtype}" if ok.kv_dtype.nunique() > 1 and not with_variant else "") + "): "
                     f"{fmt_num(r.output_tokens_per_s, digits=1)} out tok/s, "
                     f"TTFT p50 {fmt_num(r.ttft_s_p50)} s, p99 {fmt_num(r.ttft_s_p99)} s, "
                     f"ITL p50 {fmt_num(r.itl_s_p50, 1000, 2)} ms, "
                     f"E2E p50 {fmt_num(r.e2e_s_p50)} s ({int(r.n_ok)}/{int(r.n_requests)} ok).")
    if len(top) > MAX_TOP_CELLS:
        lines.append(f"({len(top) - MAX_TOP_CELLS} more cells at that load in the latency table.)")
    return lines


def _failure_line(cells: pd.DataFrame, with_variant: bool) -> str:
    failed = cells[~cells.status.isin(OK_STATUSES)]
    flagged = cells[cells.status == "flagged"]
    if failed.empty and flagged.empty:
        return f"All {len(cells)} cells ran with every request as asked."
    parts = []
    if not failed.empty:
        first = failed.iloc[0]
        parts.append(f"{len(failed)} of {len(cells)} cells failed (first: {_cell(first, with_variant)}, "
                     f"{md_text(failure_text(first))})")  # a server's words: only text in the Markdown
    if not flagged.empty:
        parts.append(f"{len(flagged)} of {len(cells)} flagged (requests that broke the token contract)")
    return "; ".join(parts) + "."


def _client_line(ok: pd.DataFrame, with_variant: bool) -> str | None:
    """How close the client came to its own limit (bench/load/self_probe.py), where the run probed it."""
    if "client_limit_share" not in ok or ok.client_limit_share.isna().all():
        return None
    top = ok.loc[ok.client_limit_share.idxmax()]
    share, added = top.client_limit_share, top.client_ttft_overhead_s
    ceiling = top.client_events_per_s / share if share else None
    head = (f"The client read streamed events at up to {share:.2%} of its ceiling measured at the run's start "
            f"({fmt_num(top.client_events_per_s, digits=0)} of {fmt_num(ceiling, digits=0)} a second, "
            f"{_cell(top, with_variant)})")
    tail = "" if _missing(added) else f"; the client adds about {fmt_num(added, 1000, 2)} ms to a TTFT at that load"
    if share >= NEAR_LIMIT:
        return head + ": near its limit, its TTFT and ITL there hold client time" + tail + "."
    return head + tail + "."


def lines(agg: pd.DataFrame) -> dict[str, list[str]]:
    """{engine's label: its findings}, in the order the engines appear in the tables."""
    whole = totals(agg)
    out: dict[str, list[str]] = {}
    for label, cells in whole.groupby("label", sort=False):
        ok = cells[cells.status.isin(OK_STATUSES)]
        with_variant = (cells.variant.fillna("") != "").any()
        found = [_kv_line(ok, with_variant), _pool_line(ok, with_variant) if not ok.empty else None,
                 *_top_load_lines(ok, with_variant), _client_line(ok, with_variant),
                 _failure_line(cells, with_variant)]
        out[str(label)] = [line for line in found if line]
    return out


def note(agg: pd.DataFrame) -> str:
    """The section's text: per engine its name in bold, then its findings as a list."""
    return "\n\n".join(f"**{label}**\n\n" + "\n".join(f"- {line}" for line in found)
                       for label, found in lines(agg).items())
