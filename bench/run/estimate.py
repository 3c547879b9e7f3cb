"""How long an engine's cells will take on this machine, from two calibration requests.

The same default benchmark took about 25 minutes on a 2-core machine with AVX-512 and hours on one with
AVX2 only (transformers' bf16 prefill was about 10x slower there), so a figure measured elsewhere says
little. Before its cells, each engine answers two requests: the warm-up (a short prompt) and one at the
plan's longest prompt. Their time to first token gives a line, prefill seconds against prompt tokens (a
line is a floor: attention grows faster than linearly, and an engine that batches prefills beats it), their
inter-token latency the decode time per token. Each cell is then priced as rounds of its requests:

- closed loop, ``concurrency`` c, n requests: ceil(n / c) rounds of c prefills one after another (a CPU
  engine prefills one prompt at a time) and one decode of ``output_tokens`` (decoding c sequences together
  costs about as much as one on these machines' small batches);
- open loop at ``rate`` requests/s: at least n / rate seconds, else as a closed loop of its cap.

The figure is rough by design (the run records it beside the time the engine really took, in run.json's
``estimates``, so its error on a machine can be read there), and it is shown before the cells start.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    """Prefill seconds = ``prefill_fixed_s`` + prompt tokens x ``prefill_s_per_token``; decode seconds per
    output token ``decode_s_per_token``."""

    prefill_fixed_s: float
    prefill_s_per_token: float
    decode_s_per_token: float

    @classmethod
    def from_points(cls, short: tuple[int, float], long: tuple[int, float], itl_s: float) -> Calibration:
        """From (prompt tokens, TTFT seconds) of a short and a long request and a decode ITL."""
        (p0, t0), (p1, t1) = sorted([short, long])
        slope = max(0.0, (t1 - t0) / (p1 - p0)) if p1 > p0 else t1 / max(p1, 1)
        return cls(max(0.0, t0 - slope * p0), slope, max(0.0, itl_s))

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_fixed_s + self.prefill_s_per_token * prompt_tokens

    def request_s(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.prefill_s(prompt_tokens) + max(0, output_tokens - 1) * self.decode_s_per_token


def cell_seconds(cal: Calibration, prompt_tokens: int, output_tokens: int, n_requests: int,
                 concurrency: int | None, request_rate: float | None) -> float:
    """The estimated wall time of one cell (see the module's docstring for the model)."""
    if n_requests <= 0:
        return 0.0
    width = max(1, concurrency or n_requests)
    rounds = math.ceil(n_requests / width)
    batch = min(width, n_requests)
    busy = rounds * (batch * cal.prefill_s(prompt_tokens) + max(0, output_tokens - 1) * cal.decode_s_per_token)
    if request_rate:
        return max(n_requests / request_rate, busy)
    return busy


def describe(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
