"""``kvbench compare``: the cells of a baseline and a candidate matched by configuration, and every headline
metric's change with a confidence interval, judged against a tolerance.

- **Matching**: two cells are the same measurement when they agree on the match fields (default:
  :data:`bench.results.CELL_CONFIG_FIELDS` minus ``engine_version``, the thing being upgraded; configurable
  with ``[match] fields`` in the tolerances file or ``--match-on``). The repeats of a cell (``repeat``)
  are its samples. A cell on one side only, or whose ``token_contract`` differs between the sides, is
  listed and not compared. A cell that failed on the candidate but ran on the baseline counts as a
  regression; one that failed on the baseline only is listed.
- **Intervals** (``bench/common/stats.py``, all on the log of the ratio, so none crosses -100 %): >= 2 repeats per
  side: a Welch t-interval; **paired** when both sides hold the same repeat indices of one run, or of
  runs that record ``interleaved: true`` in run.json (``kvbench run --interleave``: baseline and
  candidate repeats alternate, so a drift of the machine hits both); otherwise, for latency percentiles:
  a bootstrap over the requests of the single run ("single run: interval from requests", not run-to-run
  noise); otherwise, for KV in use (deterministic up to the engine's rounding): the two values as they
  are; otherwise the metric is not compared (run with ``--repeats 2`` or more). From the repeats'
  noise, each metric says how many repeats its tolerance needs here (:func:`kvbench.common.stats.repeats_needed`).
- **Verdict** per metric: a regression only when the whole interval lies beyond the tolerance on the worse
  side, an improvement beyond it on the better side, unchanged within it; inconclusive when the interval
  is wider than the tolerance allows (or one repeat per side gave no interval). The comparison's verdict:
  REGRESSION over inconclusive over improvement over unchanged (inconclusive is no evidence, not a pass),
  with how many repeats would settle the inconclusive metrics at the noise seen.
- **Checks**: comparing a run (and backend) with itself is bad input; the same engine version on both
  sides (as the engines reported it: ``engine_version_reported``) is warned about, and so is a side whose
  engine reported none ("unknown"); runs from different hardware (CPU model, its AVX-512/AMX flags, cores,
  GPUs: :func:`kvbench.common.hardware.hardware_differences`) are refused unless
  ``allow_different_hardware``, then loudly warned about; a different GPU driver is warned about.
- **Exit code** (:data:`kvbench.compare.verdict.EXIT_CODES`): 0 unchanged; 1 a regression (or a cell that failed only on the
  candidate); 3 inconclusive; 4 improvement; 2 bad input: unreadable runs, a bad tolerances file, a
  self-comparison, different hardware, or nothing comparable (no cell matched, or every match was set
  aside). ``pass_unless_regression`` (``--pass-unless-regression``) makes 3 and 4 exit 0: a gate that asks
  only for no evidence of a regression.

Long because matching, the intervals and the checks of a pair of sides (hardware, engine versions, models)
all read the same :class:`Side` objects of one comparison.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.common import stats
from kvbench.common.hardware import driver_differences, hardware_differences, hardware_line
from kvbench.common.metrics import RequestTimes
from kvbench.compare.verdict import EXIT_CODES, overall_verdict, settle_summary
from kvbench.kv import bounded
from kvbench.run.prefix_cache import cache_state, cold_cells_that_hit
from kvbench.store.readers import load, load_run_info, not_a_run_dir
from kvbench.store.schema import CELL_CONFIG_FIELDS, OK_STATUSES

JSON_SCHEMA = "kvbench.compare/3"
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
    only_where_measured: bool = False  # left out of a cell neither side measured (a figure few runs have)
    # compared only where both sides sent the same prompt tokens (one prompt salt): a drafter's acceptance
    # depends on the very tokens, and each run's own salt changes them
    same_prompts: bool = False


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
    # a drafter's acceptance (bench/run/speculation.py): greedy decoding of the same prompts accepts the same
    # drafts, so one value per side is compared as it is; a drop is a regression
    Metric("spec_acceptance_rate", False, "share", deterministic=True, only_where_measured=True, same_prompts=True),
    # the decode bound over the median ITL (bench/run/decode_bound.py): lower is worse; runs before schema 10
    # and GPU runs have none
    Metric("decode_efficiency", False, "share", only_where_measured=True),
]}


def prompt_salts(baseline: Side, candidate: Side) -> str:
    """The two sides' prompt salts where they differ ("" where both sent the same prompt tokens)."""
    def salts(side: Side) -> set:
        return {(info.get("prompt_salt") or {}).get("value") if isinstance(info.get("prompt_salt"), dict)
                else info.get("prompt_salt") for info in side.infos}
    b, c = salts(baseline), salts(candidate)
    return "" if b == c and len(b) == 1 else f"{sorted(map(str, b))} and {sorted(map(str, c))}"


def not_compared(name: str, metric: Metric, tol: float, vb: pd.Series, vc: pd.Series, why: str) -> dict:
    return {"metric": name, "unit": metric.unit, "worse": "higher" if metric.higher_is_worse else "lower",
            "tolerance": tol, "baseline": _center(vb), "candidate": _center(vc), "change": None, "ci_low": None,
            "ci_high": None, "method": None, "n_baseline": len(vb), "n_candidate": len(vc), "verdict": "not compared",
            "note": why, "paired": False, "noise_log_sd": None, "repeats_needed": None, "repeats_to_settle": None}


@dataclass
class CompareConfig:
    tolerances: dict[str, float]
    confidence: float = 0.95
    match_on: tuple[str, ...] = DEFAULT_MATCH


def load_config(path: Path | None = None, match_on: list[str] | None = None) -> CompareConfig:
    """The default tolerances, with ``path``'s keys laid over them; ``match_on`` overrides the file's."""
    def read(p: Path) -> dict:
        try:  # a regular file, bounded (kvbench.kv.bounded)
            return bounded.read_toml(p, what="tolerances file")
        except bounded.InputError as exc:
            raise CompareError(str(exc)) from None
        except OSError as exc:
            raise CompareError(f"tolerances file {p}: {exc.strerror or exc}") from None

    data = read(DEFAULT_TOLERANCES)
    tolerances = dict(data.get("tolerance", {}))
    confidence = data.get("confidence", 0.95)
    fields = None
    if path is not None:
        user = read(path)
        if not isinstance(user.get("tolerance", {}), dict) or not isinstance(user.get("match", {}), dict):
            raise CompareError(f"tolerances file {path}: [tolerance] and [match] must be tables")
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
        if v is not False and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            raise CompareError(f"tolerance of {k} must be a finite number >= 0 (0.05 = 5 %) or false, not {v!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise CompareError(f"confidence must be between 0 and 1, not {confidence}")
    if fields is not None and (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)):
        raise CompareError(f"tolerances file {path}: [match] fields must be a list of field names, not {fields!r}")
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
    infos: list[dict] = field(default_factory=list)  # each run's run.json
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
    # a deployment is compared by its total rows; its rows per replica (a part of the same cell) stay out
    if "replica" in cells:
        cells = cells[cells.replica.fillna("") == ""]
    if backend is not None:
        if backend not in set(cells.backend):
            raise CompareError(f"{name}: no backend {backend!r} in {', '.join(map(str, run_dirs))} "
                               f"(there: {', '.join(sorted(set(cells.backend))) or 'no cells'})")
        cells = cells[cells.backend == backend]
    requests = load(run_dirs, what="requests")
    try:
        infos = [load_run_info(d) for d in run_dirs]
    except (OSError, ValueError) as exc:
        raise CompareError(f"{name}: run.json unreadable: {exc}") from None
    return Side(name, cells.reset_index(drop=True), requests, [str(d) for d in run_dirs], backend, infos)


@dataclass(frozen=True)
class Interleaving:
    """Whether the repeats of the two sides may be paired by index: the same run, or runs that recorded an
    interleaved A/B order."""

    pairable: bool
    why: str


def interleaving(baseline: Side, candidate: Side) -> Interleaving:
    same_run = [Path(r).resolve() for r in baseline.runs] == [Path(r).resolve() for r in candidate.runs]
    interleaved = all(i.get("interleaved") for i in baseline.infos + candidate.infos) and \
        bool(baseline.infos and candidate.infos)
    if interleaved:
        return Interleaving(True, "interleaved run (run.json: interleaved)")
    if same_run:
        return Interleaving(True, "one run: repeats paired by index")
    return Interleaving(False, "separate runs: repeats not paired")


def _norm(v):
    """A key value as plain JSON (NaN and None alike)."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
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
    (ITL: kvbench.common.metrics' per-gap samples), worked out once per cell and source."""
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


def _values(rows: pd.DataFrame, name: str) -> list[tuple[int, float]]:
    """(repeat, the metric's value) of the rows that measured it."""
    return [(int(r), float(v)) for r, v in zip(rows["repeat"], rows[name]) if not pd.isna(v)]


def _pairs(vb: list[tuple[int, float]], vc: list[tuple[int, float]]):
    """The values as pairs by repeat index ([b], [c]), or None when the sides do not pair up: a repeat index
    twice on a side (several runs), or not the same repeats measured on both sides."""
    db, dc = dict(vb), dict(vc)
    if len(db) != len(vb) or len(dc) != len(vc) or set(db) != set(dc):
        return None
    keys = sorted(db)
    return [db[k] for k in keys], [dc[k] for k in keys]


def _noise(b: list[float], c: list[float], paired: bool) -> float | None:
    """The sd of one repeat's log value (pooled over the sides), or of one pair's log ratio when paired."""
    lb, lc = np.log(b), np.log(c)
    if paired:
        return float(np.std(lc - lb, ddof=1)) if lb.size >= 2 else None
    if lb.size < 2 or lc.size < 2:
        return None
    return float(math.sqrt(((lb.size - 1) * lb.var(ddof=1) + (lc.size - 1) * lc.var(ddof=1))
                           / (lb.size + lc.size - 2)))


def _interval(metric: Metric, b_rows, c_rows, baseline: Side, candidate: Side, confidence: float, seed: int,
              pairable: bool = False):
    """(interval or None, note, noise: the log-scale sd of a repeat or pair or None, paired)."""
    vb, vc = _values(b_rows, metric.name), _values(c_rows, metric.name)
    b, c = [v for _, v in vb], [v for _, v in vc]
    if not b or not c:
        return None, "not measured on " + ("either side" if not b and not c else
                                           "the baseline" if not b else "the candidate"), None, False
    if metric.deterministic and min(b) > 0 and max(c) == 0:  # a drafter none of whose drafts were accepted
        return stats.Interval(-1.0, -1.0, -1.0, "the candidate's values are all 0: -100 %", len(b), len(c),
                              confidence), "", None, False
    if min(b) <= 0 or min(c) <= 0:
        return None, "a value is 0: no relative change", None, False
    if len(b) >= 2 and len(c) >= 2:
        pairs = _pairs(vb, vc) if pairable else None
        if pairs is not None:
            b, c = pairs
            interval = stats.paired_relative_change(b, c, confidence)
        else:
            interval = stats.welch_relative_change(b, c, confidence)
        return interval, "", _noise(b, c, pairs is not None), pairs is not None
    if metric.requests:
        sb = _samples(baseline, b_rows, metric.requests)
        sc = _samples(candidate, c_rows, metric.requests)
        try:
            return stats.bootstrap_relative_change(sb, sc, stats.percentile_stat(metric.percentile), confidence,
                                                   seed=seed), "", None, False
        except ValueError as exc:
            if min(len(sb), len(sc)) >= stats.MIN_BOOTSTRAP_SAMPLES:
                return None, f"{exc}; run with --repeats 2 or more", None, False
            return None, (f"one repeat and {min(len(sb), len(sc))} request samples on the smaller side: too few for "
                          f"an interval (>= {stats.MIN_BOOTSTRAP_SAMPLES}); run with --repeats 2 or more"), None, False
    if metric.deterministic:
        change = float(np.mean(c) / np.mean(b) - 1)
        return stats.Interval(change, change, change, "one value per side: deterministic metric, compared as is",
                              len(b), len(c), confidence), "", None, False
    return None, "one repeat per side: no interval (run with --repeats 2 or more)", None, False


UNKNOWN_VERSION = "unknown"


def reported_versions(side: Side) -> set[str]:
    """The versions the side's engines reported (``engine_version_reported``), "unknown" where an engine
    reported none: the label's version of an attached server is only what the user called it."""
    if side.cells.empty:
        return set()
    return {v if isinstance(v, str) and v else UNKNOWN_VERSION for v in side.cells.engine_version_reported}


def checks(baseline: Side, candidate: Side, allow_different_hardware: bool = False) -> list[str]:
    """Warnings about the pair of sides (printed before everything else); CompareError where the pair is
    bad input: a run compared with itself, or runs from different hardware (unless allowed)."""
    warnings = []
    ids_b = sorted(i.get("run_id") or "" for i in baseline.infos)
    same_runs = [Path(r).resolve() for r in baseline.runs] == [Path(r).resolve() for r in candidate.runs] or \
        (all(ids_b) and ids_b == sorted(i.get("run_id") or "" for i in candidate.infos))  # a copy of the run
    if same_runs and (baseline.backend == candidate.backend or
                      set(baseline.cells.backend) == set(candidate.cells.backend)):
        raise CompareError(
            f"SELF-COMPARISON: the baseline and the candidate are the same run{'s' if len(baseline.runs) > 1 else ''} "
            f"({', '.join(baseline.runs)}) and the same backends: every change would be 0 and the verdict "
            "meaningless. Give two runs, or one run with --baseline-backend and --candidate-backend")
    versions_b, versions_c = reported_versions(baseline), reported_versions(candidate)
    if UNKNOWN_VERSION in versions_b | versions_c:
        sides = " and ".join(s.name for s, v in ((baseline, versions_b), (candidate, versions_c)) if UNKNOWN_VERSION in v)
        warnings.append(f"ENGINE VERSION UNKNOWN on the {sides}: the engine reported no version, so whether the "
                        f"engine changed is unknown (baseline: {', '.join(sorted(versions_b)) or '-'}; candidate: "
                        f"{', '.join(sorted(versions_c)) or '-'})")
    elif versions_b and versions_b == versions_c:
        warnings.append(f"SAME ENGINE VERSION: both sides ran {', '.join(sorted(versions_b))}: the changes below "
                        "are run-to-run noise (or a change other than the engine: driver, settings, machine)")
    envs_b = [i.get("environment") or {} for i in baseline.infos]
    envs_c = [i.get("environment") or {} for i in candidate.infos]
    diffs = sorted({d for eb in envs_b for ec in envs_c for d in hardware_differences(eb, ec)})
    if diffs:
        text = (f"DIFFERENT HARDWARE: the baseline ran on {hardware_line(envs_b[0])}; the candidate on "
                f"{hardware_line(envs_c[0])} ({'; '.join(diffs)}). A change of machine moves every figure (an AVX2-"
                "only CPU ran bf16 prefill 10x slower than one with AVX-512)")
        if not allow_different_hardware:
            raise CompareError(text + ": refused; rerun both on one machine, or pass --allow-different-hardware")
        warnings.append(text + ": compared anyway (--allow-different-hardware)")
    drivers = sorted({d for eb in envs_b for ec in envs_c for d in driver_differences(eb, ec)})
    if drivers:
        warnings.append(f"DIFFERENT GPU DRIVER ({'; '.join(drivers)}): the changes below include the driver's")
    return warnings


def _models(side: Side) -> dict[str, set[str]]:
    """{model name: the sha256 of its files} of a side, from its cells and each run's run.json."""
    out: dict[str, set[str]] = {str(m): set() for m in side.cells.get("model", pd.Series(dtype=object)).dropna()}
    for info in side.infos:
        model = info.get("model") or {}
        if model.get("name"):
            out.setdefault(model["name"], set()).update([model["sha256"]] if model.get("sha256") else [])
    return out


def _model_text(models: dict[str, set[str]]) -> str:
    return ", ".join(f"{name} (sha256 {', '.join(s[:12] + '...' for s in sorted(sums)) or 'not recorded'})"
                     for name, sums in sorted(models.items())) or "no model"


def model_checks(baseline: Side, candidate: Side, matched_on_model: bool) -> list[str]:
    """CompareError when the sides ran different models and cells are matched on the model (nothing could
    match: say which models instead of "nothing to compare"); a warning when one model name stands for other
    files on the two sides (another sha256: the model changed, not only the engine)."""
    mb, mc = _models(baseline), _models(candidate)
    if mb and mc and not set(mb) & set(mc) and matched_on_model:
        raise CompareError(f"DIFFERENT MODELS: the baseline ran {_model_text(mb)}, the candidate "
                           f"{_model_text(mc)}: no cell can match (match on other fields with --match-on to "
                           f"compare them anyway)")
    warnings = []
    for name in sorted(set(mb) & set(mc)):
        if mb[name] and mc[name] and mb[name] != mc[name]:
            warnings.append(f"SAME MODEL NAME, OTHER FILES: {name} is sha256 {', '.join(sorted(mb[name]))} in the "
                            f"baseline and {', '.join(sorted(mc[name]))} in the candidate: the changes below "
                            f"include the model's")
    return warnings


def compare(baseline: Side, candidate: Side, config: CompareConfig, allow_different_hardware: bool = False,
            pass_unless_regression: bool = False, allow_cache_mismatch: bool = False) -> dict:
    """Everything ``kvbench compare`` reports, as one JSON-ready dict (schema ``kvbench.compare/3``).
    Raises CompareError for bad input (a self-comparison, different hardware unless allowed)."""
    fields = config.match_on
    warnings = checks(baseline, candidate, allow_different_hardware)
    warnings += model_checks(baseline, candidate, "model" in fields)
    pairing = interleaving(baseline, candidate)
    gb, gc = _groups(baseline, fields), _groups(candidate, fields)
    result = {"schema": JSON_SCHEMA, "warnings": warnings, "pairing": pairing.why,
              "match_on": list(fields), "confidence": config.confidence,
              "tolerances": config.tolerances,
              "baseline": {"runs": baseline.runs, "backend": baseline.backend,
                           "backends": sorted(set(baseline.cells.backend))},
              "candidate": {"runs": candidate.runs, "backend": candidate.backend,
                            "backends": sorted(set(candidate.cells.backend))},
              "cells": [], "only_in_baseline": [], "only_in_candidate": [], "contract_mismatch": [],
              "cache_mismatch": [], "failed": []}

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
        # a cell served from the prefix cache against one that was not measures the cache, not the engine
        cache_b, cache_c = cache_state(ub), cache_state(uc)
        if {cache_b, cache_c} == {"warm", "cold"}:
            mismatch = {**ident(key, rb, rc), "baseline_cache": cache_b, "candidate_cache": cache_c,
                        "compared": allow_cache_mismatch}
            result["cache_mismatch"].append(mismatch)
            if not allow_cache_mismatch:
                continue
        metrics = []
        for name, tol in config.tolerances.items():
            metric = METRICS[name]
            if metric.only_where_measured and ub[name].isna().all() and uc[name].isna().all():
                continue
            if metric.same_prompts and (salts := prompt_salts(baseline, candidate)):
                metrics.append(not_compared(name, metric, tol, ub[name].dropna(), uc[name].dropna(),
                                            f"other prompts: prompt salts {salts} (kvbench run --prompt-salt: one "
                                            "salt on both sides)"))
                continue
            seed = zlib.crc32(repr((key, name)).encode())
            interval, note, noise, paired = _interval(metric, ub, uc, baseline, candidate, config.confidence, seed,
                                                      pairing.pairable)
            verdict = stats.decide(interval, tol, metric.higher_is_worse)
            vb, vc = ub[name].dropna(), uc[name].dropna()
            if interval is None and not vb.empty and not vc.empty and min(vb.min(), vc.min()) > 0:
                verdict = "inconclusive"  # measured on both sides, but too few repeats for an interval
            metrics.append({
                "metric": name, "unit": metric.unit, "worse": "higher" if metric.higher_is_worse else "lower",
                "tolerance": tol, "baseline": _center(vb), "candidate": _center(vc),
                "change": interval.change if interval else None, "ci_low": interval.low if interval else None,
                "ci_high": interval.high if interval else None, "method": interval.method if interval else None,
                "n_baseline": interval.n_baseline if interval else len(vb),
                "n_candidate": interval.n_candidate if interval else len(vc),
                "verdict": verdict, "note": note, "paired": paired, "noise_log_sd": noise,
                "repeats_needed": stats.repeats_needed(noise, tol, config.confidence, paired)
                if noise is not None else None, "repeats_to_settle": None})
        result["cells"].append({**ident(key, rb, rc), "repeats": [len(ub), len(uc)],
                                "token_contract": contracts_b, "prefix_cache": [cache_b, cache_c],
                                "metrics": metrics})

    verdicts = [m["verdict"] for c in result["cells"] for m in c["metrics"]]
    failed_candidate = sum(f["regression"] for f in result["failed"])
    summary = {"compared_cells": len(result["cells"]),
               **{v.replace(" ", "_"): verdicts.count(v) for v in
                  ("regression", "improvement", "unchanged", "inconclusive", "not compared")},
               "failed_on_candidate": failed_candidate,
               "failed_on_baseline": sum(f["failed_on"] != "candidate" for f in result["failed"]),
               "only_in_baseline": len(result["only_in_baseline"]),
               "only_in_candidate": len(result["only_in_candidate"]),
               "contract_mismatch": len(result["contract_mismatch"]),
               "cache_mismatch": len(result["cache_mismatch"])}
    result["summary"] = summary
    for side in (baseline, candidate):
        cold_hit = cold_cells_that_hit(side.cells)
        if cold_hit:
            result["warnings"].append(
                f"PREFIX CACHE: {cold_hit} cell(s) of the {side.name} meant cold were served from the prefix cache "
                "(over 1 % of their prompt tokens; the same prompts sent before? kvbench run --prompt-salt)")
    result["regression_found"] = bool(summary["regression"] or failed_candidate)
    result["verdict"] = overall_verdict(summary)
    result["exit_code"] = EXIT_CODES[result["verdict"]]
    result["gate"] = "no evidence of regression (--pass-unless-regression)" if pass_unless_regression else \
        "every metric settled (unchanged or improved)"
    if pass_unless_regression and result["verdict"] in ("inconclusive", "improvement"):
        result["exit_code"] = 0
    result["settle"] = settle_summary(result, config.confidence)
    result["repeats_needed"] = repeats_needed_summary(result)
    single = [m for c in result["cells"] for m in c["metrics"]
              if m["verdict"] in ("regression", "improvement") and (m["method"] or "").startswith(stats.SINGLE_RUN)]
    if single:
        result["warnings"].append(
            f"SINGLE RUN: {len(single)} regression/improvement verdict(s) rest on one run per side (intervals from "
            "the requests, blind to run-to-run noise: at 7 % run-to-run noise they call an unchanged engine a "
            "regression about 5 % of the time, python -m kvbench.compare.calibration); confirm with --repeats")
    first = ("schema", "verdict", "exit_code", "regression_found", "summary", "settle", "warnings")
    return {**{k: result[k] for k in first}, **{k: v for k, v in result.items() if k not in first}}


def _center(values: pd.Series) -> float | None:
    """A side's value of a metric over its repeats: the geometric mean (what the change is the ratio of)
    when every value is positive, else the mean."""
    arr = np.asarray(values, dtype=float)
    if not arr.size:
        return None
    return float(np.exp(np.log(arr).mean())) if (arr > 0).all() else float(arr.mean())


def repeats_needed_summary(result: dict) -> list[dict]:
    """Per metric, from the noise of its repeats: the repeats per side its tolerance needs here (the
    median cell's and the noisiest cell's), for "5 % on TTFT p50 needs about N repeats here"."""
    by_metric: dict[str, list] = {}
    for c in result["cells"]:
        for m in c["metrics"]:
            if m["noise_log_sd"] is not None:
                by_metric.setdefault(m["metric"], []).append(m)
    out = []
    for name, ms in by_metric.items():
        needed = [m["repeats_needed"] for m in ms]
        known = sorted(n for n in needed if n is not None)
        out.append({"metric": name, "tolerance": ms[0]["tolerance"], "paired": all(m["paired"] for m in ms),
                    "cells": len(ms), "repeats_now": min(min(m["n_baseline"], m["n_candidate"]) for m in ms),
                    "median": known[len(known) // 2] if known else None,
                    "worst": None if len(known) < len(needed) else (known[-1] if known else None)})
    return out
