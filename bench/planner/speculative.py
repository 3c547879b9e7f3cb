"""What speculative decoding costs a deployment, as ``kvbench plan --speculative`` prints it: the drafter's
weights and KV, where the engine keeps its KV (:meth:`kvbench.kv.rules.KVRules.draft_kv`), and the pool in tokens
and requests at once with and without the drafter. Asks only the engine's rules; never its name."""
from __future__ import annotations

from dataclasses import replace

from kvbench.kv.units import fmt_gib

from .deploy import Setup
from .shared import PlanError
from .startup import startup_view


def check_speculation(s: Setup) -> None:
    """A method the engine has (its rules give a flag for it), else one line."""
    spec = s.speculation
    if spec is not None and s.rules.speculative_flag(spec) is None:
        who = s.rules.engine if s.engine else "the plain formula (give --engine: where a drafter's KV lives is each engine's)"
        raise PlanError(f"--speculative {spec.method}: {who} has no such speculative decoding kvbench plans")


def _figures(s: Setup) -> dict:
    """The pool's tokens and requests at the limit (an engine's startup rule), else the requests at once."""
    if s.startup is not None:
        v = startup_view(s)
        return {"pool_tokens": v.get("pool_tokens"), "requests_at_limit": v.get("requests_at_limit"),
                "refusal": v.get("refusal")}
    if s.gpu is not None and s.weights.bytes is not None:
        o = s.outcome()
        return {"max_concurrency": o.max_concurrency, "longest_request": o.longest_request}
    return {}


def _said(f: dict, limit: int) -> str:
    if f.get("refusal"):
        return "refused at start"
    if f.get("pool_tokens") is not None:
        n = f["requests_at_limit"]
        return f"{f['pool_tokens']:,} tokens, {n:,} request{'s' * (n != 1)} of {limit:,} at once"
    if f.get("max_concurrency") is not None:
        return f"{f['max_concurrency']:,} requests at once"
    return ""


def speculation_view(s: Setup) -> dict | None:
    """The drafter's part of the plan of ``s`` (None without speculation): what ``--json`` carries as
    ``speculation``, and its line."""
    spec = s.speculation
    if spec is None:
        return None
    check_speculation(s)
    d = s.draft()
    alone = replace(s, spec_method=None)
    target = s.rules.bytes_per_token(s.question())
    weights = next((b for name, b, _ in s.draft_terms if name == "draft weights"), 0.0)
    with_, without = _figures(s), _figures(alone)
    unpriced = d.unpriced_per_token * with_["pool_tokens"] if with_.get("pool_tokens") else 0.0
    out = {"method": spec.method, "tokens": spec.tokens, "flag": s.rules.speculative_flag(spec),
           "draft_model": spec.draft_name or None, "drafter": spec.label, "draft_layers": spec.layers, "where": d.where, "note": d.note,
           "verified": d.verified, "draft_weights_bytes_per_gpu": weights, "draft_weights_source": spec.weights_source,
           "draft_terms": [{"term": n, "bytes": b, "source": w} for n, b, w in s.draft_terms],
           "draft_kv_bytes_per_token": d.bytes_per_token, "draft_kv_priced_per_token": d.pool_price,
           "target_kv_bytes_per_token": target, "draft_kv_bytes_per_gpu": d.bytes_per_gpu,
           "unpriced_bytes_per_gpu": unpriced, "with": with_, "without": without}
    head = f"Speculative decoding ({spec.method}: {spec.label}; {out['flag']})"
    if spec.method == "ngram":
        out["line"] = f"{head}: {d.note}; the KV and the pool are unchanged"
        return out
    line = (f"{head}: the drafter's KV in {d.where}; draft weights {fmt_gib(weights)} per GPU, draft KV "
            f"{d.bytes_per_token:,.0f} B per token per GPU beside the target's {target:,.0f}")
    if _said(with_, s.limit):
        line += f": {_said(with_, s.limit)} (without the drafter: {_said(without, s.limit)})"
    if unpriced > 0:
        line += (f"; the pool's size prices the drafter at {d.pool_price:,.0f} B per token, so its own pool takes "
                 f"{fmt_gib(unpriced)} per GPU beyond the budget (a launch OOM where the GPU has no room for it)")
    if not d.verified:
        line += " (unverified: read from the engine's source, not measured; docs/plan.md#speculative-decoding)"
    out["line"] = line
    return out
