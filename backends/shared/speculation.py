"""Speculative-decoding counters as llama-server and vLLM both export them on /metrics: three counters of
draft tokens, accepted tokens and drafts (verification steps), named alike (vLLM's SpecDecodingProm,
vllm/v1/spec_decode/metrics.py; llama-server's ``llamacpp:spec_decode_num_*``, tools/server/server-context.cpp),
each engine with its own prefix."""
from __future__ import annotations

from ..prometheus import gauge_sum
from ..types import SpeculationCounters


def counter_names(prefix: str) -> tuple[str, str, str]:
    """(draft tokens, accepted tokens, drafts) as ``prefix`` exports them (prometheus_client adds _total)."""
    return tuple(f"{prefix}spec_decode_num_{what}_total" for what in ("draft_tokens", "accepted_tokens", "drafts"))


def read_counters(samples: dict[str, list], prefix: str) -> SpeculationCounters | None:
    """The counters from a /metrics page's samples (summed over engines), or None where the page lacks the
    token counters (a server started without a drafter exports none on vLLM)."""
    names = counter_names(prefix)
    drafted, accepted, drafts = (gauge_sum(samples, name) for name in names)
    if drafted is None or accepted is None:
        return None
    return SpeculationCounters(drafted, accepted, drafts,
                               f"{names[0]}, {names[1]}, {names[2]} (/metrics, difference over the cell)")
