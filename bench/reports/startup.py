"""The engines' own figures at startup beside the plan's (run.json ``startup_checks``, recorded by the runner:
bench/run/startup_checks.py): per engine start, the KV memory or pool it logged against what `kvbench plan`
says the same deployment gets, its pool's tokens, the requests at its limit it holds at once, and whether it
started. A first GPU run says this way how far the plan was off; a CPU run shows it where the engine logs its
pool."""
from __future__ import annotations

import pandas as pd

from kvbench.kv.units import GIB

TITLE = "The engines' startup figures beside the plan"
INTRO = (
    "What each engine logged as it started, read from its own log by its adapter (vLLM's \"Available KV cache "
    "memory\", \"GPU KV cache size\" and \"Maximum concurrency\" lines, SGLang's \"KV Cache is allocated\", "
    "llama.cpp's KV and compute buffers), beside what `kvbench plan` says the same deployment gets: the model, "
    "engine version, split, limit and KV dtype of the start, on the GPU NVML named, by the engine's startup rule "
    "(`KVRules.startup_memory`), or of the KV budget or slots kvbench started it with. Error: planned over "
    "logged, less 1 (positive: the plan is optimistic). A figure is within tolerance within 5 % (bytes: or "
    "0.5 GiB), the requests at the limit exactly. Per GPU throughout; the engine prints GiB to two decimals. "
    "A class of deployment no public startup log verified says \"unverified\" (docs/plan.md).")
NOT_RECORDED = ("No start was checked: the engines ran attached, or on a CPU without logging their pool, or the run "
                "is from before kvbench recorded its engines' startup figures.")
RIGHT = {"logged", "planned", "error", "tokens logged", "tokens planned", "concurrency logged",
         "concurrency planned", "concurrency error"}


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:,.2f} GiB"


def _error(d: dict | None) -> str:
    if not d or d.get("error_pct") is None:
        return "-"
    return f"{d['error_pct']:+.1f} %" + ("" if d["ok"] else " !")


def _conc(x, limit) -> str:
    return "-" if x is None else f"{x:,.2f}x" + (f" of {limit:,}" if limit else "")


def _on(check: dict) -> str:
    d = check.get("deployment") or {}
    if d.get("device") != "gpu":
        return "CPU"
    planned = d.get("gpu_planned") or "?"
    tp = d.get("tp") or 1
    return f"{tp} x {planned}" + (f" ({d['gpu_name']})" if d.get("gpu_name") and d["gpu_name"] != planned else "")


def _by(plan: dict) -> str:
    if "not_planned" in plan:
        return "not planned: " + plan["not_planned"]
    by = plan.get("rule", "-")
    if plan.get("klass"):
        by += f" ({plan['klass']}{'' if plan.get('verified') else ', unverified'})"
    return by


def rows(infos: list[dict]) -> list[dict]:
    """One row per checked start of every run (its run id first where there are several runs)."""
    out = []
    for info in infos:
        for key, check in (info.get("startup_checks") or {}).items():
            name = key if len(infos) == 1 else f"{info.get('run_id')}: {key}"
            if "error" in check:
                out.append({"backend": name, "verdict": "not checked: " + check["error"]})
                continue
            engine, plan, diffs = check.get("engine") or {}, check.get("planned") or {}, check.get("off_by") or {}
            kv = next((k for k in ("kv_budget_bytes", "kv_pool_bytes") if k in diffs), None) or next(
                (k for k in ("kv_budget_bytes", "kv_pool_bytes") if k in engine), None)
            refusal = diffs.get("refusal")
            out.append({
                "backend": name, "on": _on(check), "planned by": _by(plan),
                "KV": {"kv_budget_bytes": "memory", "kv_pool_bytes": "pool"}.get(kv, "-"),
                "logged": _gib(engine.get(kv)) if kv else "-", "planned": _gib(plan.get(kv)) if kv else "-",
                "error": _error(diffs.get(kv)),
                "tokens logged": f"{engine['pool_tokens']:,}" if "pool_tokens" in engine else "-",
                "tokens planned": f"{plan['pool_tokens']:,}" if "pool_tokens" in plan else "-",
                "concurrency logged": _conc(engine.get("concurrency"), engine.get("concurrency_limit")),
                "concurrency planned": _conc(plan.get("concurrency"), plan.get("concurrency_limit")),
                "concurrency error": _error(diffs.get("concurrency")),
                "start": f"{refusal['logged']} / plan: {refusal['planned']}" if refusal else "-",
                "verdict": check.get("verdict", "-")})
    return out


def recorded(infos: list[dict]) -> bool:
    return any(info.get("startup_checks") for info in infos)


def table(infos: list[dict]) -> pd.DataFrame | None:
    found = rows(infos)
    return pd.DataFrame(found).fillna("-") if found else None
