"""What a cell's speculative decoding drafted and what the target accepted: pure functions (no engine involved).

The figures come from the engine (docs/speculation.md): its requests' own counts where it reports them
(llama.cpp's ``timings.draft_n``/``draft_n_accepted``), else its cumulative counters' rise over the cell (vLLM's
``vllm:spec_decode_num_*``); the number of drafts (verification steps) from the counters only, where the engine
keeps one. Nothing is estimated: a figure the engine does not give is None.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.backends.types import RequestResult, SpeculationCounters
from kvbench.store.schema import CellRow


@dataclass(frozen=True)
class Drafted:
    """A cell's speculation as the engine reported it."""

    draft_tokens: int  # proposed by the drafter
    accepted_tokens: int  # of those, accepted by the target
    drafts: int | None  # verification steps that carried a draft (None: the engine does not count them)
    source: str


def counter_rise(before: SpeculationCounters | None, after: SpeculationCounters | None) -> Drafted | None:
    """The counters' rise over a cell, or None where they were not read or nothing was drafted."""
    if before is None or after is None or after.draft_tokens <= before.draft_tokens:
        return None
    drafts = None if before.drafts is None or after.drafts is None else round(after.drafts - before.drafts)
    return Drafted(round(after.draft_tokens - before.draft_tokens),
                   round(after.accepted_tokens - before.accepted_tokens), drafts, after.source)


def measured(results: list[RequestResult], before: SpeculationCounters | None,
             after: SpeculationCounters | None) -> Drafted | None:
    """A cell's drafted and accepted tokens: its requests' own counts where any reported them (the drafts from
    the counters beside), else the counters' rise; None where the engine says nothing."""
    rise = counter_rise(before, after)
    reported = [r for r in results if r.spec_draft_tokens is not None]
    if reported:
        return Drafted(sum(r.spec_draft_tokens for r in reported),
                       sum(r.spec_accepted_tokens or 0 for r in reported), rise.drafts if rise else None,
                       f"drafted/accepted tokens per request ({len(reported)} of {len(results)} requests drafted)"
                       + (f"; drafts: {rise.source}" if rise and rise.drafts is not None else ""))
    return rise


def acceptance_rate(d: Drafted) -> float | None:
    """Accepted draft tokens over drafted ones."""
    return d.accepted_tokens / d.draft_tokens if d.draft_tokens else None


def tokens_per_step(d: Drafted) -> float | None:
    """Mean tokens a verification step yields: its accepted drafts plus the target's own token (vLLM's "mean
    acceptance length", 1 + accepted / drafts); None where the engine does not count its drafts."""
    return 1 + d.accepted_tokens / d.drafts if d.drafts else None


def steps_per_output_token(d: Drafted, output_tokens: int) -> float | None:
    """The target's forward passes per output token: every pass (the prompt's included) yields one token of
    its own, accepted drafts come free, so passes = output tokens - accepted (1.0: no speculation; lower is
    better). None without output tokens or where more were accepted than generated (counters that also counted
    another client's requests)."""
    if output_tokens <= 0 or d.accepted_tokens > output_tokens:
        return None
    return (output_tokens - d.accepted_tokens) / output_tokens


def speculation_columns(row: CellRow, method: str, has_speculation: bool, results: list[RequestResult],
                        counters: tuple[SpeculationCounters | None, SpeculationCounters | None]) -> None:
    """A row's speculation columns: the drafter the engine was started with ("": none, or not known: an
    attached server), and what the engine says it drafted and accepted: 0 where a drafter ran and its counters,
    read around the cell, did not rise (n-gram lookup on free text), "not reported" where it said nothing."""
    row.spec_method = method
    d = measured(results, *counters)
    before, after = counters
    if d is None and method and before is not None and after is not None and \
            after.draft_tokens == before.draft_tokens:  # read around the cell, not risen: it drafted nothing
        d = Drafted(0, 0, None if before.drafts is None or after.drafts is None else 0, after.source)
    if d is None:  # an engine that can speculate but said nothing; no source for one that cannot
        row.spec_source = "not reported" if has_speculation and method else None
        return
    row.spec_draft_tokens, row.spec_accepted_tokens, row.spec_drafts = d.draft_tokens, d.accepted_tokens, d.drafts
    row.spec_source = d.source
    row.spec_acceptance_rate = acceptance_rate(d)
    row.spec_tokens_per_step = tokens_per_step(d)
    output = sum(sum(r.chunk_tokens) for r in results)
    row.spec_steps_per_output_token = steps_per_output_token(d, output)
