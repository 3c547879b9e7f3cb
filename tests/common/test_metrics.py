"""Metrics against timelines computed by hand."""
import pytest

from kvbench.common.metrics import RequestTimes, cell_metrics, percentiles, request_verdict


def test_single_token_chunks():
    r = RequestTimes(t_sent=10.0, chunk_times=(10.5, 10.6, 10.8, 10.9), chunk_tokens=(1, 1, 1, 1), t_done=10.95)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl_samples() == pytest.approx([0.1, 0.2, 0.1])
    assert r.tpot == pytest.approx(0.4 / 3)
    assert r.e2e == pytest.approx(0.95)
    assert r.output_tokens == 4


def test_multi_token_chunk_spreads_gap_over_its_tokens():
    # second chunk carries 4 tokens 0.4 s after the first: four ITL samples of 0.1 s
    r = RequestTimes(t_sent=0.0, chunk_times=(1.0, 1.4, 1.5), chunk_tokens=(2, 4, 1))
    assert r.itl_samples() == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    assert r.output_tokens == 7
    assert r.tpot == pytest.approx(0.5 / 6)  # first token excluded


def test_request_without_tokens_has_no_latency():
    r = RequestTimes(t_sent=0.0, chunk_times=(), chunk_tokens=())
    assert r.ttft is None and r.e2e is None and r.tpot is None and r.itl_samples() == []


def test_one_token_request_has_no_tpot():
    assert RequestTimes(0.0, (0.2,), (1,)).tpot is None


def test_cell_pools_itl_per_gap_not_per_request():
    fast = RequestTimes(0.0, (0.1, 0.2, 0.3, 0.4, 0.5), (1, 1, 1, 1, 1))  # 4 gaps of 0.1
    slow = RequestTimes(0.0, (0.1, 1.1), (1, 1))  # 1 gap of 1.0
    m = cell_metrics([fast, slow], [100, 100])
    # per-gap pooling: 5 samples, median 0.1; a per-request average would give (0.1 + 1.0) / 2
    assert m["itl_s_p50"] == pytest.approx(0.1)
    assert m["itl_s_mean"] == pytest.approx((0.4 + 1.0) / 5)
    assert m["wall_s"] == pytest.approx(1.1)
    assert m["output_tokens_per_s"] == pytest.approx(7 / 1.1)
    assert m["total_tokens_per_s"] == pytest.approx(207 / 1.1)
    assert m["requests_per_s"] == pytest.approx(2 / 1.1)


def test_percentiles_interpolate_and_ignore_none():
    out = percentiles([1.0, None, 2.0, 3.0, 4.0], "x")
    assert out == {"x_mean": 2.5, "x_p50": 2.5, "x_p90": pytest.approx(3.7), "x_p99": pytest.approx(3.97)}
    assert percentiles([], "x")["x_p50"] is None


def test_empty_cell():
    m = cell_metrics([], [])
    assert m["output_tokens_per_s"] is None and m["ttft_s_p50"] is None


def test_goodput_counts_requests_within_both_slo_bounds():
    ok = RequestTimes(0.0, (0.5, 0.6, 0.7), (1, 1, 1))  # TTFT 0.5, TPOT 0.1
    slow_first = RequestTimes(0.0, (2.0, 2.1), (1, 1))  # TTFT 2.0
    slow_decode = RequestTimes(0.0, (0.4, 1.4), (1, 1))  # TPOT 1.0
    m = cell_metrics([ok, slow_first, slow_decode], [10, 10, 10], slo_ttft_s=1.0, slo_tpot_s=0.5)
    assert m["wall_s"] == pytest.approx(2.1)
    assert m["goodput_requests_per_s"] == pytest.approx(1 / 2.1)
    assert m["requests_per_s"] == pytest.approx(3 / 2.1)
    assert cell_metrics([ok], [10])["goodput_requests_per_s"] is None  # no SLO, no goodput


@pytest.mark.parametrize("args, verdict", [
    ((None, 100, 100, 8, 8, 8), "ok"),
    ((None, 100, None, 8, None, 8), "ok"),  # the engine reports nothing: the client's count decides
    (("HTTP 500: boom", 100, None, 8, None, 3), "failed"),  # an error fails it even with tokens received
    ((None, 100, None, 8, None, 0), "failed"),  # no token at all
    ((None, 100, 60, 8, 8, 8), "truncated"),  # the engine read 60 of 100 prompt tokens
    ((None, 100, 101, 8, 8, 8), "miscounted"),  # read more than sent: e.g. a BOS added
    ((None, 100, 100, 8, 5, 5), "short"),  # stopped at EOS after 5
    ((None, 100, 100, 8, None, 5), "short"),
    ((None, 100, 100, 8, 9, 9), "long"),
    ((None, 100, 100, 8, 8, 7), "miscounted"),  # engine says 8, client got 7
])
def test_request_verdict(args, verdict):
    assert request_verdict(*args) == verdict


def test_failed_and_flagged_requests_stay_out_of_the_figures():
    # what the runner does: only verdict "ok" requests reach cell_metrics
    good = RequestTimes(0.0, (1.0, 1.5), (1, 1))
    truncated = RequestTimes(0.0, (0.1, 0.2), (1, 1))  # fast because the engine read less
    verdicts = [request_verdict(None, 100, 100, 2, 2, 2), request_verdict(None, 100, 40, 2, 2, 2)]
    kept = [r for r, v in zip([good, truncated], verdicts) if v == "ok"]
    assert cell_metrics(kept, [100])["ttft_s_p50"] == pytest.approx(1.0)


def test_chunks_arriving_together_count_as_one_chunk():
    # events 2 and 3 came in one read (one timestamp): 0.4 s over their 2 tokens, not 0.4 and 0
    r = RequestTimes(t_sent=0.0, chunk_times=(1.0, 1.4, 1.4, 1.5), chunk_tokens=(1, 1, 1, 1))
    assert r.itl_samples() == pytest.approx([0.2, 0.2, 0.1])
    # tokens that arrived with the first chunk stay in TTFT
    r = RequestTimes(t_sent=0.0, chunk_times=(1.0, 1.0, 1.3), chunk_tokens=(1, 2, 1))
    assert r.itl_samples() == pytest.approx([0.3])
    assert r.tpot == pytest.approx(0.3 / 3)


def test_polled_kv_peak_is_not_measured_when_no_poll_saw_a_request_in_flight():
    from kvbench.run.rows import polled_kv_peak
    from kvbench.run.samplers import KVSample

    windows = [(10.0, 10.8)]  # one request, sent at 10.0, done at 10.8
    idle = [KVSample(9.9, 0.0, 0.0), KVSample(11.0, 0.0, 0.0)]  # a poller that slept through it
    best, source = polled_kv_peak(idle, windows, "gauge")
    assert best is None and source.startswith("not measured: none of 2 polls of gauge")
    seen = [*idle, KVSample(10.5, 256.0, 128.0)]
    best, source = polled_kv_peak(seen, windows, "gauge")
    assert best.kv_tokens_in_use == 128.0 and source == "max of 3 polls of gauge"
    # zero read while a request was in flight that got no token (it failed, say) is the engine's own figure
    best, _ = polled_kv_peak([KVSample(10.4, 0.0, 0.0)], windows, "gauge")
    assert best is not None and best.kv_bytes_in_use == 0.0
    # but a served request held KV: a zero read then is a gauge behind the engine, not a measurement
    stale = [KVSample(9.9, 0.0, 0.0), KVSample(10.4, 0.0, 0.0)]
    best, source = polled_kv_peak(stale, windows, "gauge", n_served=1)
    assert best is None and source.startswith("not measured: none of 2 polls of gauge read the KV of the cell's 1 ")


def test_queue_peaks_not_measured_when_no_poll_saw_a_request_in_flight():
    from kvbench.run.rows import queue_peaks
    from kvbench.run.samplers import QueueSample

    windows = [(10.0, 10.8), (10.1, 11.2)]
    blind = [QueueSample(9.9, 0, 0, 3), QueueSample(11.5, 0, 0, 5)]  # before and after: preempted twice
    assert queue_peaks(blind, windows, "q")[:3] == (None, None, 2)
    assert queue_peaks(blind, windows, "q")[3].startswith("not measured: none of 2 polls of q")
    seen = [QueueSample(9.9, 0, 0, 3), QueueSample(10.5, 1, 2, 3), QueueSample(11.5, 0, 0, 3)]
    assert queue_peaks(seen, windows, "q") == (1, 2, 0, "max of 3 polls of q")
    # a poll in flight that read an empty queue, while the engine served both requests: a stale gauge
    stale = [QueueSample(9.9, 0, 0, 3), QueueSample(10.5, 0, 0, 3)]
    assert queue_peaks(stale, windows, "q")[:2] == (0, 0)
    waiting, running, _, source = queue_peaks(stale, windows, "q", n_served=2)
    assert (waiting, running) == (None, None) and "none of 2 polls of q saw the cell's 2 served requests" in source


def test_a_stream_in_one_read_has_no_tpot_and_no_itl():
    """Every token arrived with the first chunk (one socket read): no gap was measured, so TPOT is
    undefined like ITL, not 0.0."""
    r = RequestTimes(0.0, (0.3, 0.3, 0.3), (1, 5, 10))
    assert r.itl_samples() == [] and r.tpot is None
    m = cell_metrics([r], [10])
    assert m["tpot_s_p50"] is None and m["itl_s_p50"] is None


def test_goodput_counts_an_undefined_tpot_as_unknown():
    timed = RequestTimes(0.0, (0.1, 0.2), (1, 1))  # TPOT 0.1
    one_read = RequestTimes(0.0, (0.1, 0.1), (1, 1))  # TPOT undefined
    m = cell_metrics([timed, one_read], [10, 10], slo_tpot_s=0.5)
    assert m["goodput_requests_per_s"] == pytest.approx(1 / 0.2)
    # with a TTFT bound only, TPOT does not matter
    assert cell_metrics([timed, one_read], [10, 10], slo_ttft_s=1.0)["goodput_requests_per_s"] == pytest.approx(2 / 0.2)
