"""SGLang's own estimate of the bytes its forward passes read and write (``--enable-mfu-metrics``), beside
kvbench's decode bound. Read from SGLang 0.5.23 (the wheel's sources):

- srt/observability/metrics_collector.py: the counters ``sglang:estimated_read_bytes_per_gpu_total`` and
  ``..._write_bytes_...`` (labelled, so absent from the page until the first increment), and
  ``sglang:cuda_graph_passes_total`` by ``mode`` (decode_cuda_graph, decode_none, prefill_cuda_graph,
  prefill_none): one increment a forward pass, graphed or not (batch_result_processor.py after each decode
  batch, metrics_reporter.py report_prefill_stats after each prefill batch). Their sum is the passes.
- srt/managers/scheduler_components/metrics_reporter.py ``_estimate_decode_perf``: a decode pass reads
  ``tokens x (weights + activations)`` plus ``sum(seq_lens) x K/V bytes a token``: the **weights are counted once
  per token decoded**, not once per pass, so with S sequences in a pass its figure holds about S x the weights,
  where kvbench (and the memory) reads them once; ``_estimate_prefill_perf``: ``tokens x (weights + activations)``
  plus the cached prefix's K/V once. Every width is the model dtype's (a quantised checkpoint or KV is counted
  at bf16), the MLP is the dense ``intermediate_size`` (no MoE term).

So a cell's figure (the read counter's rise over the passes' rise) is close to kvbench's at one sequence in
flight and about S times the weights above it at S; the row's flag says the ratio. The fake SGLang
(tests/fakes/sglang_server.py) exports the counters by these formulas; no SGLang server runs on this machine."""
from __future__ import annotations

from ..capabilities import MetricsStepBytes
from ..prometheus import gauge_sum
from ..types import StepBytesCounters

READ, WRITE = "sglang:estimated_read_bytes_per_gpu_total", "sglang:estimated_write_bytes_per_gpu_total"
PASSES = "sglang:cuda_graph_passes_total"
#: The version whose source kvbench read for the flag and the counters (arg_groups/fields/observability.py)
SINCE = (0, 5, 23)
SOURCE = (f"{READ}, {WRITE} over {PASSES} (SGLang's analytic estimate, /metrics: the weights counted once per "
          f"token decoded, not per pass)")


def read_step_bytes(samples: dict[str, list]) -> StepBytesCounters | None:
    """The counters from a /metrics page's samples (summed over ranks and modes), or None where the page has
    passes but no estimate (a server started without --enable-mfu-metrics). A page before its first pass
    has neither: zero bytes in zero passes."""
    read, write, passes = gauge_sum(samples, READ), gauge_sum(samples, WRITE), gauge_sum(samples, PASSES)
    if read is None and write is None:
        return None if passes else StepBytesCounters(0.0, 0.0, 0.0, SOURCE)
    return StepBytesCounters(read or 0.0, write or 0.0, passes, SOURCE)


STEP_BYTES = MetricsStepBytes(source=f"{READ} and {WRITE} per {PASSES} (--enable-mfu-metrics, SGLang >= 0.5.23)",
                              flag="--enable-mfu-metrics", since=SINCE,
                              names=(READ, WRITE, PASSES), read=read_step_bytes)
