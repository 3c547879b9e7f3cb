"""Re-plan every public startup log of tests/data/startup_logs/ and set the plan beside the engine's own figures.

    python -m kvbench.selfcheck.startup_logs          # every check: the figure logged and planned as shipped
    python -m kvbench.selfcheck.startup_logs --json   # the rows
    python -m kvbench.selfcheck.startup_fit           # the same with each source left out of the fit, and accuracy

Each log is planned twice: with the constants as shipped (fitted on the whole corpus: ``planned``) and with the
constants fitted without the log's own source (``loso``, kvbench.selfcheck.startup_fit): the second is what a
user whose deployment kvbench never saw would get. docs/plan.md shows the tables and the error per engine and
per class (kvbench.selfcheck.startup_fit's accuracy table).
"""
from __future__ import annotations

import functools
import json
import math
import sys
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvbench.kv.units import GIB, MIB

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "startup_logs"
CONFIGS = ROOT / "tests" / "data" / "configs"
TOLERANCE_PCT, TOLERANCE_GIB = 5.0, 0.5

#: [logged] keys that are one ledger term's figure, and the term's name in the engine's ledger
TERMS = {"non_torch_gib": "non-torch memory", "activation_gib": "profile peak", "preload_gib": "before loading",
         "cudagraph_estimate_gib": "CUDA-graph estimate"}
#: what each checked figure is called in a row, and its unit's bytes (None: a count)
CHECKS = {"kv_gib": ("KV pool", GIB), "tokens": ("pool tokens", None), "concurrency": ("requests at the limit", None),
          "refusal": ("refusal", None), "non_torch_gib": ("non-torch memory", GIB),
          "activation_gib": ("profile peak", GIB), "preload_gib": ("before loading", GIB),
          "cudagraph_estimate_gib": ("CUDA-graph estimate", GIB), "weights_gib": ("weights as loaded", GIB),
          "cuda_total_gib": ("CUDA's total", GIB), "kv_mib": ("KV cache", MIB), "compute_mib": ("compute buffer", MIB),
          "free_at_load_mib": ("free at load", MIB),
          "one_request_gib": ("one request at the limit", GIB),
          "blocks_concurrency": ("concurrency from blocks", None), "draft_kv_mib": ("draft KV cache", MIB)}
CONSUMER_PREFIX = "RTX-"  # GeForce cards (RTX-3090 ... RTX-5090); workstation cards are named A6000, RTX-6000-Ada
WORKSTATION = ("RTX-6000-Ada", "RTX-A4000", "RTX-A5000")


@dataclass
class Row:
    log: str
    engine: str
    check: str  # KV pool, requests at the limit, refusal, a term's name ...
    klass: str  # the engine rule's class of deployment ("vllm v1 dense")
    logged: float | str | None
    planned: float | str | None  # with the constants as shipped
    loso: float | str | None  # with the constants fitted without this log's source
    unit: str
    ok: bool | None  # planned within the tolerance (None: not checkable)
    ok_loso: bool | None = None
    note: str = ""
    source_id: str = ""
    classes: list[str] = field(default_factory=list)  # dense / moe / mla / hybrid / quantised / tp>1 / consumer

    def error(self, loso: bool = True) -> float | None:
        """Signed error of a figure (planned - logged, in the row's unit); None for a verdict or a count."""
        value = self.loso if loso else self.planned
        if not isinstance(value, (int, float)) or not isinstance(self.logged, (int, float)) or self.unit in ("", "x"):
            return None
        return float(value) - float(self.logged)


def corpus(folder: Path = CORPUS) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*.toml")):
        entry = tomllib.loads(path.read_text())
        entry["file"] = path.name
        checks = entry.get("check", [])
        entry["checks"] = [checks] if isinstance(checks, str) else list(checks)
        entry.setdefault("source_id", source_id(entry["source"]))
        out.append(entry)
    return out


def source_id(url: str) -> str:
    """A log's source for leave-one-source-out: the thread, pull request or page it was published in."""
    parts = url.removeprefix("https://").removeprefix("http://").split("/")
    if parts[0] == "github.com" and len(parts) >= 5 and parts[3] in ("issues", "pull", "discussions"):
        return f"{parts[1]}/{parts[2]}#{parts[4]}"
    if parts[0] == "github.com" and len(parts) >= 3:
        return f"{parts[1]}/{parts[2]}"  # a repository's files are one deployment's write-up
    return "/".join(parts[:2])


def close(predicted: float | None, logged: float, unit_gib: float = 1.0) -> bool | None:
    if predicted is None:
        return None
    return abs(predicted - logged) <= max(TOLERANCE_PCT / 100 * abs(logged), TOLERANCE_GIB / unit_gib)


def _model(entry: dict):
    name = entry.get("model") or ""
    return _resolved(name, entry.get("weights_dtype", "auto")) if name else None


@functools.lru_cache(maxsize=None)
def _resolved(name: str, weights_dtype: str):
    """A model as the planner reads it, once per process (the fit plans each log many times)."""
    from kvbench.planner import resolve_model
    local = CONFIGS / f"{name}.json"
    return resolve_model(str(local) if local.exists() else name, weights_dtype)


def plan_input(entry: dict, model=None):
    """The deployment the log shows, as `kvbench plan` takes it (no model: a stand-in for terms that need none)."""
    from kvbench.planner import PlanInput, resolve_model
    settings = dict(entry.get("settings", {}))
    limit = settings.pop("max_model_len", None) or settings.pop("n_ctx", None) or settings.pop("context_length", None)
    kv_dtype = settings.pop("kv_cache_dtype", "auto")
    m = model or _model(entry) or resolve_model("llama-3-8b")
    options = {k: v for k, v in settings.items() if v is not None and k in rule_options(entry["engine"])}
    spec = entry.get("speculation") or {}
    return PlanInput(model=m, engine=entry["engine"], gpu=entry.get("gpu") or None, tp=max(1, entry.get("tp", 1)),
                     speculative=spec.get("method"), speculative_tokens=spec.get("tokens"),
                     draft_model=_model({"model": spec["draft_model"]}) if spec.get("draft_model") else None,
                     draft_label=spec.get("draft_model", ""),
                     pp=max(1, entry.get("pp", 1)), engine_version=entry.get("engine_version"), engine_options=options,
                     max_model_len=limit, allow_long_context=True, kv_dtype=kv_dtype,
                     interconnect=entry.get("interconnect") if entry.get("interconnect") in ("nvlink", "pcie") else None)


def rule_options(engine: str) -> tuple[str, ...]:
    from kvbench.planner import engine_rules
    return tuple(engine_rules(engine).rule_options)


def classes_of(entry: dict, model) -> list[str]:
    """The classes the issue reports accuracy by: dense or moe, mla, hybrid, quantised, tp>1, consumer."""
    out = []
    widths = model.widths if model is not None else None
    out.append("moe" if widths is not None and widths.experts else "dense")
    geom = model.geometry if model is not None else None
    if geom is not None and geom.mla is not None:
        out.append("mla")
    if geom is not None and any(layer.kind != "full" for layer in geom.layers):
        out.append("hybrid")
    if entry.get("weights_dtype") or (model is not None and model.quantised):
        out.append("quantised")
    if max(entry.get("tp", 1), entry.get("pp", 1), entry.get("dp", 1)) > 1:
        out.append("tp>1")
    gpu = entry.get("gpu") or ""
    if gpu.startswith(CONSUMER_PREFIX) and gpu not in WORKSTATION:
        out.append("consumer")
    return out


def figures(entry: dict) -> dict:
    """What kvbench plans for each figure the log shows, keyed as its [logged] figures (GiB and MiB as logged),
    plus ``class`` (the rule's class) and ``classes``. Planned with the engine constants in force."""
    from kvbench.planner import PlanError, setup
    from kvbench.planner.startup import startup_view
    out: dict = {}
    logged, engine, checks = entry.get("logged", {}), entry["engine"], entry["checks"]
    try:
        model = _model(entry)
    except PlanError as exc:
        return {"classes": classes_of(entry, None), "plan_error": str(exc)}
    out["classes"] = classes_of(entry, model)
    if engine == "llamacpp" and model is not None:
        return {**out, **_llamacpp_figures(entry, model)}
    if not entry.get("gpu") or not ({"pool", "refusal", "terms"} & set(checks)):
        return out
    try:
        s = setup(plan_input(entry, model))
    except PlanError as exc:
        return {**out, "plan_error": str(exc)}
    view = startup_view(s)
    if view is None:
        return {**out, "plan_error": "no startup rule for this deployment"}
    out["class"] = view["class"]
    terms = {t["term"]: t["bytes"] for t in view["terms"]}
    if model is not None:
        out["kv_gib"] = (view["pool_bytes"] if engine == "sglang" else view["kv_budget_bytes"]) / GIB
        out["tokens"] = view.get("pool_tokens")
        out["concurrency"] = view.get("concurrency")
        out["refusal"] = view.get("refusal")
        out["weights_gib"] = ((view["weights_bytes"] or 0) + terms.get("weights as loaded", 0)) / GIB
    out["cuda_total_gib"] = view["cuda_bytes"] / GIB
    for key, term in TERMS.items():
        if term in terms:
            out[key] = terms[term] / GIB
    if engine == "sglang" and "preload_gib" in out:  # SGLang's pool loses what it held before loading x its fraction
        out["preload_gib"] /= view["fraction"]
    if engine == "vllm" and {"cudagraph_estimate_gib", "cudagraph_first_mib"} & set(logged) and model is not None:
        from kvbench.selfcheck.engines import startup_rule_module
        gpumem = startup_rule_module(engine)
        q = s.startup_question()
        out["cudagraph_estimate_gib"] = gpumem.cudagraph_estimate(q, s.rules)[0] / GIB
        out["cudagraph_first_mib"] = gpumem.FITTED["cudagraph_first_mib"]
        out["cudagraph_per_graph_mib"] = gpumem.FITTED["cudagraph_per_graph_mib"]
        out["cudagraph_checked"] = gpumem.cudagraph_checked(q)
    if "activation_gib" in out and model is None:
        del out["activation_gib"]  # the stand-in's widths are not the log's model's
    return out


def _llamacpp_figures(entry: dict, model) -> dict:
    from kvbench.kv.rules import KVQuestion
    from kvbench.kv.startup import StartupQuestion
    from kvbench.planner import engine_rules
    from kvbench.selfcheck.engines import startup_rule_module
    gpumem = startup_rule_module("llamacpp")
    st = entry["settings"]
    opts = {k: st[k] for k in ("n_ubatch", "flash_attn") if k in st}
    kv_dtype = st.get("cache_type_k", "f16")
    q = KVQuestion(model.geometry, kv_dtype, st["n_ctx"], 1, options=opts)
    rules = engine_rules("llamacpp")
    a = rules.deployment(q, st["n_ctx"])
    sq = StartupQuestion(q, st["n_ctx"], "", 0, 0, "", 0, model.widths)
    out = {"kv_mib": a.bytes_per_gpu / MIB, "compute_mib": gpumem.compute_buffer(sq, a.tokens_full).bytes / MIB,
           "class": "llamacpp cuda " + ("flash-attn" if gpumem._flash(sq) else "no-flash-attn")}
    if entry.get("speculation"):  # the drafter's own context (KVRules.draft_kv), as `kvbench plan --speculative`
        from kvbench.planner import setup
        s = setup(plan_input(entry, model))
        out["draft_kv_mib"] = s.draft(st["n_ctx"]).bytes_per_gpu / MIB
    if entry.get("gpu"):  # what llama.cpp finds free at load: CUDA's total less what the context and others hold
        from kvbench.planner import PlanError, gpu
        try:
            cuda = gpu(entry["gpu"]).cuda_memory()[0]
        except PlanError:
            return out
        out["free_at_load_mib"] = (cuda - gpumem.not_free_at_load().bytes) / MIB
    return out


def rows_for(entry: dict, loso: dict | None = None) -> list[Row]:
    """The checks of one log: ``loso`` is :func:`figures` of the log planned without its source's fit."""
    out: list[Row] = []
    logged, name, engine = entry.get("logged", {}), entry["file"], entry["engine"]
    checks = entry["checks"]
    got = figures(entry)
    loso = got if loso is None else loso
    alone = loso.get("only_its_own_source")
    if alone:  # planned without its source, the plan reads a constant no other source measures: no left-out figures
        return [r if r.check in ARITHMETIC else replace(
                    r, loso=None, ok_loso=None, note=f"left out: only its own source measures {', '.join(alone)}")
                for r in rows_for(entry)]
    klass, classes = got.get("class", ""), got.get("classes", [])

    def row(check, lv, a, b, unit, ok, ok_b, note="", k=None):
        out.append(Row(name, engine, check, klass if k is None else k, lv, a, b, unit, ok, ok_b, note,
                       entry["source_id"], classes))

    if "unverified" in checks:
        row("class", "unverified", None, None, "", None, None, note=entry.get("check_note", ""), k="")
    if "plan_error" in got:
        row("plan", None, got["plan_error"], None, "", False, False)
        return out
    for key, value in logged.items():
        if key not in CHECKS or key in ("concurrency", "refusal") or got.get(key) is None:
            continue
        if key in ("kv_gib", "tokens") and "pool" not in checks:
            continue
        if key == "tokens" and "kv_gib" in logged:
            continue  # the pool is checked in GiB where both are logged
        label, unit = CHECKS[key]
        if key in ("kv_mib", "draft_kv_mib"):
            a, b = got[key], loso.get(key)
            row(label, value, round(a, 2), b and round(b, 2), "MiB", a == value, b == value)
            continue
        scale = 1e12 if unit is None else (unit / GIB)
        a, b = got[key], loso.get(key)
        k = None
        if key == "cudagraph_estimate_gib":
            k = "vllm cuda graphs " + ("hopper tp1" if got.get("cudagraph_checked") else "other")
        row(label, value, round(a, 2), None if b is None else round(b, 2),
            "tokens" if unit is None else ("MiB" if unit == MIB else "GiB"), close(a, value, scale),
            close(b, value, scale), k=k)
        if key == "kv_gib" and "concurrency" in logged:
            want = math.floor(logged["concurrency"])
            a, b = math.floor(got.get("concurrency") or 0), math.floor(loso.get("concurrency") or 0)
            row("requests at the limit", want, a, b, "", a == want, b == want)
    if "refusal" in checks and "refusal" in got:
        a, b = bool(got.get("refusal")), bool(loso.get("refusal"))
        row("refusal", "refused", "refused" if a else "starts", "refused" if b else "starts", "", a, b,
            note=got.get("refusal") or "")
    if engine == "sglang" and "avail_after_load_gib" in logged and "mem_fraction_static" in entry.get("settings", {}):
        from kvbench.planner import gpu as gpu_spec
        g = gpu_spec(entry["gpu"])
        frac = entry["settings"]["mem_fraction_static"]
        budget = logged["avail_after_load_gib"] - g.cuda_memory()[0] / GIB * (1 - frac)
        verdict = "refused" if budget <= 0 else f"starts ({budget:.2f} GiB)"
        if "refusal" in checks:
            row("refusal (pool rule on the logged figures)", "refused", verdict, verdict, "", budget <= 0,
                budget <= 0, k="")
    _arithmetic_rows(entry, row)
    return out


ARITHMETIC = ("concurrency from blocks", "one request at the limit")  # the checks of _arithmetic_rows


def _arithmetic_rows(entry: dict, row) -> None:
    """Checks of the KV rules alone (no constant): concurrency from a logged block count, one request's KV."""
    from kvbench.kv.rules import KVQuestion
    from kvbench.planner import engine_rules
    logged, checks, engine = entry.get("logged", {}), entry["checks"], entry["engine"]
    if "concurrency" in checks and entry.get("model"):
        m = _model(entry)
        rules = engine_rules(engine)
        limit = entry["settings"]["max_model_len"]
        q = KVQuestion(m.geometry, context=limit, tp=max(1, entry.get("tp", 1)), version=entry.get("engine_version"))
        conc = round(logged["blocks"] / rules.blocks_per_sequence(q, limit), 2)
        row("concurrency from blocks", logged["concurrency"], conc, conc, "x", conc == logged["concurrency"],
            conc == logged["concurrency"], k="")
    if "one_request" in checks and entry.get("model"):
        # the KV one request at the limit takes on one GPU under the engine's rules, as the engine printed it
        # (vLLM's refusal "(X GiB KV cache is needed ..."): two decimals of GiB
        m = _model(entry)
        limit = entry["settings"]["max_model_len"]
        q = KVQuestion(m.geometry, entry["settings"].get("kv_cache_dtype", "auto"), limit, 1,
                       tp=max(1, entry.get("tp", 1)), version=entry.get("engine_version"))
        a = round(engine_rules(engine).answer(q).bytes_per_gpu / GIB, 4)
        ok = round(a, 2) == logged["one_request_gib"]
        row("one request at the limit", logged["one_request_gib"], a, a, "GiB", ok, ok, k="")


def all_rows(folder: Path = CORPUS) -> list[Row]:
    """Every check of the corpus with the constants as shipped (the left-out column equal to it:
    kvbench.selfcheck.startup_fit.all_rows plans each log without its source's fit)."""
    return [r for e in corpus(folder) for r in rows_for(e)]


def table(rows: list[Row], loso: bool = True) -> str:
    """The checks as a markdown table; ``loso`` False leaves out the left-out columns (rows of :func:`all_rows`)."""
    fmt = lambda v: "" if v is None else (f"{v:,}" if isinstance(v, (int, float)) else str(v))  # noqa: E731
    mark = lambda v: "" if v is None else ("yes" if v else "**no**")  # noqa: E731
    cols = ["log", "check", "logged", "planned", "ok"] + (["left out", "ok left out"] if loso else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r.log.removesuffix(".toml"), r.check, f"{fmt(r.logged)} {r.unit}", fmt(r.planned), mark(r.ok)]
        lines.append("| " + " | ".join(cells + ([fmt(r.loso), mark(r.ok_loso)] if loso else [])) + " |")
    return "\n".join(lines)


def summary(rows: list[Row], loso: bool = True) -> str:
    rs = [r for r in rows if r.ok is not None]
    out = (f"{sum(bool(r.ok) for r in rs)}/{len(rs)} checks within {TOLERANCE_PCT:g} % or {TOLERANCE_GIB} GiB "
           "with the shipped constants")
    if not loso:
        return out
    b = [r for r in rows if r.ok_loso is not None]
    return out + f"; {sum(bool(r.ok_loso) for r in b)}/{len(b)} with each source left out of the fit"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rows = all_rows()
    if "--json" in argv:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    print(table(rows, loso=False))
    print()
    print(summary(rows, loso=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
