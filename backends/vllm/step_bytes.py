"""vLLM's own estimate of the bytes its forward passes read and write (``--enable-mfu-metrics``: the analytic
model of vllm/v1/metrics/perf.py, counted per step by the scheduler), beside kvbench's decode bound. The
counters are ``vllm:estimated_read_bytes_per_gpu_total`` and ``..._write_bytes_...``; the steps they came in,
``vllm:iteration_tokens_total`` (a histogram observed once a step: its count). A real 0.32.0 server's page:
tests/data/step_bytes/vllm_metrics_mfu.txt."""
from __future__ import annotations

from ..capabilities import MetricsStepBytes
from ..prometheus import gauge_sum
from ..types import StepBytesCounters

READ, WRITE = "vllm:estimated_read_bytes_per_gpu_total", "vllm:estimated_write_bytes_per_gpu_total"
STEPS = "vllm:iteration_tokens_total_count"
#: The first version whose source kvbench read for the flag and the counters (engine_args --enable-mfu-metrics)
SINCE = (0, 32)


def read_step_bytes(samples: dict[str, list]) -> StepBytesCounters | None:
    """The counters from a /metrics page's samples (summed over engines), or None where the page lacks them
    (a server started without --enable-mfu-metrics exports none)."""
    read, write = gauge_sum(samples, READ), gauge_sum(samples, WRITE)
    if read is None or write is None:
        return None
    return StepBytesCounters(read, write, gauge_sum(samples, STEPS),
                             f"{READ}, {WRITE} over {STEPS} (vLLM's analytic estimate, /metrics)")


STEP_BYTES = MetricsStepBytes(source=f"{READ} and {WRITE} per {STEPS} (--enable-mfu-metrics, vLLM >= 0.32)",
                              flag="--enable-mfu-metrics", since=SINCE,
                              names=(READ, WRITE, STEPS), read=read_step_bytes)
