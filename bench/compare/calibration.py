"""How far ``kvbench compare``'s verdicts can be trusted: simulated comparisons of known truth.

``python -m kvbench.compare.calibration`` draws many baseline/candidate pairs of repeated runs, each repeat's
value the true value times lognormal noise at a coefficient of variation (CV) seen in real runs, and passes
them through the same interval and verdict code ``kvbench compare`` uses (bench/common/stats.py). It prints, per
noise level, repeats per side and method:

- **coverage**: how often the 95 % interval holds the true change (should be about 95 %), with no change
  and with a planted 10 % regression;
- **false regressions**: how often an unchanged engine is called a regression at the default 5 % tolerance
  and at tolerance 0 (must be <= 5 %; the rule "the whole interval beyond the tolerance" keeps it under
  2.5 %);
- **power**: how often a planted 10 % regression (of a higher-is-worse metric) is called a regression at a
  5 % tolerance.

The CVs: the repeat-to-repeat CVs of the published vLLM 0.31 -> 0.32 run (results/published/
20261129-vllm-upgrade-cpu, 3 repeats a cell on 2 shared cores) were 2-7 % for E2E p50 and output tokens/s
and 2-17 % for TTFT p50; 3 %, 7 % and 15 % span them. The "drift" rows add a machine drift shared by the
two runs of a pair (CV 10 %, e.g. another job on the machine), as on an interleaved A/B run: the Welch
interval (unpaired) pays for it, the paired one cancels it. The "single run" rows compare one run per side
through the bootstrap over its 40 requests' TTFT (30 % request-to-request CV), as ``kvbench compare`` does
without repeats: the run-to-run noise is invisible to it.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from kvbench.common import stats

CVS = (0.03, 0.07, 0.15)
REPEATS = (3, 5, 10)
TOLERANCE = 0.05
PLANTED = 0.10
DRIFT_CV = 0.10


@dataclass(frozen=True)
class Row:
    cv: float
    repeats: int
    method: str  # "welch" or "paired"
    drift_cv: float
    coverage_null: float
    coverage_planted: float
    false_regression: float  # no change, tolerance TOLERANCE
    false_regression_tol0: float  # no change, tolerance 0
    power: float  # planted PLANTED, tolerance TOLERANCE


def _sigma(cv: float) -> float:
    """The log-scale sd of a lognormal with this coefficient of variation."""
    return math.sqrt(math.log1p(cv * cv))


def _draw(rng, sims: int, n: int, cv: float, drift_cv: float, change: float):
    drift = rng.normal(0, _sigma(drift_cv), (sims, n)) if drift_cv else 0.0  # shared by pair i
    base = np.exp(drift + rng.normal(0, _sigma(cv), (sims, n)))
    cand = (1 + change) * np.exp(drift + rng.normal(0, _sigma(cv), (sims, n)))
    return base, cand


def _verdicts(change, low, high, tolerance):
    return np.array([stats.decide(stats.Interval(c, lo, hi, "", 0, 0, 0.95), tolerance, True)
                     for c, lo, hi in zip(change, low, high)])


def simulate(cv: float, n: int, method: str = "welch", drift_cv: float = 0.0, sims: int = 20000,
             seed: int = 0, confidence: float = 0.95) -> Row:
    """One row of the table: ``sims`` comparisons with no change and ``sims`` with a planted regression."""
    rng = np.random.default_rng(seed)
    interval = stats.paired_log_interval if method == "paired" else stats.welch_log_interval
    out = {}
    for truth in (0.0, PLANTED):
        change, low, high = interval(*_draw(rng, sims, n, cv, drift_cv, truth), confidence)
        out[truth] = (np.mean((low <= truth) & (truth <= high)), _verdicts(change, low, high, TOLERANCE),
                      _verdicts(change, low, high, 0.0))
    return Row(cv, n, method, drift_cv, coverage_null=float(out[0.0][0]), coverage_planted=float(out[PLANTED][0]),
               false_regression=float(np.mean(out[0.0][1] == "regression")),
               false_regression_tol0=float(np.mean(out[0.0][2] == "regression")),
               power=float(np.mean(out[PLANTED][1] == "regression")))


def simulate_single_run(cv: float, n_requests: int = 40, request_cv: float = 0.3, sims: int = 1000,
                        seed: int = 0, confidence: float = 0.95, n_boot: int = 1000) -> Row:
    """A single run per side compared through its requests' TTFT p50 (the bootstrap ``kvbench compare``
    uses then): each run is off by its own run-to-run noise (``cv``), which the requests cannot show."""
    rng = np.random.default_rng(seed)
    out = {}
    for truth in (0.0, PLANTED):
        hits, regressions, regressions0 = 0, 0, 0
        for i in range(sims):
            base = np.exp(rng.normal(0, _sigma(cv))) * rng.lognormal(0, _sigma(request_cv), n_requests)
            cand = (1 + truth) * np.exp(rng.normal(0, _sigma(cv))) * rng.lognormal(0, _sigma(request_cv), n_requests)
            iv = stats.bootstrap_relative_change(base, cand, stats.percentile_stat(50), confidence, n_boot, seed=i)
            hits += iv.low <= truth <= iv.high
            regressions += stats.decide(iv, TOLERANCE, True) == "regression"
            regressions0 += stats.decide(iv, 0.0, True) == "regression"
        out[truth] = (hits / sims, regressions / sims, regressions0 / sims)
    return Row(cv, 1, f"single run, bootstrap of {n_requests} requests", 0.0, coverage_null=out[0.0][0],
               coverage_planted=out[PLANTED][0], false_regression=out[0.0][1], false_regression_tol0=out[0.0][2],
               power=out[PLANTED][1])


def table(sims: int = 20000, seed: int = 0, cvs=CVS, repeats=REPEATS, single_run_sims: int = 0) -> list[Row]:
    rows = [simulate(cv, n, "welch", 0.0, sims, seed + i) for i, (cv, n) in
            enumerate((cv, n) for cv in cvs for n in repeats)]
    for i, n in enumerate(repeats):  # a machine that drifts: unpaired against paired, CV 3 % on top
        rows.append(simulate(cvs[0], n, "welch", DRIFT_CV, sims, seed + 100 + i))
        rows.append(simulate(cvs[0], n, "paired", DRIFT_CV, sims, seed + 200 + i))
    for i, cv in enumerate(cvs[:2] if single_run_sims else ()):
        rows.append(simulate_single_run(cv, sims=single_run_sims, seed=seed + 300 + i))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| noise CV | drift CV | repeats | interval | coverage (no change) | coverage (+10 %) | "
             "false regressions (tol 5 %) | false regressions (tol 0) | power, +10 % at tol 5 % |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.cv:.0%} | {r.drift_cv:.0%} | {r.repeats} | {r.method} | {r.coverage_null:.1%} | "
                     f"{r.coverage_planted:.1%} | {r.false_regression:.1%} | {r.false_regression_tol0:.1%} | "
                     f"{r.power:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.compare.calibration", description=__doc__.split("\n")[0])
    parser.add_argument("--sims", type=int, default=20000, help="comparisons per row and truth (default 20000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-run-sims", type=int, default=1000,
                        help="comparisons per truth of the single-run bootstrap rows (default 1000; 0: none)")
    args = parser.parse_args(argv)
    rows = table(args.sims, args.seed, single_run_sims=args.single_run_sims)
    print(f"kvbench compare calibration: {args.sims} simulated comparisons per row and truth, seed {args.seed}; "
          f"lognormal noise; 95 % intervals; tolerance {TOLERANCE:.0%}; planted regression {PLANTED:.0%}\n")
    print(markdown(rows))
    worst = max(r.false_regression_tol0 for r in rows if r.repeats > 1)
    print(f"\nworst false-regression rate of the repeated-run intervals (tolerance 0): {worst:.1%} (must be <= 5 %)")
    single = [r for r in rows if r.repeats == 1]
    if single:
        print("single run per side: the bootstrap over requests cannot see the run-to-run noise, so it covers "
              f"the truth only {min(r.coverage_null for r in single):.0%}-{max(r.coverage_null for r in single):.0%}"
              " of the time here: use repeats")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
