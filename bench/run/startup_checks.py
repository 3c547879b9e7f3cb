"""Every GPU run is one more check of `kvbench plan` (issue 35 item 4): the engine's own figures at startup, read
from its log by its adapter (``Backend.startup_figures_from_log``), set beside what the planner says the same
deployment logs (:func:`kvbench.planner.planned_figures`: the engine's startup rule on the GPU NVML names, or the
KV budget the server was told to take), with how far the plan was off. The runner records the result in run.json
(``startup_checks``, one per engine start) and the report shows it (bench/reports/startup.py).

On a CPU a start is checked only where its engine logs its pool (vLLM's "CPU KV cache size: N tokens, Maximum
concurrency ...", llama.cpp's KV buffer): the plan's figure is then the pool of the budget or the slots kvbench
started it with, which is exact arithmetic of the engine's rules.

Pure: the runner passes the log's figures and the deployment (:class:`Start`); nothing here starts anything or
names an engine.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvbench.kv.units import GIB
from kvbench.planner import PlanError, PlanInput, gpu_of_device, planned_figures, resolve_model, setup

TOLERANCE_PCT, TOLERANCE_GIB = 5.0, 0.5  # as the corpus of public startup logs is checked (docs/plan.md)
PRINTED_GIB = 0.005  # half the last digit of a figure printed as "0.01 GiB"
#: The figures set side by side: (key, what it is, unit); bytes are per GPU.
COMPARED = (("kv_budget_bytes", "KV memory", "bytes"), ("kv_pool_bytes", "KV pool", "bytes"),
            ("pool_tokens", "pool tokens", "tokens"), ("blocks", "blocks", "blocks"),
            ("concurrency", "maximum concurrency", "x"), ("one_request_bytes", "one request at the limit", "bytes"),
            ("weights_bytes", "weights", "bytes"),
            ("cuda_total_bytes", "CUDA's total", "bytes"))
#: What makes a start on a CPU worth a check: the engine logged its pool.
POOL_KEYS = {"kv_budget_bytes", "kv_pool_bytes", "pool_tokens", "concurrency"}


@dataclass(frozen=True)
class Start:
    """One engine start, as the plan of the same deployment needs it."""

    engine: str
    version: str | None
    model: str  # what the planner reads (resolve_model): the file or folder the engine loaded
    tp: int
    max_model_len: int | None  # the server's limit (None: the model's own)
    settings: dict = field(default_factory=dict)  # Backend.startup_settings
    gpu_name: str | None = None  # NVML's name of the GPU the engine ran on (None: no GPU)
    gpu_bytes: int | None = None  # its total as NVML reports it
    started: bool = True  # False: the start failed (its log may hold the engine's refusal)

    @property
    def device(self) -> str:
        return "gpu" if self.gpu_name and self.settings.get("device", "gpu") == "gpu" else "cpu"


def plan_input(start: Start, resolve=resolve_model) -> PlanInput:
    """The deployment ``start`` as `kvbench plan` takes it: its model, engine, version, split, limit, KV dtype, the
    engine options its startup rule reads, the slots its cache is allocated for, and its GPU (by NVML's name and
    total) or the CPU."""
    s = start.settings
    gpu = gpu_of_device(start.gpu_name, int(start.gpu_bytes or 0)) if start.device == "gpu" else None
    return PlanInput(model=resolve(start.model), engine=start.engine, gpu=gpu, tp=max(1, start.tp),
                     engine_version=start.version, engine_options=dict(s.get("engine_options") or {}),
                     max_model_len=start.max_model_len, allow_long_context=True, kv_dtype=s.get("kv_dtype") or "auto",
                     batch=max(1, int(s.get("batch") or 1)), device=start.device)


def planned(start: Start, resolve=resolve_model) -> dict:
    """The plan's figures for ``start`` (:func:`kvbench.planner.planned_figures`), or ``not_planned`` with why."""
    if start.settings.get("not_planned"):
        return {"not_planned": start.settings["not_planned"]}
    if start.device == "gpu" and start.settings.get("kv_budget_bytes") is None and not start.gpu_bytes:
        return {"not_planned": "the GPU's memory was not read (NVML)"}
    try:
        s = setup(plan_input(start, resolve))
        out = planned_figures(s, start.settings.get("kv_budget_bytes"), start.settings.get("pool_tokens_cap"))
    except PlanError as exc:
        return {"not_planned": str(exc)}
    return out or {"not_planned": f"{start.engine} sizes its pool itself on a {start.device}, which kvbench has no "
                                  "startup rule for"}


def _within(key: str, logged: float, plan: float, device: str = "gpu") -> bool:
    if key == "concurrency":  # the requests at the limit it holds are whole: they must be equal
        return math.floor(plan + 1e-9) == math.floor(logged + 1e-9)
    # the 0.5 GiB is a GPU budget's (CUDA's context and the allocator's rounding move a pool that much); on a CPU
    # the engine allocates what it was told, and 0.5 GiB would pass a small model's pool twice too large: there
    # the slack is what the coarsest figure is printed to (vLLM's GiB with two decimals)
    slack = (TOLERANCE_GIB * GIB if device == "gpu" else PRINTED_GIB * GIB) if key.endswith("_bytes") else 0.0
    return abs(plan - logged) <= max(TOLERANCE_PCT / 100 * abs(logged), slack)


def off_by(figures: dict, plan: dict, started: bool = True, device: str = "gpu") -> dict:
    """Each figure both sides have: ``{"logged", "planned", "error_pct" (planned over logged, less 1), "ok"}``;
    byte figures within 5 % (or 0.5 GiB on a GPU, 0.005 GiB on a CPU), tokens and blocks within 5 %, the requests at the limit equal;
    and whether the engine refused to start against whether the plan says it would (``ok`` None: a start that
    failed without the engine's refusal in its log, not judged)."""
    out: dict = {}
    for key, _, _ in COMPARED:
        logged, p = figures.get(key), plan.get(key)
        if logged is None or p is None:
            continue
        limit = {"concurrency": "concurrency_limit", "one_request_bytes": "one_request_limit"}.get(key)
        if limit and figures.get(limit) not in (None, plan.get(limit)):
            continue  # a figure at another limit than the plan's
        error = (p / logged - 1) * 100 if logged else None
        out[key] = {"logged": logged, "planned": p, "error_pct": None if error is None else round(error, 2),
                    "ok": _within(key, float(logged), float(p), device)}
    for term, logged in (figures.get("terms") or {}).items():
        p = (plan.get("terms") or {}).get(term)
        if p is not None:
            out[f"term: {term}"] = {"logged": logged, "planned": p,
                                    "error_pct": round((p / logged - 1) * 100, 2) if logged else None,
                                    "ok": _within("term_bytes", logged, p, device)}
    if "not_planned" not in plan:
        refused = bool(figures.get("refusal")) or (not started and figures.get("kv_budget_bytes", 1) <= 0)
        logged = "refused" if refused else "started" if started else "failed to start"
        out["refusal"] = {"logged": logged, "planned": "refused" if plan.get("refusal") else "starts",
                          # a start that failed without the engine's refusal in its log is not judged
                          "ok": refused == bool(plan.get("refusal")) if started or refused else None}
    return out


def verdict(diffs: dict, plan: dict) -> str:
    """One phrase for the report: within the tolerance, or which way the plan was off on the pool."""
    if "not_planned" in plan:
        return "not planned: " + plan["not_planned"]
    judged = {k: d for k, d in diffs.items() if d["ok"] is not None}
    if not judged:
        return "nothing to compare"
    if all(d["ok"] for d in judged.values()):
        return "plan within tolerance"
    if "refusal" in judged and not judged["refusal"]["ok"]:
        return ("plan says it starts; the engine refused" if diffs["refusal"]["logged"] == "refused"
                else "plan says it refuses; the engine started")
    key = next((k for k, _, _ in COMPARED if k in judged and not judged[k]["ok"]), None)
    if key is None:
        return "plan off on a term of its ledger"
    d = diffs[key]
    way = "optimistic" if d["planned"] > d["logged"] else "pessimistic"
    return f"plan {way}: {dict((k, w) for k, w, _ in COMPARED)[key]} off by {d['error_pct']:+.1f} %"


def startup_check(figures: dict | None, start: Start, resolve=resolve_model) -> dict | None:
    """The record of one start (run.json ``startup_checks[start key]``): ``engine`` (its figures), ``planned``,
    ``off_by``, ``verdict`` and the ``deployment`` planned. None where there is nothing to check: no figures, or a
    start on a CPU whose engine logged no pool."""
    if not figures:
        return None
    if start.device == "cpu" and not POOL_KEYS & set(figures):
        return None
    plan = planned(start, resolve)
    diffs = off_by(figures, plan, start.started, start.device)
    deployment = {k: v for k, v in asdict(start).items() if k != "settings"} | {
        "device": start.device, "settings": {k: v for k, v in start.settings.items() if v is not None},
        "gpu_planned": plan.get("gpu")}
    return {"engine": figures, "planned": plan, "off_by": diffs, "verdict": verdict(diffs, plan),
            "deployment": deployment}
