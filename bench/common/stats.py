"""The statistics of ``kvbench compare``: pure functions of numbers, no files, no pandas.

Every interval is on the **log of the ratio** ``candidate / baseline`` and reported as a relative change
``exp(.) - 1``: the times, rates and bytes compared here are positive and their noise is multiplicative
(a machine that is 10 % busier makes every figure about 10 % slower), so an interval can never reach
-100 % and a halving and a doubling are equally far from "no change". The distributions are scipy's.

- **Repeated runs** (>= 2 repeats on each side): each repeat gives one value of the metric (a cell's
  TTFT p50, its tokens/s, ...). The change is the ratio of the geometric means and its interval a
  **Welch t-interval on the difference of the mean logs** (``scipy.stats.ttest_ind(..., equal_var=False)``):
  it carries the uncertainty of both sides and needs no equal variances.
- **Paired repeats** (the same repeat indices on both sides, run alternately so that a drift of the
  machine hits both alike): the interval is a **t-interval on the mean of the paired log ratios**
  (``scipy.stats.ttest_rel``): what the two sides share cancels in each pair.
- **A single run per side**: the latency percentiles are percentiles over requests, so the requests give
  the samples: a **percentile bootstrap of the log ratio of the two statistics**, each side's requests
  resampled on their own (``scipy.stats.bootstrap``). Its interval says how much the requests of this
  one run vary, not how much a repeat of the run would: it is narrower than the truth when runs differ
  systematically (a warm cache, another job on the machine), and its method says so
  ("single run: interval from requests").

``decide`` turns an interval into a verdict against a tolerance: a regression only when the whole interval
lies beyond the tolerance on the worse side. ``repeats_needed`` says how many repeats a tolerance needs at
the noise observed. ``bench/compare/calibration.py`` measures the coverage, false-regression rate and
power of these intervals on simulated comparisons of known truth.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

Verdict = Literal["regression", "improvement", "unchanged", "inconclusive", "not compared"]
MIN_BOOTSTRAP_SAMPLES = 5  # fewer samples on a side give no bootstrap interval
SINGLE_RUN = "single run: interval from requests"


@dataclass(frozen=True)
class Interval:
    change: float  # candidate / baseline - 1 (point estimate)
    low: float  # confidence interval of the change (> -1 always)
    high: float
    method: str
    n_baseline: int
    n_candidate: int
    confidence: float


def _scipy_stats():
    """scipy.stats, imported when an interval is first computed: importing it took 0.7 s of CPU, paid by every
    process that imports the compare or report modules without computing one (a refused command, a test
    worker collecting the suite)."""
    from scipy import stats

    return stats


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (scipy.stats.t)."""
    if not 0 < p < 1:
        raise ValueError("p must be in (0, 1)")
    return float(_scipy_stats().t.ppf(p, df))


def _clean(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return arr[np.isfinite(arr)]


def _positive_logs(arr: np.ndarray, what: str) -> np.ndarray:
    if (arr <= 0).any():
        raise ValueError(f"a {what} value is <= 0: no relative change on the log scale")
    return np.log(arr)


# --- repeated runs: vectorised over leading axes (the calibration simulates thousands at once) -----------

def welch_log_interval(baseline: np.ndarray, candidate: np.ndarray, confidence: float = 0.95):
    """(change, low, high) of candidate / baseline - 1 from two arrays of positive values, repeats along
    the last axis (any leading axes are independent comparisons): Welch t-interval on mean(log c) -
    mean(log b), exponentiated. Identical repeats on both sides give the point as the interval."""
    lb, lc = np.log(np.asarray(baseline, float)), np.log(np.asarray(candidate, float))
    d = lc.mean(axis=-1) - lb.mean(axis=-1)
    with warnings.catch_warnings():  # identical repeats: scipy warns of its zero variance, the point is the answer
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = _scipy_stats().ttest_ind(lc, lb, axis=-1, equal_var=False).confidence_interval(confidence)
    low, high = np.where(np.isnan(ci.low), d, ci.low), np.where(np.isnan(ci.high), d, ci.high)
    return np.expm1(d), np.expm1(low), np.expm1(high)


def paired_log_interval(baseline: np.ndarray, candidate: np.ndarray, confidence: float = 0.95):
    """(change, low, high) from paired repeats (same index = run side by side): t-interval on the mean of
    log(c_i / b_i) along the last axis, exponentiated."""
    lb, lc = np.log(np.asarray(baseline, float)), np.log(np.asarray(candidate, float))
    d = (lc - lb).mean(axis=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = _scipy_stats().ttest_rel(lc, lb, axis=-1).confidence_interval(confidence)
    low, high = np.where(np.isnan(ci.low), d, ci.low), np.where(np.isnan(ci.high), d, ci.high)
    return np.expm1(d), np.expm1(low), np.expm1(high)


def welch_relative_change(baseline: Sequence[float], candidate: Sequence[float],
                          confidence: float = 0.95) -> Interval:
    """Welch t-interval on the log ratio of the geometric means; >= 2 positive values per side."""
    b, c = _clean(baseline), _clean(candidate)
    if b.size < 2 or c.size < 2:
        raise ValueError("a t-interval needs at least 2 values on each side")
    _positive_logs(b, "baseline"), _positive_logs(c, "candidate")
    change, low, high = welch_log_interval(b, c, confidence)
    return Interval(change=float(change), low=float(low), high=float(high),
                    method=f"Welch t-interval on the log ratio, {b.size} vs {c.size} repeats",
                    n_baseline=int(b.size), n_candidate=int(c.size), confidence=confidence)


def paired_relative_change(baseline: Sequence[float], candidate: Sequence[float],
                           confidence: float = 0.95) -> Interval:
    """t-interval on the mean paired log ratio; ``baseline[i]`` and ``candidate[i]`` are one pair."""
    b, c = np.asarray(baseline, float), np.asarray(candidate, float)
    if b.shape != c.shape or b.ndim != 1:
        raise ValueError("paired samples need one value per pair on each side")
    keep = np.isfinite(b) & np.isfinite(c)
    b, c = b[keep], c[keep]
    if b.size < 2:
        raise ValueError("a paired t-interval needs at least 2 pairs")
    _positive_logs(b, "baseline"), _positive_logs(c, "candidate")
    change, low, high = paired_log_interval(b, c, confidence)
    return Interval(change=float(change), low=float(low), high=float(high),
                    method=f"paired t-interval on the log ratio, {b.size} pairs",
                    n_baseline=int(b.size), n_candidate=int(c.size), confidence=confidence)


def repeats_needed(log_sd: float, tolerance: float, confidence: float = 0.95, paired: bool = False,
                   max_repeats: int = 1000) -> int | None:
    """Repeats per side for the interval of an unchanged metric to be as narrow as the tolerance (half-width
    <= log(1 + tolerance)) at a noise of ``log_sd`` (the standard deviation of one repeat's log value, or
    of one pair's log ratio when ``paired``). None when more than ``max_repeats`` or no tolerance."""
    if tolerance <= 0 or not math.isfinite(log_sd):
        return None
    if log_sd == 0:
        return 2
    return _fewest_repeats(lambda half_width: half_width <= math.log1p(tolerance), log_sd, confidence, paired,
                           max_repeats)


def repeats_to_settle(log_sd: float, change: float, tolerance: float, confidence: float = 0.95,
                      paired: bool = False, max_repeats: int = 1000) -> int | None:
    """Repeats per side (pairs when ``paired``) for an inconclusive metric's interval to clear the nearest
    tolerance bound, were the observed ``change`` to stay: its half-width below the log distance from
    ``log(1 + change)`` to ``log(1 + tolerance)`` or ``log(1 - tolerance)``, at a noise of ``log_sd``.
    None when more than ``max_repeats`` (a change on a bound never settles)."""
    if not math.isfinite(log_sd) or change <= -1:
        return None
    d = math.log1p(change)
    bounds = [math.log1p(tolerance)] + ([math.log1p(-tolerance)] if tolerance < 1 else [])
    margin = min(abs(d - b) for b in bounds)
    if margin == 0:
        return None
    if log_sd == 0:
        return 2
    return _fewest_repeats(lambda half_width: half_width < margin, log_sd, confidence, paired, max_repeats)


def _fewest_repeats(enough, log_sd: float, confidence: float, paired: bool, max_repeats: int) -> int | None:
    """The fewest repeats n (2..max_repeats) whose interval half-width at a noise of ``log_sd`` is ``enough``;
    None when none is. Every n at once: a t quantile per n, one scipy call each, took 0.1 s for a metric that
    never settles, and a compare asks this of each inconclusive metric."""
    n = np.arange(2, max_repeats + 1)
    se = log_sd / np.sqrt(n) if paired else log_sd * np.sqrt(2 / n)
    df = n - 1 if paired else 2 * n - 2
    ok = enough(_scipy_stats().t.ppf(0.5 + confidence / 2, df) * se)
    return int(n[ok.argmax()]) if ok.any() else None


# --- a single run: the requests ------------------------------------------------------------------------

def percentile_stat(q: float) -> Callable[[np.ndarray], np.ndarray]:
    """A statistic for :func:`bootstrap_relative_change`: the q-th percentile (linear, as bench/common/metrics.py)
    along the last axis."""
    return lambda a, axis=-1: np.percentile(a, q, axis=axis)


def mean_stat(a: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(a, axis=axis)


def bootstrap_relative_change(baseline: Sequence[float], candidate: Sequence[float],
                              stat: Callable[..., np.ndarray] = mean_stat, confidence: float = 0.95,
                              n_boot: int = 4000, seed: int = 0) -> Interval:
    """Percentile bootstrap (scipy.stats.bootstrap) of log(stat(candidate) / stat(baseline)), each side
    resampled on its own, reported as a relative change.

    ``stat`` maps an array (..., n) to (...) along ``axis``, e.g. :func:`percentile_stat` (50) for a p50.
    Seeded: the same samples give the same interval.
    """
    b, c = _clean(baseline), _clean(candidate)
    if b.size < MIN_BOOTSTRAP_SAMPLES or c.size < MIN_BOOTSTRAP_SAMPLES:
        raise ValueError(f"a bootstrap needs at least {MIN_BOOTSTRAP_SAMPLES} samples on each side")
    point_b, point_c = float(stat(b)), float(stat(c))
    if point_b <= 0 or point_c <= 0:
        raise ValueError("a statistic is <= 0: a relative change on the log scale is undefined")

    def log_ratio(sb, sc, axis=-1):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(stat(sc, axis=axis)) - np.log(stat(sb, axis=axis))

    res = _scipy_stats().bootstrap((b, c), log_ratio, n_resamples=n_boot, confidence_level=confidence,
                                   method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    low, high = res.confidence_interval
    if not (math.isfinite(low) and math.isfinite(high)):  # a resample with a zero statistic
        raise ValueError("the bootstrap met a zero statistic: no interval on the log scale")
    return Interval(change=point_c / point_b - 1, low=float(np.expm1(low)), high=float(np.expm1(high)),
                    method=f"{SINGLE_RUN} (bootstrap of the log ratio, {b.size} vs {c.size} samples; "
                           "not run-to-run noise)",
                    n_baseline=int(b.size), n_candidate=int(c.size), confidence=confidence)


# --- the verdict ---------------------------------------------------------------------------------------

def decide(interval: Interval | None, tolerance: float, higher_is_worse: bool) -> Verdict:
    """Regression only when the whole interval lies beyond the tolerance on the worse side; improvement
    when it lies beyond it on the better side; unchanged when it lies within +/- tolerance; else
    inconclusive (the interval straddles a tolerance: more repeats would tell)."""
    if interval is None:
        return "not compared"
    low, high = (interval.low, interval.high) if higher_is_worse else (-interval.high, -interval.low)
    # from here on, a positive change is worse
    if low > tolerance:
        return "regression"
    if high < -tolerance:
        return "improvement"
    if -tolerance <= low and high <= tolerance:
        return "unchanged"
    return "inconclusive"
