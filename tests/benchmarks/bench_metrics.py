"""A cell's metrics over 10,000 requests of 256 streamed tokens each (bench/common/metrics.py)."""
import numpy as np
import pytest

from kvbench.common.metrics import RequestTimes, cell_metrics

N, TOKENS = 10_000, 256


@pytest.fixture(scope="module")
def results():
    rng = np.random.default_rng(0)
    out = []
    for i in range(N):
        sent = i * 0.01
        gaps = rng.exponential(0.02, TOKENS)
        times = tuple((sent + 0.2 + np.cumsum(gaps)).tolist())
        out.append((sent, times, (1,) * TOKENS, times[-1] + 0.001))
    return out


def test_request_times(benchmark, results):
    times = benchmark(lambda: [RequestTimes(*r) for r in results])
    assert len(times) == N and times[0].output_tokens == TOKENS


def test_cell_metrics(benchmark, results):
    times = [RequestTimes(*r) for r in results]
    out = benchmark(cell_metrics, times, [1024] * N)
    assert out["ttft_s_p50"] == pytest.approx(0.2 + 0.02, rel=0.2)
