"""``kvbench compare``: the cells of a baseline and a candidate matched by configuration, and every headline
metric's change with a confidence interval, judged against a tolerance.

- **Matching**: two cells are the same measurement when they agree on the match fields (default:
  :data:`bench.results.CELL_CONFIG_FIELDS` minus ``engine_version``, the thing being upgraded; configurable
  with ``[match] fields`` in the tolerances file or ``--match-on``). The repeats of a cell (``repeat``)
  are its samples. A cell on one side only, or whose ``token_contract`` differs between the sides, is
  listed and not compared. A cell that failed on the candidate but ran on the baseline counts as a
  regression; one that failed on the baseline only is listed.
- **Intervals** (``bench/stats.py``): >= 2 repeats per side: Welch t-interval on the ratio of the means;
  otherwise, for latency percentiles: a bootstrap over the requests of the single run ("single run:
  interval from requests"); otherwise, for KV in use (deterministic up to the engine's rounding): the
  two values as they are; otherwise the metric is not compared (run with ``--repeats 2`` or more).
- **Verdict**: a regression only when the whole interval lies beyond the tolerance on the worse side.
- **Exit code**: 1 when any regression was found; 2 when nothing could be compared (no cell matched, or
  every match was set aside); 0 otherwise. Bad input (not a run, bad tolerances file) is 2 as well.
"""
from __future__ import annotations

import math
import tomllib
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench import stats
from kvbench.cells import load_label
from kvbench.metrics import RequestTimes
from kvbench.results import CELL_CONFIG_FIELDS, OK_STATUSES, load, not_a_run_dir
from kvbench.units import fmt_bytes

JSON_SCHEMA = "kvbench.compare/1"
DEFAULT_TOLERANCES = Path(__file__).with_name("compare_tolerances.toml")
DEFAULT_MATCH = tuple(f for f in CELL_CONFIG_FIELDS if f != "engine_version")


class CompareError(Exception):
    """Bad input: the command exits 2."""


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_worse: bool
    unit: str  # "s", "1/s" (rate), "B"
    requests: str | None = None  # per-request samples for a single-run interval: ttft_s, itl, tpot_s, e2e_s
    percentile: float | None = None
    deterministic: bool = False  # one value per side may be compared as it is


def _latency(name: str) -> Metric:
    base, _, pct = name.rpartition("_p")
    source = {"itl_s": "itl"}.get(base, base)
    return Metric(name, True, "s", source, float(pct))


METRICS: dict[str, Metric] = {m.name: m for m in [
    *(_latency(n) for n in ("ttft_s_p50", "ttft_s_p90", "ttft_s_p99", "itl_s_p50", "itl_s_p90", "itl_s_p99",
                            "tpot_s_p50", "tpot_s_p90", "tpot_s_p99", "e2e_s_p50", "e2e_s_p90", "e2e_s_p99")),
    *(Metric(n, True, "s") for n in ("ttft_s_mean", "itl_s_mean", "tpot_s_mean", "e2e_s_mean")),
    *(Metric(n, False, "1/s") for n in ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s",
                                        "goodput_requests_per_s")),
    Metric("kv_in_use_peak_bytes", True, "B", deterministic=True),
    Metric("kv_pool_bytes_engine", True, "B", deterministic=True),
    Metric("rss_peak_bytes", True, "B"),
    Metric("gpu_process_peak_bytes", True, "B"),
    Metric("gpu_device_peak_bytes", True, "B"),
]}


@dataclass
class CompareConfig:
    tolerances: dict[str, float]
    confidence: float = 0.95
    match_on: tuple[str, ...] = DEFAULT_MATCH


def load_config(path: Path | None = None, match_on: list[str] | None = None) -> CompareConfig:
    """The default tolerances, with ``path``'s keys laid over them; ``match_on`` overrides the file's."""
    def read(p: Path) -> dict:
        try:
            return tomllib.loads(Path(p).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise CompareError(f"tolerances file {p}: {exc}") from None

    data = read(DEFAULT_TOLERANCES)
    tolerances = dict(data.get("tolerance", {}))
    confidence = data.get("confidence", 0.95)
    fields = None
    if path is not None:
        user = read(path)
        unknown = set(user) - {"tolerance", "confidence", "match"}
        if unknown:
            raise CompareError(f"tolerances file {path}: unknown key(s) {', '.join(sorted(unknown))} "
                               "(allowed: confidence, [tolerance], [match])")
        tolerances.update(user.get("tolerance", {}))
        confidence = user.get("confidence", confidence)
        fields = user.get("match", {}).get("fields")
    bad = [k for k in tolerances if k not in METRICS]
    if bad:
        raise CompareError(f"unknown metric(s) in the tolerances: {', '.join(bad)} (known: {', '.join(METRICS)})")
    for k, v in tolerances.items():
        if v is not False and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise CompareError(f"tolerance of {k} must be a number >= 0 (0.05 = 5 %) or false, not {v!r}")
    if not 0 < confidence < 1:
        raise CompareError(f"confidence must be between 0 and 1, not {confidence}")
    fields = match_on or fields or list(DEFAULT_MATCH)
    unknown = [f for f in fields if f not in CELL_CONFIG_FIELDS and f not in ("backend", "token_contract", "attached")]
    if unknown:
        raise CompareError(f"unknown match field(s) {', '.join(unknown)} (known: {', '.join(CELL_CONFIG_FIELDS)})")
    return CompareConfig({k: float(v) for k, v in tolerances.items() if v is not False}, float(confidence),
                         tuple(fields))


# --- the two sides ---------------------------------------------------------------------------------------

@dataclass
class Side:
    name: str  # "baseline" / "candidate"
    cells: pd.DataFrame
    requests: pd.DataFrame
    runs: list[str] = field(default_factory=list)
    backend: str | None = None
    _samples: dict = field(default_factory=dict, repr=False)  # (cells, source) -> per-request samples
    _ok_by_cell: dict | None = field(default=None, repr=False)  # (run_id, cell_id, repeat) -> ok requests

    def ok_requests(self, keys) -> pd.DataFrame:
        """The measured requests (not warm-ups) of these (run_id, cell_id, repeat) cells that met the token
        contract."""
        if self._ok_by_cell is None:
            r = self.requests
            counted = r.counted.to_numpy(dtype=bool)
            ok = r[r.ok.to_numpy(dtype=bool) & counted] if not r.empty else r
            self._ok_by_cell = {k: g for k, g in ok.groupby(["run_id", "cell_id", "repeat"], sort=False)}
        parts = [self._ok_by_cell[k] for k in keys if k in self._ok_by_cell]
        return pd.concat(parts) if parts else self.requests.iloc[0:0]


def load_side(name: str, run_dirs: list[Path], backend: str | None = None) -> Side:
    for d in run_dirs:
        if problem := not_a_run_dir(d):
            raise CompareError(problem)
    cells = load(run_dirs, what="cells")
    if backend is not None:
        if backend not in set(cells.backend):
            raise CompareError(f"{name}: no backend {backend!r} in {', '.join(map(str, run_dirs))} "
                               f"(there: {', '.join(sorted(set(cells.backend))) or 'no cells'})")
        cells = cells[cells.backend == backend]
    requests = load(run_dirs, what="requests")
    return Side(name, cells.reset_index(drop=True), requests, [str(d) for d in run_dirs], backend)


def _norm(v):
    """A key value as plain JSON (NaN and None alike)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def _groups(side: Side, fields: tuple[str, ...]) -> dict[tuple, pd.DataFrame]:
    out: dict[tuple, list[int]] = {}
    for i, row in side.cells.iterrows():
        out.setdefault(tuple(_norm(row[f]) for f in fields), []).append(i)
    groups = {k: side.cells.loc[idx] for k, idx in out.items()}
    for key, g in groups.items():
        if g.backend.nunique() > 1:
            raise CompareError(
                f"the {side.name} holds several backends for one cell ({', '.join(sorted(set(g.backend)))} at "
                f"{dict(zip(fields, key))}): pick one with --{side.name}-backend")
    return groups


def _samples(side: Side, rows: pd.DataFrame, source: str) -> list[float]:
    """The per-request samples of a metric over the requests of these cells that met the token contract
    (ITL: kvbench.metrics' per-gap samples), worked out once per cell and source."""
    keys = tuple(sorted(set(zip(rows.run_id, rows.cell_id, rows.repeat))))
    if (keys, source) not in side._samples:
        mine = side.ok_requests(keys)
        if source != "itl":
            samples = [float(v) for v in mine[source] if v is not None and not pd.isna(v)]
        else:
            samples = [gap for times, tokens in zip(mine.chunk_times, mine.chunk_tokens)
                       for gap in RequestTimes(0.0, tuple(times), tuple(tokens)).itl_samples()]
        side._samples[(keys, source)] = samples
    return side._samples[(keys, source)]


def _interval(metric: Metric, b_rows, c_rows, baseline: Side, candidate: Side, confidence: float, seed: int):
    """(interval or None, note)."""
    vb = [float(v) for v in b_rows[metric.name] if not pd.isna(v)]
    vc = [float(v) for v in c_rows[metric.name] if not pd.isna(v)]
    if not vb or not vc:
        return None, "not measured on " + ("either side" if not vb and not vc else
                                           "the baseline" if not vb else "the candidate")
    if np.mean(vb) == 0:
        return None, "baseline is 0: no relative change"
    if len(vb) >= 2 and len(vc) >= 2:
        return stats.welch_relative_change(vb, vc, confidence), ""
    if metric.requests:
        sb = _samples(baseline, b_rows, metric.requests)
        sc = _samples(candidate, c_rows, metric.requests)
        try:
            return stats.bootstrap_relative_change(sb, sc, stats.percentile_stat(metric.percentile), confidence,
                                                   seed=seed), ""
        except ValueError:
            return None, (f"one repeat and {min(len(sb), len(sc))} request samples on the smaller side: too few for "
                          f"an interval (>= {stats.MIN_BOOTSTRAP_SAMPLES}); run with --repeats 2 or more")
    if metric.deterministic:
        change = np.mean(vc) / np.mean(vb) - 1
        return stats.Interval(change, change, change, "one value per side: deterministic metric, compared as is",
                              len(vb), len(vc), confidence), ""
    return None, "one repeat per side: no interval (run with --repeats 2 or more)"


def compare(baseline: Side, candidate: Side, config: CompareConfig) -> dict:
    """Everything ``kvbench compare`` reports, as one JSON-ready dict (schema ``kvbench.compare/1``)."""
    fields = config.match_on
    gb, gc = _groups(baseline, fields), _groups(candidate, fields)
    result = {"schema": JSON_SCHEMA, "match_on": list(fields), "confidence": config.confidence,
              "tolerances": config.tolerances,
              "baseline": {"runs": baseline.runs, "backend": baseline.backend,
                           "backends": sorted(set(baseline.cells.backend))},
              "candidate": {"runs": candidate.runs, "backend": candidate.backend,
                            "backends": sorted(set(candidate.cells.backend))},
              "cells": [], "only_in_baseline": [], "only_in_candidate": [], "contract_mismatch": [], "failed": []}

    def ident(key, rows_b=None, rows_c=None) -> dict:
        out = {"key": dict(zip(fields, key))}
        if rows_b is not None:
            out["baseline_backend"] = rows_b.backend.iloc[0]
        if rows_c is not None:
            out["candidate_backend"] = rows_c.backend.iloc[0]
        return out

    order = list(gb) + [k for k in gc if k not in gb]
    for key in order:
        rb, rc = gb.get(key), gc.get(key)
        if rc is None:
            result["only_in_baseline"].append(ident(key, rb))
            continue
        if rb is None:
            result["only_in_candidate"].append(ident(key, rows_c=rc))
            continue
        ub, uc = rb[rb.status.isin(OK_STATUSES)], rc[rc.status.isin(OK_STATUSES)]
        if ub.empty or uc.empty:
            side = "both" if ub.empty and uc.empty else "baseline" if ub.empty else "candidate"
            errors = [e for e in pd.concat([rb, rc]).error if isinstance(e, str) and e]
            result["failed"].append({**ident(key, rb, rc), "failed_on": side, "errors": errors[:3],
                                     "regression": side == "candidate"})
            continue
        contracts_b, contracts_c = sorted(set(ub.token_contract)), sorted(set(uc.token_contract))
        if contracts_b != contracts_c:
            result["contract_mismatch"].append({**ident(key, rb, rc), "baseline_contract": contracts_b,
                                                "candidate_contract": contracts_c})
            continue
        metrics = []
        for name, tol in config.tolerances.items():
            metric = METRICS[name]
            seed = zlib.crc32(repr((key, name)).encode())
            interval, note = _interval(metric, ub, uc, baseline, candidate, config.confidence, seed)
            verdict = stats.decide(interval, tol, metric.higher_is_worse)
            vb, vc = ub[name].dropna(), uc[name].dropna()
            metrics.append({
                "metric": name, "unit": metric.unit, "worse": "higher" if metric.higher_is_worse else "lower",
                "tolerance": tol, "baseline": float(vb.mean()) if len(vb) else None,
                "candidate": float(vc.mean()) if len(vc) else None,
                "change": interval.change if interval else None, "ci_low": interval.low if interval else None,
                "ci_high": interval.high if interval else None, "method": interval.method if interval else None,
                "n_baseline": interval.n_baseline if interval else len(vb),
                "n_candidate": interval.n_candidate if interval else len(vc),
                "verdict": verdict, "note": note})
        result["cells"].append({**ident(key, rb, rc), "repeats": [len(ub), len(uc)],
                                "token_contract": contracts_b, "metrics": metrics})

    verdicts = [m["verdict"] for c in result["cells"] for m in c["metrics"]]
    failed_candidate = sum(f["regression"] for f in result["failed"])
    summary = {"compared_cells": len(result["cells"]),
               **{v.replace(" ", "_"): verdicts.count(v) for v in
                  ("regression", "improvement", "unchanged", "inconclusive", "not compared")},
               "failed_on_candidate": failed_candidate,
               "only_in_baseline": len(result["only_in_baseline"]),
               "only_in_candidate": len(result["only_in_candidate"]),
               "contract_mismatch": len(result["contract_mismatch"])}
    result["summary"] = summary
    result["regression_found"] = bool(summary["regression"] or failed_candidate)
    result["exit_code"] = 1 if result["regression_found"] else 2 if not result["cells"] else 0
    return result


# --- as a table ------------------------------------------------------------------------------------------

def _fmt_value(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "B":
        return fmt_bytes(v)
    if unit == "s":
        return f"{v:,.4f} s"
    return f"{v:,.3f}/s"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _where(key: dict) -> str:
    parts = [f"{key.get('engine', '')}"]
    if key.get("variant"):
        parts.append(key["variant"])
    if "prompt_tokens" in key:
        parts.append(f"p{key['prompt_tokens']}")
    parts.append(load_label(key.get("load_profile", "concurrent"), key.get("concurrency"), key.get("request_rate")))
    return " ".join(str(p) for p in parts if p != "")


def results_frame(result: dict) -> pd.DataFrame:
    """One row per (cell, metric): the table ``kvbench compare`` prints."""
    rows = []
    for c in result["cells"]:
        for m in c["metrics"]:
            rows.append({
                "cell": _where(c["key"]),
                "backends": f"{c['baseline_backend']} -> {c['candidate_backend']}",
                "metric": m["metric"], "baseline": _fmt_value(m["baseline"], m["unit"]),
                "candidate": _fmt_value(m["candidate"], m["unit"]), "change": _pct(m["change"]),
                f"{result['confidence']:.0%} CI": "-" if m["ci_low"] is None else
                f"[{_pct(m['ci_low'])}, {_pct(m['ci_high'])}]",
                "tolerance": f"{m['tolerance']:.0%}" if m["tolerance"] * 100 == round(m["tolerance"] * 100)
                else f"{m['tolerance']:.1%}",
                "verdict": m["verdict"].upper() if m["verdict"] == "regression" else m["verdict"],
                "how": m["method"] or m["note"]})
    return pd.DataFrame(rows)


def markdown(result: dict) -> str:
    from kvbench.reports.tables import md_table

    ci = f"{result['confidence']:.0%} CI"
    out = [f"# kvbench compare: {', '.join(result['baseline']['runs'])}"
           + (f" [{result['baseline']['backend']}]" if result['baseline']['backend'] else "")
           + f" -> {', '.join(result['candidate']['runs'])}"
           + (f" [{result['candidate']['backend']}]" if result['candidate']['backend'] else ""),
           f"Cells matched on: {', '.join(result['match_on'])}. Change = candidate / baseline - 1; a regression "
           f"only when the whole {ci} lies beyond the tolerance on the worse side."]
    frame = results_frame(result)
    if not frame.empty:
        out.append(md_table(frame, {"baseline", "candidate", "change", ci, "tolerance"}))
    for title, items, fmt in (
            ("Failed cells (on the candidate: counted as regressions)", result["failed"],
             lambda f: f"{_where(f['key'])}: failed on the {f['failed_on']}"
                       + (f" ({f['errors'][0]})" if f["errors"] else "")),
            ("Different token contracts (not compared)", result["contract_mismatch"],
             lambda f: f"{_where(f['key'])}: baseline {f['baseline_contract'] or ['not recorded']}, "
                       f"candidate {f['candidate_contract'] or ['not recorded']}"),
            ("Only in the baseline (not compared)", result["only_in_baseline"],
             lambda f: f"{_where(f['key'])} ({f['baseline_backend']})"),
            ("Only in the candidate (not compared)", result["only_in_candidate"],
             lambda f: f"{_where(f['key'])} ({f['candidate_backend']})")):
        if items:
            out.append(f"## {title}\n\n" + "\n".join(f"- {fmt(i)}" for i in items))
    s = result["summary"]
    verdict = ("REGRESSION" if result["regression_found"] else
               "nothing to compare" if result["exit_code"] == 2 else "no regression")
    out.append(f"**{verdict}**: {s['compared_cells']} cells compared; {s['regression']} regressions, "
               f"{s['improvement']} improvements, {s['unchanged']} unchanged, {s['inconclusive']} inconclusive, "
               f"{s['not_compared']} not compared; {s['failed_on_candidate']} failed on the candidate; "
               f"{s['only_in_baseline']} only in the baseline, {s['only_in_candidate']} only in the candidate, "
               f"{s['contract_mismatch']} with different token contracts.")
    return "\n\n".join(out) + "\n"
