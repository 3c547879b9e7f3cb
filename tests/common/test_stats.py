"""bench/common/stats.py on known distributions: a real 10 % regression is caught, noise within tolerance is not."""
import numpy as np
import pytest

from kvbench.common import stats


@pytest.mark.parametrize("p, df, expected", [(0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.975, 10, 2.2281),
                                             (0.95, 30, 1.6973), (0.975, 1e12, 1.9600)])
def test_t_quantile_matches_the_tables(p, df, expected):
    assert stats.t_quantile(p, df) == pytest.approx(expected, abs=1e-4)
    assert stats.t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-4)


def test_welch_catches_a_real_10_percent_regression():
    rng = np.random.default_rng(7)
    base, cand = rng.normal(1.00, 0.02, 5), rng.normal(1.10, 0.02, 5)  # TTFT in s: 10 % slower
    iv = stats.welch_relative_change(base, cand)
    assert iv.low < 0.10 < iv.high
    assert stats.decide(iv, 0.05, higher_is_worse=True) == "regression"
    # the same change in a throughput metric is an improvement
    assert stats.decide(iv, 0.05, higher_is_worse=False) == "improvement"


def test_noise_within_tolerance_is_not_a_regression():
    rng = np.random.default_rng(8)
    for trial in range(50):
        base, cand = rng.normal(1.0, 0.02, 3), rng.normal(1.01, 0.02, 3)  # +1 %, tolerance 5 %
        assert stats.decide(stats.welch_relative_change(base, cand), 0.05, True) != "regression", trial


def test_a_change_beyond_tolerance_with_wide_noise_is_inconclusive_not_regression():
    rng = np.random.default_rng(9)
    base, cand = rng.normal(1.0, 0.15, 2), rng.normal(1.08, 0.15, 2)
    assert stats.decide(stats.welch_relative_change(base, cand), 0.05, True) == "inconclusive"


def test_welch_false_alarm_rate_is_at_most_alpha_over_two():
    """No change and tolerance 0: a 95 % interval excludes 0 on the worse side in about 2.5 % of trials."""
    rng = np.random.default_rng(11)
    alarms = sum(stats.decide(stats.welch_relative_change(rng.normal(10, 1, 4), rng.normal(10, 1, 4)), 0.0, True)
                 == "regression" for _ in range(400))
    assert alarms / 400 < 0.06


def test_identical_repeats_give_a_point_interval():
    iv = stats.welch_relative_change([100.0, 100.0], [110.0, 110.0])
    assert (iv.change, iv.low, iv.high) == pytest.approx((0.10, 0.10, 0.10))


def test_bootstrap_from_requests_catches_10_percent_and_ignores_noise():
    rng = np.random.default_rng(3)
    base = rng.lognormal(0, 0.1, 200)
    slower = 1.10 * rng.lognormal(0, 0.1, 200)
    same = rng.lognormal(0, 0.1, 200)
    iv = stats.bootstrap_relative_change(base, slower, stats.percentile_stat(50))
    assert iv.method.startswith("single run: interval from requests")
    assert stats.decide(iv, 0.05, True) == "regression"
    assert stats.decide(stats.bootstrap_relative_change(base, same, stats.percentile_stat(50)), 0.05, True) \
        != "regression"


def test_bootstrap_is_seeded_and_needs_samples():
    a, b = np.arange(1, 21.0), np.arange(2, 22.0)
    assert stats.bootstrap_relative_change(a, b, seed=1) == stats.bootstrap_relative_change(a, b, seed=1)
    with pytest.raises(ValueError, match="at least"):
        stats.bootstrap_relative_change([1.0, 2.0], b)
    with pytest.raises(ValueError, match="at least 2"):
        stats.welch_relative_change([1.0], [1.0, 2.0])


def test_decide_without_an_interval():
    assert stats.decide(None, 0.05, True) == "not compared"


def test_a_noisy_interval_never_crosses_minus_100_percent():
    """The published vLLM upgrade's TTFT p50 had a delta-method interval of [-136 %, +46 %]; on the log
    scale the low end stays above -100 % however noisy the repeats."""
    base, cand = [0.30, 0.05, 0.90], [0.10, 0.12, 0.60]
    iv = stats.welch_relative_change(base, cand)
    assert -1 < iv.low < iv.change < iv.high
    rng = np.random.default_rng(5)
    for _ in range(200):
        iv = stats.welch_relative_change(rng.lognormal(0, 1.5, 3), rng.lognormal(0, 1.5, 3))
        assert iv.low > -1
    assert stats.bootstrap_relative_change(rng.lognormal(0, 2, 20), rng.lognormal(0, 2, 20)).low > -1


def test_paired_interval_cancels_a_shared_drift():
    drift = np.array([1.0, 1.5, 0.8, 1.2, 2.0])  # the machine, slot by slot, shared by both runs of a pair
    base = drift * np.array([1.00, 1.01, 0.99, 1.00, 1.01])
    cand = 1.10 * drift * np.array([1.01, 0.99, 1.00, 1.01, 1.00])
    paired = stats.paired_relative_change(base, cand)
    assert paired.method.startswith("paired")
    assert stats.decide(paired, 0.05, True) == "regression"
    assert stats.decide(stats.welch_relative_change(base, cand), 0.05, True) == "inconclusive"
    with pytest.raises(ValueError, match="pair"):
        stats.paired_relative_change([1.0, 2.0], [1.0])


def test_repeats_needed_grows_with_noise_and_shrinks_with_tolerance():
    assert stats.repeats_needed(0.0, 0.05) == 2
    few, many = stats.repeats_needed(0.02, 0.05), stats.repeats_needed(0.10, 0.05)
    assert few < many
    assert stats.repeats_needed(0.10, 0.20) < many
    # at the answer the interval's half-width is within the tolerance, one fewer it is not
    n = stats.repeats_needed(0.05, 0.05)
    half = stats.t_quantile(0.975, 2 * n - 2) * 0.05 * np.sqrt(2 / n)
    assert half <= np.log1p(0.05) < stats.t_quantile(0.975, 2 * n - 4) * 0.05 * np.sqrt(2 / (n - 1))
    assert stats.repeats_needed(5.0, 0.01) is None


def test_calibration_coverage_false_regressions_and_power():
    """A small run of bench/compare/calibration.py (fixed seed): the 95 % interval covers the truth about
    95 % of the time at 3, 5 and 10 repeats, an unchanged engine is called a regression at most 5 % of the
    time, and power for a planted 10 % regression grows with the repeats."""
    from kvbench.compare import calibration as cal

    rows = cal.table(sims=3000, seed=1, cvs=(0.03, 0.15))
    for r in rows:
        assert 0.93 <= r.coverage_null <= 0.975 or (r.method == "welch" and r.drift_cv), r
        assert 0.93 <= r.coverage_planted <= 0.975 or (r.method == "welch" and r.drift_cv), r
        assert r.false_regression <= 0.05 and r.false_regression_tol0 <= 0.05 + 0.01, r
    welch = {r.repeats: r.power for r in rows if r.cv == 0.03 and not r.drift_cv}
    assert welch[3] < welch[5] < welch[10] and welch[10] > 0.8
    drift = {(r.method, r.repeats): r.power for r in rows if r.drift_cv}
    assert drift[("paired", 10)] > 0.8 > 0.1 > drift[("welch", 10)]
    assert "| 3% | 0% | 3 | welch |" in cal.markdown(rows)


def test_calibration_shows_a_single_run_bootstrap_misses_run_to_run_noise():
    """One run per side at 7 % run-to-run noise: the bootstrap over the requests is too narrow (the script
    prints 79 % coverage over 1,000 comparisons); repeats are what fixes it."""
    from kvbench.compare import calibration as cal

    row = cal.simulate_single_run(0.07, sims=200, seed=3, n_boot=500)
    assert row.repeats == 1 and row.method.startswith("single run")
    assert row.coverage_null < 0.9
