"""What to change: every lever that applies to a deployment, each planned in full (fits, headroom, max
concurrency, longest request) and written as the engine's own flag, and the cheapest combinations of them that
reach the target asked (the batch x tokens, at the limit the user wants).

The engine's levers, alone:

- KV dtype: the engine's smaller KV dtypes (its rules' ``kv_levers``: fp8 for vLLM and TGI, q8_0 / q4_0 for
  llama.cpp and Ollama), where smaller than the dtype planned;
- a weight format: the engine's ``weight_formats`` smaller than the weights served (an unquantised checkpoint
  only), at the width ``kvbench.kv.weights`` gives (linear layers with their scales) or parameters x bytes;
- a lower limit (the length asked where the server's default limit is the model's, else the largest that fits);
- the engine's host caches, where a CPU memory plan counts them (llama.cpp's prompt cache: --cache-ram);
- more GPUs (not on a CPU memory wall): tensor parallel 2, 4, 8 ... up to the node; a pipeline of 2, 4 ...
  stages (its rules' ``pp_flag``, across nodes up to :data:`MAX_NODES`); for an MLA model whose latent the
  engine replicates on every tensor-parallel rank, data-parallel attention (``dp_attention_flag``);

and every combination of them (the KV dtype, the weight format, the limit, the GPU layout), each planned: the
few that fit with the fewest GPUs, then the fewest changes, are shown; one that holds a cheaper fitting set
of changes is left out. Fewer requests at once than asked and another engine answer another question: they are
listed after every fix, marked as not one (``fix`` false), and never combined.

Best first: what fits before what does not; then fewer GPUs, fewer changes, the cheaper change (a flag before
another checkpoint, before more GPUs); then the larger headroom. Each lever carries its ``changes`` (kind,
the engine's flag, and ``plan_args``: the same deployment asked of ``kvbench plan`` directly) and ``gpus``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvbench.kv.geometry import cdiv
from kvbench.kv.rules import KVRuleError
from kvbench.kv.units import fmt_gib
from kvbench.kv.weights import WEIGHT_DTYPE_BYTES, Weights

from .deploy import Outcome, Setup, _largest, with_engine
from .shared import PlanError, engines

# a flag before another checkpoint, before more GPUs; within as many GPUs, tensor parallel before a pipeline
COST = {"kv_dtype": 1, "host": 1, "limit": 1, "weights": 2, "concurrency": 2, "engine": 3, "tp": 4, "dp": 4, "pp": 5}
MAX_NODES = 4  # the most nodes a pipeline or data-parallel attention spans in the search
COMBINED_SHOWN = 3  # the cheapest combinations that fit
NOT_A_FIX = {"concurrency": "serves fewer requests at once than asked", "engine": "another engine"}


@dataclass(frozen=True)
class Change:
    """One change to the deployment: its kind, the engine's flag (or what it takes: another checkpoint), and the
    same change asked of ``kvbench plan``."""

    kind: str  # kv_dtype, weights, limit, host, tp, pp, dp, concurrency, engine
    flag: str
    plan_args: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"kind": self.kind, "flag": self.flag, "plan_args": list(self.plan_args)}


def _lever(kind: str, changes: list[Change], what: str, s: Setup, extra: float = 0.0, note: str = "") -> dict | None:
    try:
        o = s.outcome()
    except (PlanError, KVRuleError, ValueError):
        return None
    return {"lever": kind, "change": " + ".join(c.flag for c in changes), "what": what, **o.result(), "note": note,
            "changes": [c.as_dict() for c in changes], "gpus": s.gpus,
            "plan_args": [a for c in changes for a in c.plan_args],
            "_cost": sum(COST[c.kind] for c in changes) + extra, "_n": len(changes)}


def _gpus_what(s: Setup) -> str:
    """How many GPUs, and nodes where more than one."""
    if s.gpus <= s.node_gpus:
        return f"{s.gpus} GPU{'s' * (s.gpus != 1)}"
    return f"{s.gpus} GPUs, {cdiv(s.gpus, s.node_gpus)} nodes of {s.node_gpus}"


# --- the options of each lever ---------------------------------------------------------------------------

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


def weight_options(s: Setup) -> list[tuple[Change, Weights]]:
    """(the change, the weights at it) for each of the engine's weight formats smaller than the weights served."""
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
        # kvbench plan's --weights-dtype where it takes the format, else the bytes themselves (a Q4_0 GGUF)
        args = ("--weights-dtype", fmt) if fmt in WEIGHT_DTYPE_BYTES else ("--weights-bytes", str(round(w.bytes)))
        out.append((Change("weights", s.rules.weights_flag(fmt), args), w))
    return out


def kv_options(s: Setup) -> list[tuple[Change, str]]:
    """(the change, the dtype) for each of the engine's KV dtypes smaller than the one planned."""
    out = []
    try:
        current = s.kv_dtype_bytes()
    except (PlanError, KVRuleError):
        return []
    for dtype in s.rules.kv_levers():
        t = replace(s, kv_dtype=dtype)
        try:
            if t.kv_dtype_bytes() >= current:
                continue
        except (PlanError, KVRuleError):
            continue
        out.append((Change("kv_dtype", s.rules.kv_dtype_flag(dtype), ("--kv-dtype", dtype)), dtype))
    return out


def asked_limit(s: Setup) -> list[tuple[Change, int]]:
    """The length asked as the limit, where the server's limit is the model's default and longer: the limit
    the user wants (a request of the model's whole length is not what was asked)."""
    if s.limit_source.startswith("the model's") and s.context < s.limit:
        return [(Change("limit", s.rules.limit_flag(s.context, s.batch), ("--max-model-len", str(s.context))),
                 s.context)]
    return []


def _powers(top: int, start: int = 2) -> list[int]:
    out, n = [], start
    while n <= top:
        out.append(n)
        n *= 2
    return out


def layouts(s: Setup) -> list[tuple[list[Change], int, int, int]]:
    """(changes, tp, pp, dp) of each GPU layout the engine has, other than the one asked: tensor parallel within a
    node, with a pipeline of stages across nodes, or (an MLA model whose latent every rank replicates)
    data-parallel attention; at most :data:`MAX_NODES` nodes."""
    if s.gpu is not None and s.gpu.wall:  # a CPU memory wall has no GPUs to split over
        return []
    rules, most = s.rules, s.node_gpus * MAX_NODES
    out = []
    if s.dp == 1:
        tps = sorted({s.tp, *(t for t in _powers(s.node_gpus) if t > s.tp)})
        pps = sorted({s.pp, *(p for p in _powers(min(most, len(s.geometry.layers)))
                              if p > s.pp and rules.pp_flag(p) is not None)})
        for tp in tps:
            for pp in pps:
                if (tp, pp) == (s.tp, s.pp) or tp * pp > most:
                    continue
                changes = [Change("tp", rules.tp_flag(tp), ("--tp", str(tp)))] if tp != s.tp else []
                if pp != s.pp:
                    changes.append(Change("pp", rules.pp_flag(pp), ("--pp", str(pp))))
                out.append((changes, tp, pp, 1))
    try:
        stored = rules.stored(s.question())
        latent_everywhere = stored.mla is not None and rules.replicated(stored)
    except (PlanError, KVRuleError, ValueError):
        latent_everywhere = False
    if latent_everywhere:
        for g in _powers(most):
            flag = rules.dp_attention_flag(g)
            if g > s.dp and flag is not None:
                out.append(([Change("dp", flag, ("--tp", "1", "--pp", "1", "--dp", str(g)))], 1, 1, g))
    return out


def _what_layout(s: Setup, changes: list[Change]) -> str:
    kinds = {c.kind for c in changes}
    if "dp" in kinds:
        return (f"attention data-parallel over {_gpus_what(s)}: each holds the KV of {s.per_rank_batch} of the "
                f"{s.batch} requests; the routed experts split over all, the rest of the weights whole on each")
    if "pp" in kinds or s.pp > 1:
        return f"{s.pp} pipeline stages of {s.tp} GPU{'s' * (s.tp != 1)}: {_gpus_what(s)}"
    return _gpus_what(s)


# --- the levers alone --------------------------------------------------------------------------------------

def weight_levers(s: Setup) -> list[dict]:
    out = []
    for change, w in weight_options(s):
        lever = _lever("weights", [change], f"weights {w.source}", replace(s, weights=w))
        if lever:
            out.append(lever)
    return out


def kv_levers(s: Setup) -> list[dict]:
    out = []
    for change, dtype in kv_options(s):
        t = replace(s, kv_dtype=dtype)
        try:
            resolved = t.resolved_kv_dtype()
        except (PlanError, KVRuleError):
            continue
        lever = _lever("kv_dtype", [change], f"KV in {resolved}", t)
        if lever:
            out.append(lever)
    return out


def host_levers(s: Setup) -> list[dict]:
    """The engine's switches for its host caches (llama.cpp's --cache-ram), where a CPU plan counts them."""
    if not s.host_bytes():
        return []
    out = []
    for flag, options in s.rules.host_levers():
        args = tuple(a for k, v in options.items() for a in ("--engine-option", f"{k}={v}"))
        lever = _lever("host", [Change("host", flag, args)], "its host cache bounded",
                       replace(s, options={**s.options, **options}))
        if lever:
            out.append(lever)
    return out


def layout_levers(s: Setup) -> list[dict]:
    """More GPUs alone: every tensor-parallel size within the node; the fewest pipeline stages, and the fewest
    data-parallel attention ranks, that fit (where none does, the largest tried, to say by how much)."""
    out, best = [], {}
    for changes, tp, pp, dp in layouts(s):
        if len(changes) != 1:
            continue
        kind = changes[0].kind
        if kind != "tp" and best.get(kind, {}).get("fits"):
            continue  # a smaller pipeline or data-parallel group already fits
        try:
            t = _startup_checked(replace(s, tp=tp, pp=pp, dp=dp))
        except (PlanError, KVRuleError, ValueError):  # a split the engine refuses
            continue
        lever = _lever(kind, changes, "", t, extra=t.gpus / 100)
        if lever is None:
            continue
        lever["what"] = _what_layout(t, changes)
        if kind == "tp":
            out.append(lever)
        else:
            best[kind] = lever
    return out + list(best.values())


def limit_lever(s: Setup, base: Outcome) -> list[dict]:
    """The limit that fits, where the one the server starts with does not: the length asked where the default
    is the model's (and the typical request fits under it), else the largest limit that fits."""
    if base.fits is not False or base.weights_exceed:
        return []
    for change, n in asked_limit(s):
        if s.fits(limit=n):
            lever = _lever("limit", [change], f"a limit of {n:,} tokens per request, the length asked (from the "
                           f"model's {s.limit:,})", replace(s, limit=n))
            return [lever] if lever else []
    best = _largest(lambda n: s.fits(limit=n), s.context, s.limit - 1)
    if best < s.context:
        return []
    lever = _lever("limit", [Change("limit", s.rules.limit_flag(best, s.batch), ("--max-model-len", str(best)))],
                   f"a limit of {best:,} tokens per request (from {s.limit:,})", replace(s, limit=best))
    return [lever] if lever else []


def concurrency_lever(s: Setup, base: Outcome) -> list[dict]:
    n = base.max_concurrency
    if base.fits is not False or not n or n >= s.batch:
        return []
    lever = _lever("concurrency", [Change("concurrency", s.rules.concurrency_flag(n), ("--batch", str(n)))],
                   f"{n} requests at once (from {s.batch})", replace(s, batch=n))
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
            change = Change("engine", f"--engine {engine}", ("--engine", engine))
            out.append({"lever": "engine", "change": change.flag, "what": f"{engine}'s KV: {answer.note}",
                        **o.result(), "note": "", "changes": [change.as_dict()], "gpus": t.gpus,
                        "plan_args": list(change.plan_args), "_cost": COST["engine"], "_n": 1})
    return out


# --- the levers together -------------------------------------------------------------------------------

def _startup_checked(t: Setup) -> Setup:
    """``t`` with the engine's startup rule dropped where it has none for this layout (margin and overhead)."""
    return replace(t, startup_rule=False) if t.startup_rule and t.startup is None else t


def combined_levers(s: Setup, singles: list[dict]) -> list[dict]:
    """Every combination of the engine's levers (a smaller KV dtype, a weight format, the length asked as the
    limit, a GPU layout), each planned; the few that fit with the fewest GPUs, then the fewest changes. A
    combination that holds a set of changes that fits already (a single lever, or a cheaper combination) is
    left out. Where none fits, the nearest, planned, says by how much."""
    kv = [(None, s.kv_dtype), *kv_options(s)]
    weights = [(None, s.weights), *weight_options(s)]
    limits = [(None, s.limit), *asked_limit(s)]
    grids = sorted([([], s.tp, s.pp, s.dp), *layouts(s)], key=lambda g: (g[1] * g[2] * g[3], len(g[0])))
    fixes = [lv for lv in singles if lv["fits"] and lv["fix"]]
    fitted = [frozenset(c["flag"] for c in lv["changes"]) for lv in fixes]
    # one change that fits on G GPUs is better than any combination on G or more
    cap = min((lv["gpus"] for lv in fixes), default=None)
    found, closest = [], None
    for layout, tp, pp, dp in grids:
        gpus = tp * pp * dp
        if len(found) >= COMBINED_SHOWN and gpus > sorted(f[0] for f in found)[COMBINED_SHOWN - 1]:
            break  # ranked by GPUs first: no larger layout can enter the few shown
        if cap is not None and gpus >= cap:
            break
        options = [(kv_c, dtype, w_c, w, l_c, limit) for kv_c, dtype in kv for w_c, w in weights
                   for l_c, limit in limits]
        options.sort(key=lambda o: sum(c is not None for c in (o[0], o[2], o[4])))  # fewest changes first
        for kv_c, dtype, w_c, w, l_c, limit in options:
            changes = [c for c in (kv_c, w_c, l_c) if c is not None] + layout
            if len(changes) < 2:
                continue  # a single lever: planned alone
            flags = frozenset(c.flag for c in changes)
            if any(f <= flags for f in fitted):
                continue  # a cheaper set of these changes fits already
            try:
                t = _startup_checked(replace(s, kv_dtype=dtype, weights=w, limit=limit, tp=tp, pp=pp, dp=dp))
                short = t.need() - t.usable
            except (PlanError, KVRuleError, ValueError):  # a split the engine refuses
                continue
            if short > 0:
                if closest is None or short < closest[1]:
                    closest = (gpus, short, changes, t)
                continue
            fitted.append(flags)
            found.append((gpus, len(changes), changes, t, sum(COST[c.kind] for c in changes), short))
    found.sort(key=lambda f: (f[0], f[1], f[4], f[5]))  # GPUs, changes, their cost, the larger headroom
    found = [f[:4] for f in found]
    shown = found[:COMBINED_SHOWN]
    nearest = not shown and closest is not None and cap is None  # where nothing fits at all
    if nearest:  # none fits: the nearest, planned, says by how much
        shown = [(closest[0], len(closest[2]), closest[2], closest[3])]
    out = []
    for gpus, n, changes, t in shown:
        what = f"{n} changes together, {_gpus_what(t)}"
        if any(c.kind in ("pp", "dp") for c in changes):
            what += f"; {_what_layout(t, changes)}"
        if nearest:
            what += "; the nearest combination: none of the engine's levers together fits"
        lever = _lever("combined", changes, what, t, extra=gpus / 100)
        if lever:
            out.append(lever)
    return out


def levers(s: Setup, base: Outcome) -> list[dict]:
    """Every lever that applies, planned, best first (see the module's docstring)."""
    if base.fits is None:
        return []
    if base.weights_exceed:  # only what shrinks or splits the weights can help
        found = [*host_levers(s), *weight_levers(s), *layout_levers(s), *engine_levers(s, base)]
    else:
        found = [*kv_levers(s), *host_levers(s), *weight_levers(s), *limit_lever(s, base), *concurrency_lever(s, base),
                 *layout_levers(s), *engine_levers(s, base)]
    for lv in found:  # fewer users than asked, or another engine, answers another question: never a fix
        lv["fix"] = lv["lever"] not in NOT_A_FIX
        lv["not_a_fix"] = NOT_A_FIX.get(lv["lever"], "")
    for lv in combined_levers(s, found):
        found.append({**lv, "fix": True, "not_a_fix": ""})
    found.sort(key=lambda lv: (not lv["fix"], not lv["fits"], lv["gpus"], lv["_n"], lv["_cost"],
                               -(lv["headroom_bytes"] or 0)))
    for lv in found:
        lv.pop("_cost")
        lv.pop("_n")
    return found
