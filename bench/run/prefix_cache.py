"""The prefix cache a cell should hit and what a row says it hit: pure functions (no engine involved).

A cell is meant cold unless its workload shares a prefix on purpose (the shared-prefix family, the later
turns of a conversation) with prefix caching on; :func:`expected_hit_tokens` is what an ideal cache at the
engine's reuse unit serves it; :func:`measured_hits` reads what the engine says it served, from its
requests' own cached-token counts, else its counters' difference over the cell.
"""
from __future__ import annotations

import pandas as pd

from kvbench.backends.types import KVPool, PrefixCacheCounters, RequestResult
from kvbench.kv.geometry import KVGeometry
from kvbench.kv.rules import KVQuestion, KVRules
from kvbench.run.cells import Cell
from kvbench.store.schema import CellRow
from kvbench.workloads import Workload

COLD_HIT_RATE = 0.01  # a cell meant cold whose prefix cache served more of its prompt tokens is flagged


def meant_warm(workload: Workload, cell: Cell) -> bool:
    """Whether a cell is meant to hit the prefix cache: the shared-prefix family, and the turns after the
    first of a conversation, unless the cell's server variant has prefix caching off. Every other cell is
    meant cold (its prompts share nothing with anything sent before)."""
    if cell.prefix_caching is False:
        return False
    return workload.family == "shared_prefix" or (workload.family == "multi_turn" and cell.turn >= 2)


def expected_hit_tokens(workload: Workload, cell: Cell, n_requests: int, unit: int | None,
                        prefix_seen: bool) -> int:
    """Prompt tokens of a cell that an ideal prefix cache reusing whole units of ``unit`` tokens (vLLM's
    block; None: the engine has no prefix cache) serves from the cache: per request, the shared prefix, or
    a later turn's previous prompt (its stand-in reply differs from what the engine generated, so only the
    prompt before it can match), rounded down to whole units. The first request that carries the shared
    prefix on an engine start computes it (``prefix_seen``: an earlier cell of this start sent it).
    Concurrent first requests, and an engine that caches per slot (llama.cpp), can hit less: the ideal,
    not a simulation of the engine."""
    if unit is None or not meant_warm(workload, cell):
        return 0
    if workload.family == "shared_prefix":
        per_request = workload.shared_prefix_tokens // unit * unit
        return per_request * (n_requests if prefix_seen else max(0, n_requests - 1))
    previous = workload.prompt_tokens_sent(cell.prompt_tokens, cell.turn - 1)
    return previous // unit * unit * n_requests


def measured_hits(results: list[RequestResult], before: PrefixCacheCounters | None,
                  after: PrefixCacheCounters | None) -> tuple[int, int, str] | None:
    """(prompt tokens found in the cache, prompt tokens looked up, where from) of a cell, or None where the
    engine says nothing: its requests' cached-token counts where any has one, else its counters' rise."""
    reported = [r for r in results if r.prompt_tokens_cached is not None]
    if reported:
        return (sum(r.prompt_tokens_cached for r in reported),
                sum(r.prompt_tokens_reported or r.prompt_tokens_sent for r in reported),
                f"cached prompt tokens per request ({len(reported)} of {len(results)} requests reported them)")
    if before is not None and after is not None and after.queried_tokens > before.queried_tokens:
        return (round(after.hit_tokens - before.hit_tokens), round(after.queried_tokens - before.queried_tokens),
                after.source)
    return None


def cold_hit_flag(expected: str, hit_rate: float | None) -> str | None:
    """The flag of a cell meant cold that the prefix cache served (None: it did not)."""
    if expected != "cold" or (hit_rate or 0) <= COLD_HIT_RATE:
        return None
    return (f"prefix cache hit on a cell meant cold: {hit_rate:.1%} of its prompt tokens came from the cache "
            "(the same prompts sent before? see --prompt-salt)")


def prefix_cache_columns(row: CellRow, w: Workload, cell: Cell, results: list[RequestResult], rules: KVRules | None,
                         geometry: KVGeometry, kv_dtype: str, pool: KVPool | None,
                         counters: tuple[PrefixCacheCounters | None, PrefixCacheCounters | None],
                         prefix_seen: bool) -> None:
    """A row's prefix-cache columns: meant cold or warm, the ideal hit rate at the engine's reuse unit (its
    reported pool's block where it has one), what the engine says it hit, and a flag on a cold cell that hit."""
    row.prefix_cache_expected = "warm" if meant_warm(w, cell) else "cold"
    sent = sum(r.prompt_tokens_sent for r in results)
    if rules is not None and sent:
        details = pool.details if pool else {}
        unit = rules.prefix_reuse_unit(KVQuestion(geometry, kv_dtype, device=details.get("device", "gpu")), details)
        row.prefix_cache_expected_hit_rate = expected_hit_tokens(w, cell, len(results), unit, prefix_seen) / sent
    hits = measured_hits(results, *counters)
    if hits is None:
        row.prefix_cache_source = "not reported"
        return
    row.prefix_cache_hit_tokens, row.prefix_cache_query_tokens, row.prefix_cache_source = hits
    row.prefix_cache_hit_rate = hits[0] / hits[1] if hits[1] else None
    if flag := cold_hit_flag(row.prefix_cache_expected, row.prefix_cache_hit_rate):
        row.flags.insert(0, flag)
        if row.status == "ok":
            row.status = "flagged"


def cache_state(rows: pd.DataFrame) -> str:
    """ "warm" where the prefix cache served more than COLD_HIT_RATE of a cell's prompt tokens in any of its
    repeats, "cold" where it served less in all, "not reported" where the engine (or the run) said nothing."""
    rates = rows.prefix_cache_hit_rate.dropna() if "prefix_cache_hit_rate" in rows else pd.Series(dtype=float)
    if rates.empty:
        return "not reported"
    return "warm" if (rates > COLD_HIT_RATE).any() else "cold"


def cold_cells_that_hit(cells: pd.DataFrame) -> int:
    """Rows meant cold whose prefix cache served more than COLD_HIT_RATE of their prompt tokens."""
    if "prefix_cache_expected" not in cells:
        return 0
    return int(((cells.prefix_cache_expected == "cold") & (cells.prefix_cache_hit_rate.fillna(0) > COLD_HIT_RATE)).sum())
