"""(c) Every engine whose environment is installed here, through ``kvbench run`` with the GPU default
benchmark's workload, each time-boxed."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvbench.kv.units import fmt_bytes

from .common import ROOT, Budget

# The model every engine serves: the embedded one, which travels with the checkout.
MODEL = "smollm2"


def engine_row(engine: str, status: str, cells: list[dict], seconds: float | None, note: str = "") -> dict:
    ok = [c for c in cells if c.get("status") in ("ok", "flagged")]
    best = max(ok, key=lambda c: c.get("kv_bytes_peak_predicted") or 0) if ok else {}
    return {"engine": engine, "status": status, "cells": len(cells), "cells_ok": len(ok), "seconds": seconds,
            "largest_cell": f"{best['prompt_tokens']} x{best['concurrency']}" if best else None,
            "kv_predicted_bytes": best.get("kv_bytes_peak_predicted"), "kv_in_use_bytes": best.get("kv_in_use_peak_bytes"),
            "kv_pool_bytes": best.get("kv_pool_bytes_engine"), "allocator_bytes": best.get("kv_allocator_bytes_peak"),
            "gpu_process_peak_bytes": best.get("gpu_process_peak_bytes"),
            "gpu_device_peak_bytes": best.get("gpu_device_peak_bytes"), "note": note}


def check_engines(engines: list[str], model: str, run_args: list[str], out: Path, budget: Budget) -> tuple[list[dict], str]:
    from kvbench.backends import REGISTRY
    from kvbench.common.envs import is_installed

    runs = out / "runs"
    base = [sys.executable, "-m", "kvbench.cli", "run", "--model", model, *run_args, "--results-dir", str(runs)]
    rows, todo = [], []
    for e in engines:
        cls = REGISTRY[e]
        if is_installed(cls.recipe(cls.default_version)):
            todo.append(e)
        else:
            rows.append(engine_row(e, "not installed", [], None, f"`kvbench setup -b {e}` (needs the network) first"))
    for i, e in enumerate(todo):
        share = (budget.left() - 15) / (len(todo) - i)
        if share < 60:
            rows.append(engine_row(e, "skipped: time budget", [], None))
            continue
        argv = [*base, "-b", e, "--run-id", e, "--start-timeout", str(int(min(300, share * 0.6)))]
        t0 = time.monotonic()
        with (out / "logs" / f"kvbench_run_{e}.log").open("w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            try:
                code = proc.wait(timeout=share)
                status = "finished" if code == 0 else f"exit {code}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)  # the runner stops the engine and marks the run interrupted
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                status = f"time box ({share:.0f} s) reached"
        cells = []
        cells_file = runs / e / "cells.jsonl"
        if cells_file.exists():
            cells = [json.loads(line) for line in cells_file.read_text().splitlines() if line.strip()]
        failed = next((c.get("error") for c in cells if c.get("status") == "failed"), None)
        rows.append(engine_row(e, status, cells, time.monotonic() - t0, (failed or "")[:160]))
    return rows, shlex.join([Path(base[0]).name, *base[1:], "-b", "ENGINE", "--run-id", "ENGINE"])


def run_engines(result: dict, engines: list[str], nvml, out: Path, budget: Budget) -> None:
    from kvbench.common import hardware
    from kvbench.run import default_bench

    try:
        gpu_bench = default_bench.gpu_default_bench(MODEL, hardware.detect_gpus(nvml))
        print(f"(c) engines via kvbench run: {', '.join(engines)} ({gpu_bench.note})", flush=True)
        result["engines"], result["engine_command"] = check_engines(engines, MODEL, gpu_bench.run_args(), out, budget)
    except Exception as exc:  # the engines are the optional part: say why and keep the rest
        result["skipped"].append(f"(c) failed: {type(exc).__name__}: {exc}")


def problems(result: dict) -> list[str]:
    out = []
    for e in result.get("engines", []):
        if e["status"] not in ("finished", "not installed"):
            out.append(f"(c) {e['engine']}: {e['status']}")
    return out


def markdown(result: dict) -> list[str]:
    lines = ["", "## (c) engines through `kvbench run` (GPU default benchmark)", ""]
    if result.get("engine_command"):
        lines += [f"Each: `{result['engine_command']}`", ""]
    lines += ["| engine | status | cells ok | largest cell | KV predicted | KV in use (engine) | KV pool | "
              "allocator | GPU process peak | GPU device peak | time | note |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for e in result.get("engines", []):
        seconds = "-" if e["seconds"] is None else f"{e['seconds']:.0f} s"
        lines.append(f"| {e['engine']} | {e['status']} | {e['cells_ok']}/{e['cells']} | {e['largest_cell'] or '-'} "
                     f"| {fmt_bytes(e['kv_predicted_bytes'])} | {fmt_bytes(e['kv_in_use_bytes'])} "
                     f"| {fmt_bytes(e['kv_pool_bytes'])} | {fmt_bytes(e['allocator_bytes'])} "
                     f"| {fmt_bytes(e['gpu_process_peak_bytes'])} | {fmt_bytes(e['gpu_device_peak_bytes'])} "
                     f"| {seconds} | {e['note']} |")
    return lines
