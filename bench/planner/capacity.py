"""The pool an engine makes of a deployment, in the engine's own units: what it logs at start.

- An engine whose rules size a block pool (``bytes_per_block`` and ``blocks_per_sequence``: vLLM) sizes a pool from a KV budget in bytes: budget //
  bytes per block blocks (its null block among them). It reports the pool by the requests at the server's
  limit it holds: blocks / the blocks one request at the limit takes (vLLM's "Maximum concurrency for L
  tokens per request: X.XXx") and that times the limit ("KV cache size: N tokens").
- An engine without blocks (llama.cpp) allocates its cells at start from the limit and the slots
  (``-c limit x slots -np slots``): the full-attention cache's cells over all streams, and the window cache's.

Both ask only the engine's rules (``bytes_per_block``, ``blocks_per_sequence``, :meth:`KVRules.answer`,
:meth:`KVRules.deployment`, :meth:`KVRules.sequences_in_pool`); neither switches on an engine's name.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .deploy import Setup, _largest, with_engine
from .shared import PlanError


@dataclass(frozen=True)
class Capacity:
    engine: str
    limit: int  # tokens per request the server is started with
    pool_tokens: int  # block engines: blocks x block size; cell engines: the full-attention cells, all streams
    sequences: int | None  # requests at the limit the pool serves at once (KVRules.sequences_in_pool)
    window_tokens: int = 0  # cell engines: the window cache's cells, all streams (0: none)
    blocks: int | None = None  # block engines: the blocks the budget gives, the null block among them
    block_size: int | None = None
    blocks_per_request: int | None = None  # block engines: one request at the limit, every group

    @property
    def requests_at_limit(self) -> float | None:
        """Requests at the limit the pool holds, null block counted: what vLLM logs as its maximum concurrency."""
        return self.blocks / self.blocks_per_request if self.blocks_per_request else None

    @property
    def tokens_at_limit(self) -> int | None:
        """:attr:`requests_at_limit` x the limit, truncated: vLLM's "KV cache size: N tokens"."""
        r = self.requests_at_limit
        return None if r is None else int(r * self.limit)


def kv_room(s: Setup) -> float:
    """The KV budget a deployment leaves per GPU: usable memory less the weights, the overhead and the
    engine's host caches (on a CPU)."""
    if s.usable is None or s.weights_per_gpu is None:
        raise PlanError("the KV budget needs a GPU (--gpu) or a memory wall (--memory), and known weights")
    return s.usable - s.weights_per_gpu - s.overhead - s.host_bytes()


def capacity(s: Setup, budget: float | None = None) -> Capacity:
    """The pool the engine of ``s`` makes: of ``budget`` bytes per GPU (None: :func:`kv_room`) where it has
    blocks, of the limit and the batch (``s.limit``, ``s.batch``) where it allocates at start."""
    rules, limit = s.rules, s.limit
    if rules.has_blocks and not rules.pool_from_budget:
        raise PlanError(f"{rules.engine}'s rules do not say how its pool is sized from a budget")
    if rules.pool_from_budget:
        q = s.question(context=limit, batch=1)
        block = rules.answer(s.question(context=1, batch=1)).tokens_full  # one token takes one whole block
        blocks = int((kv_room(s) if budget is None else budget) // s.bytes_per_block(q))
        details = {"block_size": block, "num_gpu_blocks": blocks, "device": s.device, "version": s.version,
                   "capability": s.capability, "max_model_len": limit, **s.options}
        return Capacity(rules.engine, limit, blocks * block,
                        rules.sequences_in_pool(s.geometry, blocks * block, limit, details),
                        blocks=blocks, block_size=block, blocks_per_request=rules.blocks_per_sequence(q, limit))
    a = s.kv(context=limit, batch=s.batch, limit=limit)
    return Capacity(rules.engine, limit, a.tokens_full, rules.sequences_in_pool(s.geometry, a.tokens_full, limit, {}),
                    window_tokens=a.tokens_windowed)


@dataclass(frozen=True)
class EnginePool:
    """One engine's pool of a deployment, for the side-by-side table (`kvbench plan --compare-engines`)."""

    engine: str
    kv_dtype: str  # the engine's auto KV dtype for the model
    bytes_per_token: float  # per GPU, as the engine stores it, windows not applied
    budget: float  # the KV budget per GPU: usable memory less the weights and the engine's overhead
    tokens: int  # tokens of one full-attention layer the pool holds, all requests; 0 where nothing fits
    sequences: int  # requests at the limit the pool holds at once
    sized: str  # "from the budget" (the engine sizes its pool from the bytes left) or "for the limit"
    note: str  # the engine's rounding and storage (KVAnswer.note)
    overhead_source: str
    share: str = ""  # the memory the engine takes: its own fraction of CUDA's total, or what the margin leaves
    speculation: str = ""  # with --speculative: where the engine keeps the drafter's KV, or that it has no such method
    tokens_without: int | None = None  # with --speculative: the pool without the drafter
    sequences_without: int | None = None


def _pool(t: Setup) -> tuple[float, int, int, str]:
    """(KV budget per GPU, pool tokens, requests at the limit at once, how sized) of one engine's deployment."""
    budget = kv_room(t)
    if t.rules.pool_from_budget:
        cap = capacity(t, max(budget, 0.0))
        # the requests at the limit the blocks hold x the limit: what vLLM logs as its KV cache size, and
        # for paged pools without groups the pool's own tokens, a partial page off
        tokens = cap.blocks * t.limit // cap.blocks_per_request if cap.blocks_per_request else 0
        return budget, tokens, cap.sequences or 0, "from the budget"
    n = max(0, _largest(lambda b: t.fits(context=t.limit, batch=b, limit=t.limit), 1, 1 << 20))
    tokens = t.kv(context=t.limit, batch=n, limit=t.limit).tokens_full if n else 0
    return budget, tokens, n, "for the limit"


def engine_pools(s: Setup, engines: list[str], options: dict[str, dict] | None = None) -> list[EnginePool]:
    """Each engine's pool of the deployment ``s`` (its GPU, model and limit) under its own rules and auto KV
    dtype (``s.kv_dtype`` where it is not auto: every engine asked takes it) and its own ``options[engine]``: an
    engine that sizes its pool from a budget (:attr:`KVRules.pool_from_budget`) makes it of the KV
    budget and holds :meth:`KVRules.sequences_in_pool` requests at the limit; one that allocates for its limit
    and slots holds the most requests at the limit that fit in the same memory, and their tokens."""
    out = []
    for engine in engines:
        t = with_engine(s, engine, (options or {}).get(engine))
        if s.kv_dtype.lower() != "auto":
            t = replace(t, kv_dtype=s.kv_dtype)
        spec, said, without = t.speculation, "", (None, None)
        if spec is not None and t.rules.speculative_flag(spec) is None:  # planned without it, and said so
            t, said = replace(t, spec_method=None), f"no {spec.method} speculative decoding"
        elif spec is not None:
            said = f"{spec.method}: {t.draft().where}"
            without = _pool(replace(t, spec_method=None))[1:3]
        budget, tokens, sequences, sized = _pool(t)
        q = t.question(context=t.limit, batch=1)
        a = t.rules.answer(q)
        mem = t.startup
        out.append(EnginePool(engine, a.dtype, a.bytes_per_token, budget, tokens, sequences, sized, a.note,
                              f"own startup rule ({mem.fraction:g} of CUDA's total; {mem.klass}"
                              f"{'' if mem.verified else ', unverified'})" if mem is not None else t.overhead_source,
                              f"{mem.fraction:g} of CUDA's total" if mem is not None else f"{1 - t.margin:.0%} of the memory",
                              said, *without))
    return out
