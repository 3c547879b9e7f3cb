"""The verdict first: FITS / DOES NOT FIT, the headroom, the concurrency at the typical length and the
longest request at the asked concurrency, in one line; then the ledger per GPU (weights, KV, overhead,
margin, each with where its figure comes from)."""
from __future__ import annotations

from dataclasses import replace

from kvbench.kv.rules import KVAnswer
from kvbench.kv.units import fmt_gib

from .deploy import Outcome, Setup
from .overhead import rule_of_thumb


def limit_label(s: Setup) -> str:
    """What the per-request limit is, in a few words."""
    if s.limit_source.startswith("the model's"):
        return "the model's limit"
    if s.limit_source == "--max-model-len":
        return "the --max-model-len"
    if "past the model's" in s.limit_source:
        return f"the limit planned, past the model's {s.geometry.max_context:,}"
    return "the limit planned"


def kv_scope(s: Setup) -> str:
    """How the KV figure per GPU relates to the others: a latent every rank holds whole, or a share."""
    stored = s.rules.stored(s.question())
    parts = []
    if s.pp > 1:
        parts.append(f"the pipeline stage holding the most layers' KV ({len(stored.layers)} of "
                     f"{len(s.geometry.layers)} layers, of {s.pp} stages)")
    if s.dp > 1:
        parts.append(f"the KV of {s.per_rank_batch} of the {s.batch} requests (attention data-parallel over {s.dp})")
    inner = _tp_scope(s, stored)
    return "; ".join([*parts, inner] if inner else parts)


def _tp_scope(s: Setup, stored) -> str:
    if s.tp > 1 and stored.mla is not None and s.rules.gpu_layers(stored, s.tp) == stored.layers:
        return f"the MLA latent replicated on each of {s.tp} GPUs (not split by the {s.tp}-way tensor parallel)"
    if s.tp > 1 and s.rules.gpu_layers(stored, s.tp) != stored.layers:
        return f"the GPU holding the most layers' KV of {s.tp} (layers split, not heads)"
    if s.tp > 1:
        return f"one GPU's share of the KV heads, of {s.tp}"
    return ""


def _weights_split(s: Setup) -> str:
    if s.dp > 1:
        return (f"; the routed experts ({s.expert_share:.0%}) split over {s.gpus} GPUs, the rest whole on each "
                f"(attention data-parallel)")
    if s.pp > 1:
        return f"; split over {s.gpus} GPUs ({s.pp} pipeline stages of {s.tp}, evenly)"
    return f"; split over {s.tp} GPUs"


def ledger(s: Setup, o: Outcome, deploy: KVAnswer) -> list[dict]:
    """Per GPU: each term's bytes and where it comes from."""
    w = s.weights_per_gpu
    rows = [{"term": "weights", "bytes": w,
             "source": s.weights.source + (_weights_split(s) if s.gpus > 1 and w is not None else "")}]
    scope = kv_scope(s)
    d = s.draft()
    drafted = d.bytes_per_gpu if d is not None else 0.0
    rows.append({"term": "kv", "bytes": o.kv - drafted,
                 "source": f"{s.rules.engine}: {deploy.note}; {deploy.dtype} ({s.kv_dtype_note()})"
                           + (f"; {scope}" if scope else "")})
    if d is not None:  # the drafter's: its weights, its KV where the engine keeps it, the engine's terms for it
        rows += [{"term": name, "bytes": b, "source": why} for name, b, why in s.draft_terms]
        rows.append({"term": "draft KV", "bytes": drafted, "source": f"{d.where}: {d.note}"})
    rows += [{"term": term, "bytes": b, "source": why} for term, b, why in s.host()]
    mem = s.startup
    if mem is not None:  # the engine's own terms, each with its source, and what its fraction leaves free
        rows += [{"term": t.name, "bytes": t.bytes, "source": t.source} for t in mem.terms]
        rows.append({"term": "kept free", "bytes": s.kept_free,
                     "source": f"{mem.label} budgets {mem.fraction:g} ({mem.fraction_source}) of {mem.cuda_source}; "
                               f"{s.gpu.name}'s NVML total is {fmt_gib(s.gpu.bytes)}"})
        return rows
    source = s.overhead_source
    if s.overhead_per_token:
        source += (f"; {fmt_gib(s.overhead_fixed)} + {s.overhead_per_token / 1024:,.1f} KiB per token in flight x "
                   f"{s.batch * s.context:,}")
    if s.gpu is not None:
        source += f" (the rule of thumb 2 GB + 5 % would say {fmt_gib(rule_of_thumb(s.gpu.bytes))})"
    rows.append({"term": "overhead", "bytes": s.overhead, "source": source})
    if s.gpu is not None:
        rows.append({"term": "margin", "bytes": s.gpu.bytes * s.margin,
                     "source": f"--margin: {s.margin:.0%} of the wall kept free" if s.gpu.wall else
                               f"--margin: {s.margin:.0%} of {s.gpu.name}'s {fmt_gib(s.gpu.bytes)} kept free"})
    return rows


def _pct(x: float) -> str:
    return f"{abs(x):.0%}" if abs(x) >= 0.01 else f"{abs(x):.1%}"


def verdict(s: Setup, o: Outcome) -> dict:
    out = {"word": None, "fits": o.fits, "headroom_bytes": o.headroom, "headroom_pct": o.headroom_pct,
           "max_concurrency": o.max_concurrency, "context": s.context, "longest_request": o.longest_request,
           "batch": s.batch, "limit": s.limit, "limit_source": s.limit_source, "weights_exceed": o.weights_exceed,
           "verified": s.model.verified, "unread_keys": list(s.model.unread_keys),
           "assumed_keys": list(s.geometry.assumed)}
    unverified = _unverified(s)
    if s.gpu is None:
        out["word"] = "NO GPU"
        out["line"] = (f"NO VERDICT{unverified}: no --gpu or --memory; the deployment holds {fmt_gib(o.kv)} of KV "
                       f"{s.per} ({s.batch} x {s.context:,} tokens asked, under a {s.limit:,}-token limit)")
        return out
    usable = s.usable
    if o.fits is None:
        out["word"] = "UNKNOWN"
        out["line"] = (f"FIT UNKNOWN{unverified}: unknown: the weights are unknown ({s.weights.source}); the KV "
                       f"alone takes {fmt_gib(o.kv)} of the {fmt_gib(usable)} usable {s.per}")
        return out
    longest = f"{o.longest_request:,} tokens"
    if o.longest_request and o.longest_request == s.limit:
        longest += f" ({limit_label(s)})"
    tail = (f"{o.max_concurrency:,} request{'s' * (o.max_concurrency != 1)} at once at {s.context:,} tokens; "
            f"the longest request with "
            f"{s.batch} at once: {longest}")
    pool = _startup_pool(s)
    if o.fits and pool is not None:  # said in the pool the engine's first line names, not beside it
        out["word"] = "FITS"
        out["line"] = (f"FITS{unverified}: the KV held takes {fmt_gib(o.kv)} of the {fmt_gib(pool)} KV pool "
                       f"{s.per}, {fmt_gib(o.headroom)} left ({_pct(o.headroom_pct)} of {fmt_gib(usable)} usable); {tail}")
    elif o.fits:
        out["word"] = "FITS"
        out["line"] = (f"FITS{unverified}: {fmt_gib(o.headroom)} headroom {s.per} ({_pct(o.headroom_pct)} of "
                       f"{fmt_gib(usable)} usable); {tail}")
    elif o.weights_exceed:
        out["word"] = "DOES NOT FIT"
        alone = s.weights_per_gpu >= usable
        taken = s.weights_per_gpu if alone else s.weights_per_gpu + s.fixed_overhead + s.host_bytes()
        parts = ["the weights"] + ([f"the {fmt_gib(s.fixed_overhead)} overhead"] if s.fixed_overhead else [])
        parts += [f"the {fmt_gib(s.host_bytes())} host memory"] if s.host_bytes() else []
        what = ("the weights alone take" if alone or len(parts) == 1
                else f"{', '.join(parts[:-1])} and {parts[-1]} alone take")
        share = f" ({fmt_gib(s.weights.bytes)} over {s.gpus} GPUs)" if s.gpus > 1 else ""
        out["line"] = (f"DOES NOT FIT{unverified}: {what} {fmt_gib(taken)} {s.per}{share}, more than the "
                       f"{fmt_gib(usable)} usable on {s.gpu.name} ({s.kept_free / s.gpu.bytes:.0%} kept free); short by "
                       f"{fmt_gib(-o.headroom)} with the KV")
    elif pool is not None:
        out["word"] = "DOES NOT FIT"
        out["line"] = (f"DOES NOT FIT{unverified}: the KV held takes {fmt_gib(o.kv)}, more than the {fmt_gib(pool)} KV "
                       f"pool {s.per}: short by {fmt_gib(-o.headroom)} ({_pct(o.headroom_pct)} of {fmt_gib(usable)} "
                       f"usable); {tail}")
    else:
        out["word"] = "DOES NOT FIT"
        out["line"] = (f"DOES NOT FIT{unverified}: short by {fmt_gib(-o.headroom)} {s.per} ({_pct(o.headroom_pct)} "
                       f"of {fmt_gib(usable)} usable); {tail}")
    return out


def _startup_pool(s: Setup) -> float | None:
    """The KV pool an engine that sizes it from its budget would start with (its first line's), where it would."""
    if s.startup is None or not s.rules.pool_from_budget:
        return None
    room = s.usable - s.weights_per_gpu - s.fixed_overhead - s.host_bytes()
    return room if room > 0 else None


def lever_line(lv: dict) -> str:
    """One lever's result in words."""
    if lv["fits"] is None:
        return "unknown"
    word = "FITS" if lv["fits"] else "DOES NOT FIT"
    room = lv["headroom_bytes"]
    head = f"{fmt_gib(room)} headroom" if room >= 0 else f"short by {fmt_gib(-room)}"
    if lv["weights_exceed"]:
        return f"{word}: the weights and the fixed overheads alone exceed the usable memory ({head})"
    return (f"{word}: {head} ({_pct(lv['headroom_pct'])}); {lv['max_concurrency']:,} at once; longest request "
            f"{lv['longest_request']:,} tokens")


def _unverified(s: Setup) -> str:
    if s.model.verified:
        return ""
    return f" (NOT VERIFIED: {s.model.unverified_reason})"


def asked_first(s: Setup, o: Outcome, typical: KVAnswer, startup: dict | None) -> dict:
    """The question asked, answered before anything else: the KV of ``batch`` x ``context`` tokens (no limit
    reserved); then what the server's limit implies for it (the engine's default, the model's limit, where
    none was given: one request at that limit is what the engine reserves or refuses on), and, where that
    limit is longer than the request asked, the same deployment started with the asked length as its limit.
    Each labelled, each computed."""
    dtype = f"{typical.dtype}, {s.rules.engine}" + (f": {typical.note}" if s.engine else "")
    asked = {"tokens": s.context, "batch": s.batch, "kv_bytes": typical.bytes_per_gpu * s.gpus,
             "kv_bytes_per_gpu": typical.bytes_per_gpu, "kv_dtype": typical.dtype,
             "line": f"Asked{_unverified(s)}: {s.batch} x {s.context:,} tokens hold {fmt_gib(typical.bytes_per_gpu)} of KV {s.per}"
                     f" ({dtype})"}
    default = s.limit_source.startswith("the model's")
    flag = s.rules.limit_flag(s.limit, s.batch)
    where = (f"At the default limit, the model's {s.limit:,} tokens ({flag})" if default
             else f"At the limit asked ({flag})" if s.limit_source == "--max-model-len"
             else f"At a limit of {s.limit:,} tokens ({flag}; {s.limit_source})")
    one = s.kv_bytes(context=s.limit, batch=1, limit=s.limit)
    if startup is not None:
        said = startup["line"]
    elif s.gpu is None:
        said = f"one request at the limit holds {fmt_gib(one)} of KV {s.per}; no --gpu or --memory: no verdict"
    else:
        said = verdict(s, o)["line"]
    at_limit = {"limit": s.limit, "limit_source": s.limit_source, "flag": flag, "default": default,
                "one_request_kv_bytes_per_gpu": one, "fits": o.fits, "refused": bool(startup and startup["refusal"]),
                "line": f"{where}: {said}"}
    out = {"asked": asked, "at_limit": at_limit, "at_asked_limit": None}
    if default and s.limit > s.context and s.gpu is not None and s.weights.bytes is not None:
        t = replace(s, limit=s.context, limit_source="--max-model-len")
        if t.startup_rule and t.startup is None:
            t = replace(t, startup_rule=False)
        ot = t.outcome()
        v = verdict(t, ot)
        tflag = s.rules.limit_flag(s.context, s.batch)
        out["at_asked_limit"] = {"limit": s.context, "flag": tflag, "fits": ot.fits, "word": v["word"],
                                 "max_concurrency": ot.max_concurrency, "headroom_bytes": ot.headroom,
                                 "line": f"With {tflag} (the {s.context:,} tokens asked as the limit): {v['line']}"}
    return out
