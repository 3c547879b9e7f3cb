"""The verdict as the engine would log it at startup: its KV pool, its tokens and the requests at the limit it
holds at once, or the refusal it would print, from the engine's own memory rule (:attr:`Setup.startup`).
Asks only the engine's rules (``startup_memory``, ``startup_refusal``, the pool hooks); never its name."""
from __future__ import annotations

from kvbench.kv.units import GIB

from .capacity import capacity, kv_room
from .deploy import Setup


def startup_view(s: Setup) -> dict | None:
    """What the engine would report at start for the deployment ``s`` (None without a startup rule)."""
    mem = s.startup
    if mem is None:
        return None
    available = kv_room(s)
    out = {**mem.as_dict(), "weights_bytes": s.weights_per_gpu, "kv_budget_bytes": available,
           "gpu_memory_bytes": s.gpu.bytes, "kept_free_bytes": s.kept_free, "refusal": None, "fix": None}
    rules = s.rules
    one = s.kv_bytes(context=s.limit, batch=1, limit=s.limit)
    if rules.pool_from_budget:
        cap = capacity(s, max(available, 0.0))
        q = s.question(context=s.limit, batch=1)
        per_block = rules.bytes_per_block(q)
        pool = cap.blocks * per_block
        tokens = cap.blocks * s.limit // cap.blocks_per_request if cap.blocks_per_request else cap.pool_tokens
        requests = cap.sequences or 0
        longest = _longest(s, available)
        out.update(pool_bytes=pool, pool_tokens=tokens, blocks=cap.blocks, requests_at_limit=requests,
                   concurrency=cap.requests_at_limit)
    else:
        pool = s.kv_bytes(context=s.limit, batch=s.batch, limit=s.limit)
        requests = s.batch if available >= pool else 0
        tokens = s.kv(context=s.limit, batch=s.batch, limit=s.limit).tokens_full
        longest = _longest(s, available)
        available, one = available + pool, pool  # a cache allocated for its slots: refused when it does not fit
        out.update(pool_bytes=pool, pool_tokens=tokens, blocks=None, requests_at_limit=requests, concurrency=None)
    refusal = rules.startup_refusal(s.startup_question(), mem, available, one, longest)
    if refusal is not None:
        out.update(refusal=refusal.message, fix=refusal.fix)
        line = f"{mem.label} would refuse to start: \"{refusal.message}\" Fix: {refusal.fix}"
    else:
        unit = "pool" if rules.pool_from_budget else "cache"
        line = (f"{mem.label} would start with a {out['pool_bytes'] / GIB:.2f} GiB KV {unit} "
                f"({out['pool_tokens']:,} tokens): {out['requests_at_limit']:,} request"
                f"{'s' * (out['requests_at_limit'] != 1)} of {s.limit:,} tokens at once")
    if not mem.verified:
        line += f" ({mem.verified_note})"
    out["line"] = line
    return out


def _longest(s: Setup, available: float) -> int:
    """The longest one request the KV budget holds (what the engine's refusal proposes as the limit)."""
    from .deploy import _largest
    if available <= 0:
        return 0
    return max(0, _largest(lambda n: s.kv_bytes(context=n, batch=1, limit=n) <= available, 1, s.limit))
