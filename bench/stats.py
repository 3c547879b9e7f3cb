"""The statistics of ``kvbench compare``: pure functions of numbers, no files, no pandas.

Two ways to put an interval on the relative change ``candidate / baseline - 1`` of one metric:

- **Repeated runs** (>= 2 repeats on each side): each repeat gives one value of the metric (a cell's
  TTFT p50, its tokens/s, ...). The interval is a **Welch t-interval on the ratio of the means**, by the
  delta method: R = mean(c) / mean(b), SE(R) = sqrt(s_c^2 / n_c + R^2 s_b^2 / n_b) / mean(b),
  degrees of freedom by Welch-Satterthwaite on those two relative-variance terms, R +/- t * SE. It
  carries the uncertainty of both means (the baseline's too), needs no equal variances, and is exact
  where it matters here (equal spreads, change of a few per cent); it is the one used whenever a side has
  two or more repeats.
- **A single run per side**: the latency percentiles are percentiles over requests, so the requests give
  the samples: a **percentile bootstrap of the ratio of the two statistics**, each side's samples
  resampled with replacement on its own (``bootstrap_relative_change``). Its interval says how much the
  requests of this one run vary, not how much a repeat of the run would: it is narrower than the truth
  when runs differ systematically (a warm cache, another job on the machine), and the report says so.

``decide`` turns an interval into a verdict against a tolerance: a regression only when the whole
interval lies beyond the tolerance on the worse side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

Verdict = Literal["regression", "improvement", "unchanged", "inconclusive", "not compared"]
MIN_BOOTSTRAP_SAMPLES = 5  # fewer samples on a side give no bootstrap interval


@dataclass(frozen=True)
class Interval:
    change: float  # candidate / baseline - 1 (point estimate)
    low: float  # confidence interval of the change
    high: float
    method: str
    n_baseline: int
    n_candidate: int
    confidence: float


# --- Student's t without scipy: the regularized incomplete beta function (Lentz's continued fraction) ---

def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (real, > 0) degrees of freedom."""
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2))
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on :func:`t_cdf`; exact to ~1e-10)."""
    if not 0 < p < 1:
        raise ValueError("p must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


# --- the intervals ------------------------------------------------------------------------------------

def _clean(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return arr[np.isfinite(arr)]


def welch_relative_change(baseline: Sequence[float], candidate: Sequence[float],
                          confidence: float = 0.95) -> Interval:
    """Welch t-interval (delta method) on mean(candidate) / mean(baseline) - 1; >= 2 values per side."""
    b, c = _clean(baseline), _clean(candidate)
    if b.size < 2 or c.size < 2:
        raise ValueError("a t-interval needs at least 2 values on each side")
    mb, mc = b.mean(), c.mean()
    if mb == 0:
        raise ValueError("the baseline mean is 0: a relative change is undefined")
    ratio = mc / mb
    # delta method: Var(R) = Var(mean c) / mb^2 + R^2 Var(mean b) / mb^2; Welch-Satterthwaite on the two terms
    vc = c.var(ddof=1) / (c.size * mb**2)
    vb = ratio**2 * b.var(ddof=1) / (b.size * mb**2)
    var = vb + vc
    if var == 0:  # identical repeats on both sides: the interval is the point
        half = 0.0
    else:
        df = var**2 / (vb**2 / (b.size - 1) + vc**2 / (c.size - 1))
        half = t_quantile(0.5 + confidence / 2, df) * math.sqrt(var)
    return Interval(change=float(ratio - 1), low=float(ratio - 1 - half), high=float(ratio - 1 + half),
                    method=f"Welch t-interval on the ratio of means, {b.size} vs {c.size} repeats",
                    n_baseline=int(b.size), n_candidate=int(c.size), confidence=confidence)


def percentile_stat(q: float) -> Callable[[np.ndarray], np.ndarray]:
    """A statistic for :func:`bootstrap_relative_change`: the q-th percentile (linear, as bench/metrics.py)
    along the last axis."""
    return lambda a: np.percentile(a, q, axis=-1)


def mean_stat(a: np.ndarray) -> np.ndarray:
    return np.mean(a, axis=-1)


def bootstrap_relative_change(baseline: Sequence[float], candidate: Sequence[float],
                              stat: Callable[[np.ndarray], np.ndarray] = mean_stat, confidence: float = 0.95,
                              n_boot: int = 4000, seed: int = 0) -> Interval:
    """Percentile bootstrap of stat(candidate) / stat(baseline) - 1, each side resampled on its own.

    ``stat`` maps an array (..., n) to (...), e.g. :func:`percentile_stat` (50) for a p50. Seeded: the same
    samples give the same interval.
    """
    b, c = _clean(baseline), _clean(candidate)
    if b.size < MIN_BOOTSTRAP_SAMPLES or c.size < MIN_BOOTSTRAP_SAMPLES:
        raise ValueError(f"a bootstrap needs at least {MIN_BOOTSTRAP_SAMPLES} samples on each side")
    point_b, point_c = float(stat(b)), float(stat(c))
    if point_b == 0:
        raise ValueError("the baseline statistic is 0: a relative change is undefined")
    rng = np.random.default_rng(seed)
    boot_b = stat(b[rng.integers(0, b.size, size=(n_boot, b.size))])
    boot_c = stat(c[rng.integers(0, c.size, size=(n_boot, c.size))])
    valid = boot_b != 0
    ratios = boot_c[valid] / boot_b[valid] - 1
    alpha = 1 - confidence
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return Interval(change=point_c / point_b - 1, low=float(low), high=float(high),
                    method=f"single run: interval from requests (bootstrap, {b.size} vs {c.size} samples)",
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
