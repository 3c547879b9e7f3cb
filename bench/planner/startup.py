"""The verdict as the engine would log it at startup: its KV pool, its tokens and the requests at the limit it
holds at once, or the refusal it would print, from the engine's own memory rule (:attr:`Setup.startup`).
Asks only the engine's rules (``startup_memory``, ``startup_refusal``, the pool hooks); never its name."""
from __future__ import annotations

import functools
import math
import tomllib
from pathlib import Path

from kvbench.kv.rules import KVRuleError
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
        per_block = s.bytes_per_block(q)
        pool = cap.blocks * per_block
        tokens = cap.blocks * s.limit // cap.blocks_per_request if cap.blocks_per_request else cap.pool_tokens
        requests = cap.sequences or 0
        longest = _longest(s, available)
        out.update(pool_bytes=pool, pool_tokens=tokens, blocks=cap.blocks, requests_at_limit=requests,
                   concurrency=cap.requests_at_limit)
    elif mem.pool_fills_budget:  # its warmup gives the KV blocks what the budget leaves (TGI)
        q = s.question(context=s.limit, batch=1)
        per_token = rules.bytes_per_token(q)
        block = rules.answer(s.question(context=1, batch=1)).tokens_full  # one token takes one whole block
        tokens = int(max(available, 0.0) // (per_token * block)) * block
        requests = tokens // s.limit
        longest = _longest(s, available)
        out.update(pool_bytes=tokens * per_token, pool_tokens=tokens, blocks=tokens // block,
                   requests_at_limit=requests, concurrency=tokens / s.limit)
    else:
        pool = s.kv_bytes(context=s.limit, batch=s.batch, limit=s.limit)
        requests = s.batch if available >= pool else 0
        tokens = s.kv(context=s.limit, batch=s.batch, limit=s.limit).tokens_full
        longest = _longest(s, available, s.batch)  # every slot at it: the cache is allocated for all of them
        one = pool  # a cache allocated for all its slots at start: refused when it does not fit
        out.update(pool_bytes=pool, pool_tokens=tokens, blocks=None, requests_at_limit=requests, concurrency=None)
    refusal = rules.startup_refusal(s.startup_question(), mem, available, one, longest)
    if refusal is not None:
        fix = refusal.fix
        if s.limit_source.startswith("the model's") and s.context < s.limit and longest >= s.context:
            # the server's default limit is the model's: the length asked is the limit the user wants
            fix = (f"{rules.limit_flag(s.context, s.batch)}, the length asked (the longest it would take: "
                   f"{refusal.fix})")
        out.update(refusal=refusal.message, fix=fix, engine_fix=refusal.fix)
        line = f"{mem.label} would refuse to start: \"{refusal.message}\" Fix: {fix}"
    else:
        unit = "pool" if rules.pool_from_budget or mem.pool_fills_budget else "cache"
        line = (f"{mem.label} would start with a {out['pool_bytes'] / GIB:.2f} GiB KV {unit} "
                f"({out['pool_tokens']:,} tokens): {out['requests_at_limit']:,} request"
                f"{'s' * (out['requests_at_limit'] != 1)} of {s.limit:,} tokens at once")
    if not mem.verified:
        line += f" ({accuracy_note(mem.klass) or mem.verified_note})"
    out["line"] = line
    out["accuracy"] = rule_accuracy(mem.klass)
    return out


ACCURACY_FILE = Path(__file__).with_name("startup_accuracy.toml")


@functools.lru_cache(maxsize=1)
def _accuracy() -> dict:
    return tomllib.loads(ACCURACY_FILE.read_text()) if ACCURACY_FILE.exists() else {}


def rule_accuracy(klass: str) -> dict | None:
    """How far the rule of this class of deployment was from the public startup logs of its class, each planned
    with the constants fitted without its own source (kvbench.selfcheck.startup_fit writes it)."""
    return _accuracy().get(f"rule {klass}")


def accuracy_note(klass: str) -> str:
    """The verdict's own error, for a class not every log of which holds: what a user should expect."""
    a = rule_accuracy(klass)
    if a and not a.get("pools") and a.get("pools_own_source_only"):
        return (f"unverified: the {a['pools_own_source_only']} public startup logs of class '{klass}' each read a "
                "constant only their own source measures, so none was planned without its own source's fit; "
                "docs/plan.md")
    if a and not a.get("pools") and a.get("buffers"):
        return (f"unverified: on {a['buffers_logs']} public startup logs of class '{klass}', each planned without "
                f"its own source's fit, {a['buffers_within']} of {a['buffers']} buffer figures (KV cache, compute "
                "buffer, free at load) within 5 % or 0.5 GiB; docs/plan.md")
    if not a or not a.get("pools"):
        return ""
    return (f"unverified: on {a['pools']} public startup logs of class '{klass}' from {a['sources']} sources, each "
            f"planned without its own source's fit, the KV budget was off by {a['mae_gib']:.2f} GiB on average "
            f"({a['mape_pct']:.0f} %), {a['worst_gib']:.2f} GiB at worst; docs/plan.md")


def _longest(s: Setup, available: float, batch: int = 1) -> int:
    """The longest request the KV budget holds, ``batch`` of them at once (what the engine's refusal proposes as
    the limit)."""
    from .deploy import _largest
    if available <= 0:
        return 0
    return max(0, _largest(lambda n: s.kv_bytes(context=n, batch=batch, limit=n) <= available, 1, s.limit))


def planned_figures(s: Setup, kv_budget: float | None = None, pool_tokens_cap: int | None = None) -> dict | None:
    """What the engine of ``s`` would log at start by the planner's rules, keyed as the engine's own figures are
    (``Backend.startup_figures_from_log``: ``kv_budget_bytes``, ``kv_pool_bytes``, ``pool_tokens``, ``blocks``,
    ``concurrency`` at ``concurrency_limit``, ``one_request_bytes``, ``weights_bytes``, ``cuda_total_bytes``,
    ``terms``, ``refusal``), so
    that a run can set each beside the engine's (run.json ``startup_checks``). Every byte figure is per GPU.

    ``kv_budget``: the KV bytes per GPU the server was told to take (vLLM's --kv-cache-memory-bytes): its pool is
    that budget's (:func:`capacity`), not the engine's startup rule's. ``pool_tokens_cap``: a cap on the pool's
    tokens the server was given (it only lowers the pool). None where the engine sizes its pool itself on a device
    kvbench has no startup rule for (a CPU without a given budget)."""
    rules = s.rules
    out: dict = {"limit": s.limit, "kv_dtype": s.resolved_kv_dtype(), "tp": s.tp, "gpu": s.gpu.name if s.gpu else None}
    if kv_budget is not None and rules.pool_from_budget:
        cap = capacity(s, float(kv_budget))
        per_block = s.bytes_per_block(s.question(context=s.limit, batch=1))
        out.update(rule="the KV budget the server was given", kv_budget_bytes=float(kv_budget),
                   kv_pool_bytes=cap.blocks * per_block, pool_tokens=cap.tokens_at_limit, blocks=cap.blocks,
                   concurrency=cap.requests_at_limit, concurrency_limit=s.limit, requests_at_limit=cap.sequences)
    elif s.startup is not None:
        view = startup_view(s)
        mem = s.startup
        delta = sum(t["bytes"] for t in view["terms"] if t["term"] == "weights as loaded")
        out.update(rule=f"{mem.label}'s startup rule", klass=view["class"], verified=view["verified"],
                   verified_note=view["verified_note"], fraction=view["fraction"],
                   kv_budget_bytes=view["kv_budget_bytes"], kv_pool_bytes=view["pool_bytes"],
                   pool_tokens=view["pool_tokens"], blocks=view.get("blocks"), concurrency=view.get("concurrency"),
                   concurrency_limit=s.limit if view.get("concurrency") is not None else None,
                   requests_at_limit=view["requests_at_limit"], weights_bytes=(view["weights_bytes"] or 0) + delta,
                   cuda_total_bytes=view["cuda_bytes"],
                   terms={t["term"]: t["bytes"] for t in view["terms"] if t["term"] != "weights as loaded"},
                   refusal=view["refusal"], fix=view["fix"], line=view["line"])
    elif not rules.pool_from_budget:
        a = s.kv(context=s.limit, batch=s.batch, limit=s.limit)
        out.update(rule=f"allocated for {s.batch} x {s.limit:,} tokens", kv_pool_bytes=a.bytes_per_gpu,
                   pool_tokens=a.tokens_full, requests_at_limit=s.batch,
                   terms={term: b for term, b, _ in s.host() if b})  # on a CPU: its host buffers, as logged
    else:
        return None
    try:  # the KV one request at the limit takes on a GPU (what vLLM's refusal says is needed)
        out.update(one_request_bytes=rules.answer(s.question(context=s.limit, batch=1)).bytes_per_gpu,
                   one_request_limit=s.limit)
    except KVRuleError:
        pass
    if pool_tokens_cap is not None and out.get("pool_tokens") and out["pool_tokens"] > pool_tokens_cap:
        # the pool the server was given instead of the one its rule makes (the KV budget stays the rule's)
        scale = pool_tokens_cap / out["pool_tokens"]
        out.update(pool_tokens=pool_tokens_cap, kv_pool_bytes=out["kv_pool_bytes"] * scale,
                   rule=out["rule"] + f", capped at the {pool_tokens_cap:,} tokens it was given")
        if out.get("blocks") is not None:
            out["blocks"] = int(out["blocks"] * scale)
        if out.get("concurrency") is not None:
            out["concurrency"] *= scale
            out["requests_at_limit"] = math.floor(out["concurrency"] + 1e-9)
        out.pop("line", None)  # the rule's own pool, not this one
    return {k: v for k, v in out.items() if v is not None}
