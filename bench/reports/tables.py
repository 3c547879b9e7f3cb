"""The report's tables as pandas DataFrames of display strings, one function per question.

Every function takes the tidy cells of :func:`kvbench.store.readers.load` (one or more runs, repeats
included) and returns a frame whose columns are the table's headings; ``markdown.py`` and ``html.py``
only lay them out. Repeats of one cell are averaged (the ``rep`` column says how many).
"""
from __future__ import annotations

import re

import pandas as pd

from kvbench.backends import ENGINES, kv_rules
from kvbench.kv import units
from kvbench.kv.rules import KVRules
from kvbench.run.cells import load_label as _load_label
from kvbench.store.schema import CELL_CONFIG_FIELDS, OK_STATUSES

NOT_MEASURED = "not measured"


# --- formatting ----------------------------------------------------------------------------------------

def _missing(x) -> bool:
    return x is None or (not isinstance(x, str) and pd.isna(x))


def fmt_bytes(x) -> str:
    return units.fmt_bytes(None if _missing(x) else x, missing=NOT_MEASURED)


def fmt_num(x, scale=1.0, digits=3) -> str:
    return "-" if _missing(x) else f"{x * scale:,.{digits}f}"


def fmt_ratio(x) -> str:
    return "-" if _missing(x) else f"{x:.4f}"


def fmt_int(x) -> str:
    return "-" if _missing(x) else f"{int(x):,}"


# --- the cells, repeats averaged -----------------------------------------------------------------------

def many_runs(cells: pd.DataFrame) -> bool:
    return cells.run_id.nunique() > 1


def load_label(r) -> str:
    """The load column of a cell's row (:func:`kvbench.run.cells.load_label`)."""
    return _load_label(r.load_profile, None if _missing(r.concurrency) else int(r.concurrency),
                       None if _missing(r.request_rate) else r.request_rate)


def aggregate(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, backend, cell configuration): numbers averaged over the repeats, ``repeats``
    counted, ``status`` the worst of them, flags and errors joined. A deployment's rows per replica stay
    apart from its total (``replica``), placed after the total of their cell in the order of the urls."""
    keys = ["run_id", "backend", *CELL_CONFIG_FIELDS, *(["replica"] if "replica" in cells else [])]
    frame = cells.copy()
    for k in keys:  # None in a key (request_rate of a closed loop) must not drop the row
        frame[k] = frame[k].astype(object).where(frame[k].notna(), None)
    worst = {"failed": 0, "not run": 1, "flagged": 2, "ok": 3}
    rows = []
    for _, group in frame.groupby(keys, dropna=False, sort=False):
        group = group.sort_values("repeat")
        first = group.iloc[0].to_dict()
        good = group[group.status.isin(OK_STATUSES)]
        numeric = good.select_dtypes("number")
        if not good.empty:
            first.update({k: v for k, v in numeric.mean().items() if k not in keys and k != "repeat"})
            if "client_loop_lag_s_max" in numeric:  # a bound on the client's error: the worst repeat's
                first["client_loop_lag_s_max"] = numeric.client_loop_lag_s_max.max()
        first["repeats"] = len(group)
        first["status"] = min(group.status, key=lambda s: worst.get(s, 0))
        first["flags"] = [f for fl in group["flags"] for f in (fl or [])]
        first["errors"] = [e for e in group.error if isinstance(e, str) and e]
        first["log_tail"] = next((t for t in group.log_tail if isinstance(t, str) and t), None)
        rows.append(first)
    out = pd.DataFrame(rows)
    # stable: a deployment's replicas stay after its total, in the order its urls were given
    return out.sort_values(["run_id", "backend", "prompt_tokens", "load_profile", "concurrency"], kind="stable",
                           key=lambda s: s.fillna(0) if s.dtype != object else s.fillna("")).reset_index(drop=True)


def _lead(agg: pd.DataFrame) -> pd.DataFrame:
    """The columns that say which cell a row is: [run,] backend, [variant,] prompt, conc|load[, rep]."""
    lead = pd.DataFrame(index=agg.index)
    if many_runs(agg):
        lead["run"] = agg.run_id
    lead["backend"] = agg.backend
    if deployments(agg):  # a deployment's total, then each replica (by host:port); "" for a single server
        lead["replica"] = [replica_label(r) for r in agg.itertuples()]
    if (agg.variant.fillna("") != "").any():
        lead["variant"] = agg.variant.fillna("")
    lead["prompt"] = agg.prompt_tokens.map(lambda x: "-" if _missing(x) else str(int(x)))
    if agg.request_rate.notna().any():  # an open-loop cell: its load needs more than a concurrency
        lead["load"] = [load_label(r) for r in agg.itertuples()]
    else:
        lead["conc"] = agg.concurrency.map(fmt_int)
    if (agg.repeats > 1).any():
        lead["rep"] = agg.repeats.astype(str)
    return lead


LEAD_RIGHT = {"prompt", "conc", "rep"}


def deployments(agg: pd.DataFrame) -> bool:
    """Whether any row is a deployment's (backends/deployment.py: several replicas as one backend)."""
    return "replicas" in agg and agg.replicas.notna().any()


def replica_label(r) -> str:
    """The replica column: the replica's host:port, "total (N replicas)" for a deployment's total row."""
    if isinstance(r.replica, str) and r.replica:
        return r.replica
    return "" if _missing(r.replicas) else f"total ({int(r.replicas)} replicas)"


def totals(agg: pd.DataFrame) -> pd.DataFrame:
    """The rows of whole backends: single servers and deployments' totals, without the rows per replica
    (what the plots and ``kvbench compare`` read)."""
    return agg[agg.replica.fillna("") == ""] if "replica" in agg else agg


def queued_first_lines(agg: pd.DataFrame) -> list[str]:
    """For each cell of a deployment: which replica queued first (the first poll that found requests
    waiting on any replica), and when each replica first did."""
    lines = []
    for r in agg[agg.replicas.notna() & (agg.replica.fillna("") == "")].itertuples() if deployments(agg) else []:
        lead = f"`{r.backend}` prompt {int(r.prompt_tokens)}, {load_label(r)}" + (f", {r.variant}" if r.variant else "")
        if r.status not in OK_STATUSES:
            continue
        parts = agg[(agg.run_id == r.run_id) & (agg.backend == r.backend) & (agg.cell_id.str.startswith(r.cell_id + "@"))]
        others = ", ".join(f"{p.replica} at {p.queued_first_s:.2f} s" if not _missing(p.queued_first_s) else
                           f"{p.replica} never" for p in parts.itertuples())
        if _missing(r.queued_first_replica):
            lines.append(f"{lead}: no replica queued (no poll found requests waiting)")
        else:
            lines.append(f"{lead}: replica {r.queued_first_replica} queued first, {r.queued_first_s:.2f} s into the "
                         f"cell (requests waiting on it; {others})")
    return lines


def kv_table(agg: pd.DataFrame) -> pd.DataFrame:
    """KV predicted by the formula vs what the engine reports in use and allocates, and process RSS."""
    out = _lead(agg)
    failed = ~agg.status.isin(OK_STATUSES)
    out["KV dtype"] = agg.kv_dtype
    out["bytes/token (formula)"] = agg.kv_bytes_per_token_predicted.map(lambda x: fmt_num(x, digits=0))
    out["KV peak predicted"] = agg.kv_bytes_peak_predicted.map(fmt_bytes)
    out["KV peak in use (engine)"] = agg.kv_in_use_peak_bytes.map(fmt_bytes)
    out["in use / predicted"] = agg.kv_measured_over_predicted.map(fmt_ratio)

    pool = pool_label

    out["KV pool (engine)"] = [pool(r) for r in agg.itertuples()]
    out["pool tokens"] = agg.kv_pool_tokens_engine.map(fmt_int)
    out["RSS peak"] = agg.rss_peak_bytes.map(fmt_bytes)
    if agg.gpu_process_peak_bytes.notna().any():
        out["GPU memory peak (process)"] = agg.gpu_process_peak_bytes.map(fmt_bytes)
    # a key per source, the sources under the table (kv_source_notes): the long texts wrapped every row of a
    # terminal's table to five lines
    keys = source_keys(agg)

    def source(s) -> str:
        if not isinstance(s, str):
            return NOT_MEASURED
        polls = _POLLS.match(s)
        return keys[_POLLS.sub("max of the polls of ", s)] + (f" {polls[1]} polls" if polls else "")

    out["source of \"in use\""] = agg.kv_in_use_source.map(source)
    return with_failures(out, agg, failed, "bytes/token (formula)")


_POLLS = re.compile(r"max of (\d+) polls of ")  # "max of 49 polls of /slots ...": the count stays in the row


def source_keys(agg: pd.DataFrame) -> dict[str, str]:
    """Each distinct source of "KV in use" (its poll count aside) and its key in the table: [1], [2], ..."""
    sources = dict.fromkeys(_POLLS.sub("max of the polls of ", s) for s in agg.kv_in_use_source if isinstance(s, str))
    return {s: f"[{i}]" for i, s in enumerate(sources, 1)}


def kv_source_notes(agg: pd.DataFrame) -> str:
    """The sources the KV table's keys stand for, one line each."""
    return "  \n".join(f"{key} {source}" for source, key in source_keys(agg).items())


def failure_text(r, width: int = 60) -> str:
    """A failed cell's status and the start of its first error (the problems section has it all)."""
    error = next(iter(r.errors), "") if isinstance(r.errors, list) else ""
    error = error.splitlines()[0] if error else ""
    return f"{r.status}: {error[:width]}{'...' if len(error) > width else ''}" if error else str(r.status)


def with_failures(out: pd.DataFrame, agg: pd.DataFrame, failed: pd.Series, first_figure: str) -> pd.DataFrame:
    """A failed cell's figures blank from ``first_figure`` on, and its failure in a "failure" column of its
    own (only when a cell failed), never in a figure's column."""
    measured = list(out.columns[out.columns.get_loc(first_figure):])
    out.loc[failed, measured] = ""
    if failed.any():
        out.insert(out.columns.get_loc(first_figure), "failure",
                   ["" if not bad else failure_text(r) for r, bad in zip(agg.itertuples(), failed)])
    return out


KV_RIGHT = LEAD_RIGHT | {"bytes/token (formula)", "KV peak predicted", "KV peak in use (engine)", "in use / predicted",
                         "KV pool (engine)", "pool tokens", "RSS peak", "GPU memory peak (process)"}


def performance_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Latency percentiles and throughput per engine, context and load."""
    out = _lead(agg)
    out["status"] = agg.status
    out["TTFT p50 (s)"] = agg.ttft_s_p50.map(fmt_num)
    out["TTFT p99 (s)"] = agg.ttft_s_p99.map(fmt_num)
    out["ITL p50 (ms)"] = agg.itl_s_p50.map(lambda x: fmt_num(x, 1000, 2))
    out["ITL p99 (ms)"] = agg.itl_s_p99.map(lambda x: fmt_num(x, 1000, 2))
    out["TPOT p50 (ms)"] = agg.tpot_s_p50.map(lambda x: fmt_num(x, 1000, 2))
    out["E2E p50 (s)"] = agg.e2e_s_p50.map(fmt_num)
    out["E2E p99 (s)"] = agg.e2e_s_p99.map(fmt_num)
    out["out tok/s"] = agg.output_tokens_per_s.map(lambda x: fmt_num(x, digits=1))
    out["req/s"] = agg.requests_per_s.map(lambda x: fmt_num(x, digits=3))
    if agg.goodput_requests_per_s.notna().any():
        out["goodput req/s"] = agg.goodput_requests_per_s.map(lambda x: fmt_num(x, digits=3))
    out["ok/sent"] = [f"{int(r.n_ok)}/{int(r.n_requests)}" for r in agg.itertuples()]
    if "client_loop_lag_s_max" in agg and agg.client_loop_lag_s_max.notna().any():  # runs before it lack it
        out["client lag max (ms)"] = agg.client_loop_lag_s_max.map(lambda x: fmt_num(x, 1000, 1))
    if "client_limit_share" in agg and agg.client_limit_share.notna().any():  # the run probed its client
        out["client / ceiling"] = agg.client_limit_share.map(lambda x: "-" if _missing(x) else f"{x:.2%}")
        out["client TTFT added (ms)"] = agg.client_ttft_overhead_s.map(lambda x: fmt_num(x, 1000, 2))
    return out


PERF_RIGHT = LEAD_RIGHT | {"TTFT p50 (s)", "TTFT p99 (s)", "ITL p50 (ms)", "ITL p99 (ms)", "TPOT p50 (ms)",
                           "E2E p50 (s)", "E2E p99 (s)", "out tok/s", "req/s", "goodput req/s", "ok/sent",
                           "client lag max (ms)", "client / ceiling", "client TTFT added (ms)"}


def pool_label(r) -> str:
    """The engine's KV pool, or why there is none (the adapter's word; transformers batches statically)."""
    if not _missing(r.kv_pool_bytes_engine):
        return fmt_bytes(r.kv_pool_bytes_engine)
    if isinstance(r.kv_pool_source, str):
        return r.kv_pool_source
    rules = kv_rules(r.engine) if r.engine in ENGINES else None
    return rules.no_pool_label if rules is not None else KVRules.no_pool_label


def sequences_fitting(r) -> float | None:
    """How many sequences of this cell's length the engine's KV pool holds by the KV model's engine rule
    (the runner's ``kv_pool_sequences_predicted``); for older rows, whole tokens without rounding."""
    predicted = getattr(r, "kv_pool_sequences_predicted", None)
    if not _missing(predicted):
        return predicted
    if _missing(r.kv_pool_tokens_engine):
        return None
    return r.kv_pool_tokens_engine // (r.prompt_tokens + r.output_tokens - 1)


def boundary_table(agg: pd.DataFrame) -> pd.DataFrame:
    """The KV boundary: how many sequences the engine's KV pool holds by the KV model (predicted) against
    how many the engine ran at once and how many waited or were preempted (its own counters)."""
    out = _lead(agg)
    out["KV needed (predicted)"] = agg.kv_bytes_peak_predicted.map(fmt_bytes)
    out["KV pool (engine)"] = [pool_label(r) for r in agg.itertuples()]
    fits = [sequences_fitting(r) for r in agg.itertuples()]
    out["sequences the pool holds (predicted)"] = [fmt_int(f) for f in fits]
    running = agg.requests_running_peak if "requests_running_peak" in agg else pd.Series(None, index=agg.index)
    out["running at once (engine, peak)"] = running.map(lambda x: NOT_MEASURED if _missing(x) else f"{x:g}")

    def verdict(r, f) -> str:
        if f is None:
            return "no pool" if pool_label(r).startswith("no pool") else "-"
        wanted = r.concurrency if not _missing(r.concurrency) else r.max_in_flight
        if isinstance(getattr(r, "replica", ""), str) and getattr(r, "replica", ""):
            wanted = r.max_in_flight  # a deployment's replica: the requests it was sent at once, not the cell's
        if _missing(wanted):
            return "-"
        return "within" if wanted <= f else "beyond: must queue or preempt"

    out["load vs boundary"] = [verdict(r, f) for r, f in zip(agg.itertuples(), fits)]
    out["in flight (client, max)"] = agg.max_in_flight.map(fmt_int)
    out["waiting (peak)"] = agg.requests_waiting_peak.map(lambda x: NOT_MEASURED if _missing(x) else f"{x:g}")
    out["preemptions"] = agg.preemptions.map(lambda x: NOT_MEASURED if _missing(x) else f"{x:g}")
    return with_failures(out, agg, ~agg.status.isin(OK_STATUSES), "KV needed (predicted)")


BOUNDARY_RIGHT = LEAD_RIGHT | {"KV needed (predicted)", "KV pool (engine)", "sequences the pool holds (predicted)",
                               "running at once (engine, peak)", "in flight (client, max)", "waiting (peak)",
                               "preemptions"}


def problems_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Every failed, flagged or not-run cell with the reason (the error, then the flags)."""
    bad = agg[~agg.status.isin(["ok"])]
    out = _lead(agg).loc[bad.index]  # the same leading columns as the other tables
    out["status"] = bad.status
    out["reason"] = ["; ".join(dict.fromkeys([*r.errors, *r.flags])) or "-" for r in bad.itertuples()]
    return out


def log_tails(agg: pd.DataFrame, lines: int = 8) -> list[tuple[str, str]]:
    """(cell id, last lines of the engine's log) of each failed cell that has a log tail."""
    bad = agg[~agg.status.isin(["ok"]) & agg.log_tail.map(lambda t: isinstance(t, str) and bool(t))]
    return [(r.cell_id, "\n".join(r.log_tail.splitlines()[-lines:])) for r in bad.itertuples()]


def validation_table(rows: list[dict]) -> pd.DataFrame:
    """`kvbench validate`'s checks (kv_validation.jsonl): the KV model against the engines' allocations."""
    def fmt(x):
        return "-" if x is None else f"{x:,.0f}"

    return pd.DataFrame({
        "engine": [r["engine"] for r in rows],
        "case": [r["case"] for r in rows],
        "quantity": [r["quantity"] for r in rows],
        "predicted": [fmt(r["predicted"]) for r in rows],
        "engine-reported": [fmt(r["engine_reported"]) for r in rows],
        "measured": [fmt(r["measured"]) for r in rows],
        "error %": ["-" if r["error_pct"] is None else f"{r['error_pct']:+.4f}" for r in rows],
        "within engine rounding": [f"{'yes' if r['ok'] else 'NO'} {('(' + r['note'] + ')') if r['note'] else ''}".strip()
                                   for r in rows],
    })


VALIDATION_RIGHT = {"predicted", "engine-reported", "measured", "error %"}
