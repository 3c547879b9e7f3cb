"""Re-plan every public startup log of tests/data/startup_logs/ and set the plan beside the engine's own figures.

    python -m kvbench.selfcheck.startup_logs          # the accuracy table, before (10 % margin, 1.5 GiB) and after
    python -m kvbench.selfcheck.startup_logs --json   # the rows

"Before" is the planner as it was: NVML's total less a 10 % margin, 1.5 GiB assumed overhead. "After" is each
engine's startup rule (KVRules.startup_memory). Each row says whether the log was used to fit a constant
(``fit``) or only checks it (``holdout``).
"""
from __future__ import annotations

import json
import math
import sys
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbench.kv.units import GIB, MIB

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "startup_logs"
CONFIGS = ROOT / "tests" / "data" / "configs"
TOLERANCE_PCT, TOLERANCE_GIB = 5.0, 0.5


@dataclass
class Row:
    log: str
    engine: str
    check: str  # pool, requests, refusal, concurrency, or a term's name
    split: str
    klass: str
    logged: float | str | None
    before: float | str | None
    after: float | str | None
    unit: str
    ok: bool | None  # after within the tolerance (None: not checkable)
    ok_before: bool | None = None
    note: str = ""


def corpus(folder: Path = CORPUS) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*.toml")):
        entry = tomllib.loads(path.read_text())
        entry["file"] = path.name
        checks = entry.get("check", [])
        entry["checks"] = [checks] if isinstance(checks, str) else list(checks)
        out.append(entry)
    return out


def close(predicted: float | None, logged: float, unit_gib: float = 1.0) -> bool | None:
    if predicted is None:
        return None
    return abs(predicted - logged) <= max(TOLERANCE_PCT / 100 * abs(logged), TOLERANCE_GIB / unit_gib)


def _model(entry: dict):
    from kvbench.planner import resolve_model
    name = entry.get("model") or ""
    if not name:
        return None
    local = CONFIGS / f"{name}.json"
    return resolve_model(str(local) if local.exists() else name, entry.get("weights_dtype", "auto"))


def plan_input(entry: dict, before: bool):
    from kvbench.planner import PlanInput
    settings = dict(entry.get("settings", {}))
    limit = settings.pop("max_model_len", None) or settings.pop("n_ctx", None)
    kv_dtype = settings.pop("kv_cache_dtype", "auto")
    options = {k: v for k, v in settings.items() if v is not None}
    m = _model(entry)
    return PlanInput(model=m, engine=entry["engine"], gpu=entry["gpu"], tp=max(1, entry.get("tp", 1)),
                     engine_version=entry.get("engine_version"), engine_options=options, max_model_len=limit,
                     allow_long_context=True, kv_dtype=kv_dtype, margin=0.10 if before else None)


def _view(p):
    from kvbench.planner import setup
    from kvbench.planner.capacity import capacity, kv_room
    from kvbench.planner.startup import startup_view
    s = setup(p)
    view = startup_view(s)
    if view is not None:
        return s, view
    # the planner as it was: the budget is usable - weights - overhead
    room = kv_room(s)
    out = {"kv_budget_bytes": room, "refusal": None, "klass": "", "terms": []}
    if s.rules.pool_from_budget:
        cap = capacity(s, max(room, 0.0))
        out.update(pool_bytes=cap.blocks * s.rules.bytes_per_block(s.question(context=s.limit, batch=1)),
                   concurrency=cap.requests_at_limit)
    one = s.kv_bytes(context=s.limit, batch=1, limit=s.limit)
    if room <= 0 or one > room:
        out["refusal"] = "does not fit"
    return s, out


def rows_for(entry: dict) -> list[Row]:
    from kvbench.planner import PlanError
    out: list[Row] = []
    logged = entry.get("logged", {})
    name, engine, split = entry["file"], entry["engine"], entry.get("split", "holdout")

    def row(check, lv, b, a, unit, ok, ok_b=None, note="", klass=""):
        out.append(Row(name, engine, check, split, klass, lv, b, a, unit, ok, ok_b, note))

    checks = entry["checks"]
    can_plan = bool(entry.get("model")) and bool(entry.get("gpu"))
    if "unverified" in checks:
        row("class", "unverified", None, None, "", None, note=entry.get("check_note", ""))
    if can_plan and ({"pool", "refusal"} & set(checks)):
        try:
            s_b, before = _view(plan_input(entry, before=True))
            s_a, after = _view(plan_input(entry, before=False))
        except PlanError as exc:
            row("plan", None, None, str(exc), "", False)
            return out
        klass = after.get("class", "")
        if "pool" in checks and "kv_gib" not in logged and "tokens" in logged:  # an engine that logs tokens only
            b, a = before.get("pool_tokens"), after.get("pool_tokens")
            row("pool tokens", logged["tokens"], b, a, "tokens", close(a, logged["tokens"], 1e12),
                close(b, logged["tokens"], 1e12), klass=klass)
        if "pool" in checks and "kv_gib" in logged:
            key = "pool_bytes" if engine == "sglang" else "kv_budget_bytes"
            b, a = before.get(key, 0) / GIB, after.get(key, 0) / GIB
            row("KV pool", logged["kv_gib"], round(b, 2), round(a, 2), "GiB", close(a, logged["kv_gib"]),
                close(b, logged["kv_gib"]), klass=klass)
            if "concurrency" in logged:
                want = math.floor(logged["concurrency"])
                b = math.floor(before.get("concurrency") or 0)
                a = math.floor(after.get("concurrency") or 0)
                row("requests at the limit", want, b, a, "", a == want, b == want, klass=klass)
        if "refusal" in checks:
            row("refusal", "refused", "refused" if before.get("refusal") else "starts",
                "refused" if after.get("refusal") else "starts", "", bool(after.get("refusal")),
                bool(before.get("refusal")), note=after.get("refusal") or "", klass=klass)
    if "concurrency" in checks and entry.get("model"):
        from kvbench.kv.rules import KVQuestion
        from kvbench.planner import engine_rules
        m = _model(entry)
        rules = engine_rules(engine)
        limit = entry["settings"]["max_model_len"]
        q = KVQuestion(m.geometry, context=limit, tp=max(1, entry.get("tp", 1)), version=entry.get("engine_version"))
        conc = logged["blocks"] / rules.blocks_per_sequence(q, limit)
        row("concurrency from blocks", logged["concurrency"], None, round(conc, 2), "x",
            round(conc, 2) == logged["concurrency"])
    if "one_request" in checks and entry.get("model"):
        # the KV one request at the limit takes on one GPU under the engine's rules, as the engine printed it
        # (vLLM's refusal "(X GiB KV cache is needed ..."): two decimals of GiB
        from kvbench.kv.rules import KVQuestion, KVRules
        from kvbench.planner import engine_rules
        m = _model(entry)
        limit = entry["settings"]["max_model_len"]
        q = KVQuestion(m.geometry, entry["settings"].get("kv_cache_dtype", "auto"), limit, 1,
                       tp=max(1, entry.get("tp", 1)), version=entry.get("engine_version"))
        a = engine_rules(engine).answer(q).bytes_per_gpu / GIB
        b = KVRules().answer(q).bytes_per_gpu / GIB  # the plain formula, for the "before" column
        row("one request at the limit", logged["one_request_gib"], round(b, 4), round(a, 4), "GiB",
            round(a, 2) == logged["one_request_gib"], round(b, 2) == logged["one_request_gib"])
    if "terms" in checks:
        out += term_rows(entry)
    return out


def term_rows(entry: dict) -> list[Row]:
    """Single terms of the engine's rule against the logged figure."""
    from kvbench.planner import gpu as gpu_spec
    from kvbench.planner import setup
    out: list[Row] = []
    logged = entry.get("logged", {})
    name, engine, split = entry["file"], entry["engine"], entry.get("split", "holdout")
    if entry.get("gpu") and "cuda_total_gib" in logged:
        g = gpu_spec(entry["gpu"])
        a = g.cuda_memory()[0] / GIB
        out.append(Row(name, engine, "CUDA's total", split, "", logged["cuda_total_gib"], round(g.bytes / GIB, 2),
                       round(a, 2), "GiB", close(a, logged["cuda_total_gib"], 1e9),
                       close(g.bytes / GIB, logged["cuda_total_gib"], 1e9)))
    if engine == "sglang" and "avail_after_load_gib" in logged:
        g = gpu_spec(entry["gpu"])
        frac = entry["settings"]["mem_fraction_static"]
        budget = logged["avail_after_load_gib"] - g.cuda_memory()[0] / GIB * (1 - frac)
        out.append(Row(name, engine, "refusal (pool rule on the logged figures)", split, "", "refused", None,
                       "refused" if budget <= 0 else f"starts ({budget:.2f} GiB)", "", budget <= 0))
    model = entry.get("model")
    if engine == "vllm":
        from kvbench.planner import PlanInput, resolve_model
        from kvbench.selfcheck.engines import engine_module
        gpumem = engine_module(engine, "gpumem")
        m = _model(entry) if model else resolve_model("llama-3-8b")  # a stand-in: the terms below need no model
        gpu = entry.get("gpu") or "RTX-3090"
        p = PlanInput(model=m, engine="vllm", gpu=gpu, tp=max(1, entry.get("tp", 1) or 2),
                      engine_version=entry.get("engine_version"),
                      engine_options={k: v for k, v in entry.get("settings", {}).items()
                                      if k in ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs",
                                               "enforce_eager")},
                      max_model_len=entry.get("settings", {}).get("max_model_len"), allow_long_context=True)
        s = setup(p)
        q = s.startup_question()
        if "non_torch_gib" in logged:
            a = gpumem.non_torch(q, s.rules).bytes / GIB
            out.append(Row(name, engine, "non-torch memory", split, "", logged["non_torch_gib"], 0.0, round(a, 2),
                           "GiB", close(a, logged["non_torch_gib"])))
        if "activation_gib" in logged and model and q.widths is not None:
            a = gpumem.activation_peak(q, s.rules).bytes / GIB
            out.append(Row(name, engine, "profile peak", split, "", logged["activation_gib"], 0.0, round(a, 2),
                           "GiB", close(a, logged["activation_gib"])))
        if "cudagraph_estimate_gib" in logged and model:
            # vLLM's CUDA-graph estimate (logged from 0.19, out of the pool from 0.21); its class says on which GPUs
            # the model of it is checked (gpumem.CUDAGRAPH_CHECKED_MAJORS)
            a = gpumem.cudagraph_estimate(q, s.rules)[0] / GIB
            checked = gpumem.cudagraph_checked(q)
            out.append(Row(name, engine, "CUDA-graph estimate", split,
                           "vllm cuda graphs " + ("hopper tp1" if checked else "other"), logged["cudagraph_estimate_gib"],
                           0.0, round(a, 2), "GiB", close(a, logged["cudagraph_estimate_gib"])))
        if "weights_gib" in logged and model:
            delta = gpumem.weights_delta(q)
            a = (q.weights_bytes + (delta.bytes if delta else 0)) / GIB
            out.append(Row(name, engine, "weights as loaded", split, "", logged["weights_gib"],
                           round(q.weights_bytes / GIB, 2), round(a, 2), "GiB", close(a, logged["weights_gib"]),
                           close(q.weights_bytes / GIB, logged["weights_gib"])))
    if engine == "llamacpp" and model:
        from kvbench.backends.shared import llama_server_gpumem as lgm
        from kvbench.kv.startup import StartupQuestion
        from kvbench.planner import engine_rules
        from kvbench.kv.rules import KVQuestion
        m = _model(entry)
        st = entry["settings"]
        opts = {"n_ubatch": st["n_ubatch"], "flash_attn": st["flash_attn"]}
        q = KVQuestion(m.geometry, "f16", st["n_ctx"], 1, options=opts)
        rules = engine_rules("llamacpp")
        a = rules.deployment(q, st["n_ctx"])
        sq = StartupQuestion(q, st["n_ctx"], "", 0, 0, "", 0, m.widths)
        kv = a.bytes_per_gpu / MIB
        comp = lgm.compute_buffer(sq, a.tokens_full).bytes / MIB
        out.append(Row(name, engine, "KV cache", split, "", logged["kv_mib"], None, round(kv, 2), "MiB",
                       kv == logged["kv_mib"]))
        out.append(Row(name, engine, "compute buffer", split, "", logged["compute_mib"], 0.0, round(comp, 2), "MiB",
                       close(comp, logged["compute_mib"], 1 / 1024)))
    return out


def all_rows(folder: Path = CORPUS) -> list[Row]:
    return [r for e in corpus(folder) for r in rows_for(e)]


def table(rows: list[Row]) -> str:
    head = "| log | check | split | logged | before | after | ok before | ok after |\n|---|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        fmt = lambda v: "" if v is None else (f"{v:,}" if isinstance(v, (int, float)) else str(v))  # noqa: E731
        mark = lambda v: "" if v is None else ("yes" if v else "**no**")  # noqa: E731
        lines.append(f"| {r.log.removesuffix('.toml')} | {r.check} | {r.split} | {fmt(r.logged)} {r.unit} | "
                     f"{fmt(r.before)} | {fmt(r.after)} | {mark(r.ok_before)} | {mark(r.ok)} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    out = []
    for split in ("fit", "holdout"):
        rs = [r for r in rows if r.split == split and r.ok is not None]
        b = [r for r in rs if r.ok_before is not None]
        out.append(f"{split}: {sum(r.ok for r in rs)}/{len(rs)} checks within {TOLERANCE_PCT:g} % or "
                   f"{TOLERANCE_GIB} GiB after; before: {sum(bool(r.ok_before) for r in b)}/{len(b)} of those "
                   "it can answer")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rows = all_rows()
    if "--json" in argv:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    print(table(rows))
    print()
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
