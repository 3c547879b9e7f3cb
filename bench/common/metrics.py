"""Latency and throughput metrics: the one place they are defined (docs/metrics.md says the same).

All times are client-side ``time.perf_counter()`` seconds: a request's send time, and the arrival time
of every streamed chunk that carried at least one output token.

- **TTFT**: arrival of the first token-carrying chunk minus the send time.
- **ITL** (inter-token latency): one sample per output token after the first chunk. A chunk that carries
  k tokens and arrives g seconds after the previous token-carrying chunk contributes k samples of g/k,
  so engines that batch tokens into chunks are neither rewarded nor punished. Chunks that arrive together
  (in one read from the socket, so with one timestamp) count as one chunk of all their tokens. Tokens that share the
  first chunk give no ITL sample (their latency is in TTFT). Percentiles pool the samples of all
  requests of a cell: they are per gap, not per-request averages.
- **TPOT** (time per output token): per request, (arrival of the last token-carrying chunk - TTFT) /
  (output tokens - 1), excluding the first token; undefined (None) where ITL is: for a request with one
  output token, or whose tokens all arrived with the first chunk (one read from the socket: no gap was
  measured, so its TPOT is unknown, not 0).
- **E2E**: arrival of the last chunk (or the end of the stream) minus the send time.
- **Output tokens**: the tokens the client received in chunks (cross-checked against the engine's own count).
- **Output tokens/s** of a cell: all output tokens of its successful requests divided by the cell's wall
  time, from its first send to its last completion; **total tokens/s** adds the prompt tokens;
  **requests/s** counts the successful requests.
- **Goodput**: successful requests whose TTFT <= the SLO's TTFT and whose TPOT <= the SLO's TPOT (each
  bound only when given), per second of the same wall time. A request whose TPOT is undefined is not
  known to meet a TPOT bound and does not count as within it.
- **Successful** = met the token contract (:func:`request_verdict`): no error, the engine read exactly
  the prompt tokens sent, and generated exactly the output tokens asked. Failed, truncated and short
  requests are counted separately and kept out of every figure above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestTimes:
    t_sent: float
    chunk_times: tuple[float, ...]
    chunk_tokens: tuple[int, ...]
    t_done: float | None = None

    @classmethod
    def of(cls, result) -> RequestTimes:
        """The times of one streamed request (a :class:`backends.base.RequestResult`)."""
        return cls(result.t_sent, tuple(result.chunk_times), tuple(result.chunk_tokens), result.t_done)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.t_sent if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        if not self.chunk_times:
            return None
        end = max(self.chunk_times[-1], self.t_done) if self.t_done is not None else self.chunk_times[-1]
        return end - self.t_sent

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if n < 2 or not self.chunk_times or self.chunk_times[-1] == self.chunk_times[0]:
            return None  # one token, or all of them in the first read: no gap measured (no ITL sample either)
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)

    def itl_samples(self) -> list[float]:
        """One sample per token after the first arrival: chunks that arrived together (one read from the
        socket, hence one timestamp) count as one chunk of their tokens together."""
        samples: list[float] = []
        times, tokens = self.chunk_times, self.chunk_tokens
        i = 1
        while i < len(times) and times[i] == times[0]:  # tokens that came with the first: TTFT only
            i += 1
        previous = times[0] if times else 0.0
        while i < len(times):
            t, k = times[i], tokens[i]
            i += 1
            while i < len(times) and times[i] == t:
                k += tokens[i]
                i += 1
            samples.extend([(t - previous) / k] * k)
            previous = t
        return samples


def percentiles(values, prefix: str) -> dict[str, float | None]:
    """{prefix_mean, prefix_p50, prefix_p90, prefix_p99} (linear interpolation), None when empty."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    out: dict[str, float | None] = {f"{prefix}_mean": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


Verdict = Literal["ok", "failed", "truncated", "short", "long", "miscounted"]


def request_verdict(error: str | None, prompt_sent: int, prompt_reported: int | None, output_asked: int,
                    output_reported: int | None, output_received: int) -> Verdict:
    """Whether one request met the token contract, and if not, how it broke it.

    failed: an error, or no token at all; truncated: the engine read fewer prompt tokens than were sent
    (or more: then "miscounted"); short / long: fewer / more output tokens than asked (by the engine's
    count, or by the tokens the client received when the engine reports none); miscounted: the engine's
    output count and the tokens received disagree."""
    if error or output_received == 0:
        return "failed"
    if prompt_reported is not None and prompt_reported != prompt_sent:
        return "truncated" if prompt_reported < prompt_sent else "miscounted"
    produced = output_reported if output_reported is not None else output_received
    if produced < output_asked:
        return "short"
    if produced > output_asked:
        return "long"
    if output_reported is not None and output_received != output_reported:
        return "miscounted"
    return "ok"


def within_slo(r: RequestTimes, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    if slo_ttft_s is not None and (r.ttft is None or r.ttft > slo_ttft_s):
        return False
    if slo_tpot_s is not None and (r.tpot is None or r.tpot > slo_tpot_s):
        return False  # an undefined TPOT is unknown, not within the bound
    return True


def cell_metrics(requests: list[RequestTimes], prompt_tokens: list[int], slo_ttft_s: float | None = None,
                 slo_tpot_s: float | None = None) -> dict[str, float | int | None]:
    """Metrics of one cell from its successful requests (and their prompt lengths)."""
    out: dict[str, float | int | None] = {}
    out.update(percentiles([r.ttft for r in requests], "ttft_s"))
    out.update(percentiles([s for r in requests for s in r.itl_samples()], "itl_s"))
    out.update(percentiles([r.tpot for r in requests], "tpot_s"))
    out.update(percentiles([r.e2e for r in requests], "e2e_s"))
    done = [r for r in requests if r.chunk_times]
    if done:
        start = min(r.t_sent for r in done)
        end = max(r.t_sent + r.e2e for r in done)
        wall = end - start
        output = sum(r.output_tokens for r in done)
        out["wall_s"] = wall
        out["output_tokens_per_s"] = output / wall if wall > 0 else None
        out["total_tokens_per_s"] = (output + sum(prompt_tokens)) / wall if wall > 0 else None
        out["requests_per_s"] = len(done) / wall if wall > 0 else None
        good = sum(within_slo(r, slo_ttft_s, slo_tpot_s) for r in done)
        out["goodput_requests_per_s"] = good / wall if wall > 0 and (slo_ttft_s or slo_tpot_s) else None
    else:
        out.update({"wall_s": None, "output_tokens_per_s": None, "total_tokens_per_s": None, "requests_per_s": None,
                    "goodput_requests_per_s": None})
    return out
