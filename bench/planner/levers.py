"""What to change: every lever that applies to a deployment, each planned in full (fits, headroom, max
concurrency, longest request) and written as the engine's own flag.

- KV dtype: the engine's smaller KV dtypes (its rules' ``kv_levers``: fp8 for vLLM and TGI, q8_0 / q4_0 for
  llama.cpp and Ollama), where smaller than the dtype planned;
- a weight format: the engine's ``weight_formats`` smaller than the weights served (an unquantised checkpoint
  only), at the width ``kvbench.kv.weights`` gives (linear layers with their scales) or parameters x bytes;
- a lower limit (the largest per-request limit that fits, where the limit is what does not fit);
- fewer requests at once (the most that fit);
- the engine's host caches, where a CPU memory plan counts them (llama.cpp's prompt cache: --cache-ram);
- more GPUs (not on a CPU memory wall): tensor parallel 2, 4, 8 ... up to the node, where the engine splits the model so;
- another engine's rules, where they hold less (llama.cpp's window cache for a sliding-window model);
- where no single lever fits: the cheapest combinations of the engine's own levers that do (fewest GPUs,
  then fewest changes).

Best first: levers that make the deployment fit before those that do not; a lever that serves fewer
requests than asked or changes the engine is listed after every fix, marked as not one (``fix`` false); then the cheaper change (a
flag before another checkpoint, before another engine, before more GPUs); then the larger headroom.
"""
from __future__ import annotations

from dataclasses import replace

from kvbench.kv.rules import KVRuleError
from kvbench.kv.units import fmt_gib
from kvbench.kv.weights import WEIGHT_DTYPE_BYTES, Weights

from .deploy import Outcome, Setup, _largest, with_engine
from .shared import PlanError, engines

COST = {"kv_dtype": 1, "host": 1, "limit": 1, "weights": 2, "concurrency": 2, "engine": 3, "tp": 4, "combined": 0}


def _lever(kind: str, change: str, what: str, s: Setup, extra: float = 0.0, note: str = "") -> dict | None:
    try:
        o = s.outcome()
    except PlanError:
        return None
    return {"lever": kind, "change": change, "what": what, **o.result(), "note": note,
            "_cost": COST[kind] + extra}


def _served_width(s: Setup) -> tuple[float | None, float | None]:
    """(parameters, bytes per parameter) of the weights served, where known."""
    w = s.weights
    if w.bytes is None:
        return None, None
    params = w.parameters
    if not params:
        per = WEIGHT_DTYPE_BYTES.get(s.rules.serving_dtype(s.geometry, s.capability), 2)
        return w.bytes / per, per
    return params, w.bytes / params


def weight_levers(s: Setup) -> list[dict]:
    out = []
    for flag, w in weight_options(s):
        lever = _lever("weights", flag, f"weights {w.source}", replace(s, weights=w))
        if lever:
            out.append(lever)
    return out


def weight_options(s: Setup) -> list[tuple[str, Weights]]:
    """(the engine's flag, the weights at it) for each of its weight formats smaller than the weights served."""
    m = s.model
    if m.quantised or m.geometry.source == "gguf" or m.weights_dtype not in ("auto", "fp32", "bf16", "fp16") \
            or s.weights.method == "user":
        return []
    params, per = _served_width(s)
    if not params:
        return []
    out = []
    for fmt, fmt_per in s.rules.weight_formats.items():
        if fmt_per >= per * 0.99:
            continue
        w = None
        if m.weights_at is not None and fmt in WEIGHT_DTYPE_BYTES:
            found = m.weights_at(fmt)  # linear layers at the format, with its scales (kvbench.kv.weights)
            if found.bytes is not None:
                w = Weights(found.bytes, found.source.replace(f"--weights-dtype {fmt} ", f"{fmt} ", 1),
                            parameters=found.parameters, method=found.method)
        if w is None:
            w = Weights(params * fmt_per, f"{fmt}: {fmt_gib(params * fmt_per)}, {params / 1e9:.2f} B parameters x "
                                          f"{fmt_per:g} B",
                        parameters=params, method="lever")
        out.append((s.rules.weights_flag(fmt), w))
    return out


COMBINED_SHOWN = 3  # the cheapest combinations that fit


def combined_levers(s: Setup, singles: list[dict]) -> list[dict]:
    """Where no single lever makes the deployment fit: every combination of the engine's levers (a smaller KV
    dtype, a weight format, the asked length as the limit, more GPUs), each planned, and the few cheapest
    that fit: fewest GPUs, then fewest changes. Fewer requests and another engine are never in them."""
    if any(lv["fits"] for lv in singles if lv["lever"] not in NOT_A_FIX):
        return []
    kv = [(None, s.kv_dtype)]
    try:
        current = s.kv_dtype_bytes()
        for dtype in s.rules.kv_levers():
            if replace(s, kv_dtype=dtype).kv_dtype_bytes() < current:
                kv.append((s.rules.kv_dtype_flag(dtype), dtype))
    except (PlanError, KVRuleError):
        pass
    weights = [(None, s.weights), *weight_options(s)]
    limits = [(None, s.limit)]
    if s.limit_source.startswith("the model's") and s.context < s.limit:
        limits.append((s.rules.limit_flag(s.context, s.batch), s.context))
    tps = [(None, s.tp)]
    if s.gpu is None or not s.gpu.wall:
        t = 2
        while t <= s.node_gpus:
            if t > s.tp:
                tps.append((s.rules.tp_flag(t), t))
            t *= 2
    found, closest = [], None
    for tp_flag, tp in tps:  # fewest GPUs first: the first that fit are the cheapest
        for kv_flag, dtype in kv:
            for w_flag, w in weights:
                for limit_flag, limit in limits:
                    flags = [f for f in (kv_flag, w_flag, limit_flag, tp_flag) if f]
                    if len(flags) < 2:
                        continue  # a single lever: already planned
                    t = replace(s, kv_dtype=dtype, weights=w, limit=limit, tp=tp)
                    if t.startup_rule and t.startup is None:
                        t = replace(t, startup_rule=False)
                    try:
                        short = t.need() - t.usable
                    except (PlanError, KVRuleError, ValueError):  # a split the engine refuses
                        continue
                    if short > 0:
                        if closest is None or short < closest[0]:
                            closest = (short, (tp, len(flags), flags, t))
                        continue
                    found.append((tp, len(flags), flags, t))
        if len(found) >= COMBINED_SHOWN:
            break
    found.sort(key=lambda f: (f[0], f[1]))
    if not found and closest is not None:  # none fits: the nearest, planned, says by how much
        found = [closest[1]]
    out = []
    for tp, n, flags, t in found[:COMBINED_SHOWN]:
        what = f"{n} changes together" + (f", {tp} GPUs" if tp > 1 else "")
        if len(found) == 1 and not t.fits():
            what += "; the nearest combination: none of the engine's levers together fits"
        lever = _lever("combined", " ".join(flags), what,
                       t, extra=n + tp / 100)
        if lever:
            out.append(lever)
    return out


def kv_levers(s: Setup) -> list[dict]:
    out = []
    try:
        current = s.kv_dtype_bytes()
    except PlanError:
        return []
    for dtype in s.rules.kv_levers():
        t = replace(s, kv_dtype=dtype)
        try:
            if t.kv_dtype_bytes() >= current:
                continue
            resolved = t.resolved_kv_dtype()
        except (PlanError, KVRuleError):
            continue
        lever = _lever("kv_dtype", s.rules.kv_dtype_flag(dtype), f"KV in {resolved}", t)
        if lever:
            out.append(lever)
    return out


def host_levers(s: Setup) -> list[dict]:
    """The engine's switches for its host caches (llama.cpp's --cache-ram), where a CPU plan counts them."""
    if not s.host_bytes():
        return []
    out = []
    for flag, options in s.rules.host_levers():
        lever = _lever("host", flag, "its host cache bounded", replace(s, options={**s.options, **options}))
        if lever:
            out.append(lever)
    return out


def tp_levers(s: Setup) -> list[dict]:
    if s.gpu is not None and s.gpu.wall:  # a CPU memory wall has no GPUs to split over
        return []
    out = []
    t = 2
    while t <= s.node_gpus:
        if t > s.tp:
            lever = _lever("tp", s.rules.tp_flag(t), f"{t} GPUs", replace(s, tp=t), extra=t / 100)
            if lever:
                out.append(lever)
        t *= 2
    return out


def limit_lever(s: Setup, base: Outcome) -> list[dict]:
    """The largest per-request limit that fits, where the one asked does not (and the typical request still
    fits under it)."""
    if base.fits is not False or base.weights_exceed:
        return []
    if s.limit_source.startswith("the model's") and s.context < s.limit and s.fits(limit=s.context):
        # the server's default limit is the model's: the length asked is the limit the user wants
        lever = _lever("limit", s.rules.limit_flag(s.context, s.batch), f"a limit of {s.context:,} tokens per "
                       f"request, the length asked (from the model's {s.limit:,})", replace(s, limit=s.context))
        return [lever] if lever else []
    best = _largest(lambda n: s.fits(limit=n), s.context, s.limit - 1)
    if best < s.context:
        return []
    lever = _lever("limit", s.rules.limit_flag(best, s.batch), f"a limit of {best:,} tokens per request "
                   f"(from {s.limit:,})", replace(s, limit=best))
    return [lever] if lever else []


def concurrency_lever(s: Setup, base: Outcome) -> list[dict]:
    n = base.max_concurrency
    if base.fits is not False or not n or n >= s.batch:
        return []
    lever = _lever("concurrency", s.rules.concurrency_flag(n), f"{n} requests at once (from {s.batch})",
                   replace(s, batch=n))
    return [lever] if lever else []


def engine_levers(s: Setup, base: Outcome) -> list[dict]:
    out = []
    for engine in engines():
        if engine == s.engine:
            continue
        try:
            t = with_engine(s, engine)
            o = t.outcome()
            answer = t.kv()
        except (PlanError, KVRuleError, ValueError):
            continue
        # it makes the deployment fit, or its KV is at least 5 % smaller (not an engine's rounding)
        better = (o.fits and not base.fits) or (not base.weights_exceed and o.headroom is not None
                                                and o.headroom > base.headroom and o.kv < 0.95 * base.kv)
        if better:
            out.append({"lever": "engine", "change": f"--engine {engine}", "what": f"{engine}'s KV: {answer.note}",
                        **o.result(), "note": "", "_cost": COST["engine"]})
    return out


def levers(s: Setup, base: Outcome) -> list[dict]:
    """Every lever that applies, planned, best first (see the module's docstring)."""
    if base.fits is None:
        return []
    if base.weights_exceed:  # only what shrinks or splits the weights can help
        found = [*host_levers(s), *weight_levers(s), *tp_levers(s), *engine_levers(s, base)]
    else:
        found = [*kv_levers(s), *host_levers(s), *weight_levers(s), *limit_lever(s, base), *concurrency_lever(s, base),
                 *tp_levers(s), *engine_levers(s, base)]
    for lv in found:  # fewer users than asked, or another engine, answers another question: never a fix
        lv["fix"] = lv["lever"] not in NOT_A_FIX
        lv["not_a_fix"] = NOT_A_FIX.get(lv["lever"], "")
    if not base.weights_exceed or any(lv["lever"] in ("weights", "tp") for lv in found):
        found += combined_levers(s, found)
    for lv in found:
        lv.setdefault("fix", True)
        lv.setdefault("not_a_fix", "")
    found.sort(key=lambda lv: (not lv["fix"], not lv["fits"], lv["_cost"], -(lv["headroom_bytes"] or 0)))
    for lv in found:
        lv.pop("_cost")
    return found


NOT_A_FIX = {"concurrency": "serves fewer requests at once than asked", "engine": "another engine"}
