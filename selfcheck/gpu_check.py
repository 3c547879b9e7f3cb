"""The GPU checks: ``python -m kvbench.selfcheck.gpu_check [--out results/gpu/<id>] [--model DIR ...]``.

Runs offline, in under 10 minutes (``--budget-s``, default 540), on a machine with an NVIDIA GPU:

a. the NVML sampler against a real allocation of known size (a CUDA torch process allocates
   ``--alloc-gib`` GiB; the device and process deltas NVML reports, read at that moment and by the 20 Hz
   sampler, against the bytes allocated);
b. transformers on CUDA (the embedded SmolLM2 model and each ``--model`` HF folder): the KV cache of one
   ``generate`` call measured three ways (the cache tensors' bytes, the CUDA allocator's delta, NVML's
   device delta) at several prompt lengths and batches, against kvbench.kv.geometry's prediction;
c. every engine whose environment is installed here, through ``kvbench run`` with the GPU default benchmark's
   workload, each time-boxed;
d. the runtime overhead per model (CUDA context, allocator slack, activations: memory besides weights and KV)
   against ``kvbench plan``'s 1.5 GiB assumption, from (b)'s probes;
e. with ``--llama-source``, llama.cpp's CUDA llama-server built from a source archive, if the time allows;
f. KV quantisation on CUDA: transformers' QuantizedCache (optimum-quanto int4 and int2, the hf backend's
   quanto-int4/int2) beside its bf16 cache on the same prompts, for the embedded model (real weights: the
   output change means something) and a random-weight 8B GQA model (head_dim 128): the bytes the cache
   object held against the hf KV rules, the allocator's delta, and the greedy match and top-20 KL
   (kvbench.common.divergence). ``--kv-quant-device cpu`` runs the same step on the CPU (a dry run).

Without ``--config``, (b) builds random-weight models of three real geometries on the GPU (an 8B GQA, a
hybrid sliding-window and an MLA config from tests/data/configs): no model file has to travel.

Writes ``gpu_check.md`` (the tables and the exact command) and ``gpu_check.json`` under ``--out``. Without
an NVIDIA GPU it prints why, runs nothing and exits with code 3. Exit 0: every check ran and agreed;
1: a check disagreed, failed or was skipped for lack of time or of a CUDA torch.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from kvbench.kv.units import GIB, MIB, fmt_bytes, fmt_gib

EXIT_NO_GPU = 3
PROBE = Path(__file__).resolve().parent.parent / "backends" / "hf" / "scripts" / "gpu_probe.py"
ROOT = Path(__file__).resolve().parent.parent
# (prompt tokens, batch) for transformers on CUDA; cells longer than the model's context are dropped.
KV_CELLS = [(1024, 1), (4096, 1), (4096, 4), (16384, 1), (32768, 1), ("max", 1), ("max", 8)]
# random-weight models of real configs: past Gemma 3's window (1024) and Mistral's (4096), within minutes
CONFIG_CELLS = [(1024, 1), (8192, 1), (4096, 4)]
FAMILY_CELLS = [(100, 2), (1000, 1)]  # the validation families: windows and chunks of 64
NEW_TOKENS = 16
# (b) without --config: random-weight models of three real geometries, built on the GPU from their configs
# (no model files travel): an 8B GQA model, a hybrid sliding-window model (5 local : 1 global layers) and an
# MLA model (the latent cached, K only). The H200 run of 2026-11-30 built these three among five in 271 s.
CONFIG_DIR = ROOT / "tests" / "data" / "configs"
DEFAULT_CONFIGS = ("llama-3.1-8b.json", "gemma-3-4b-it.json", "deepseek-v2-lite.json")
# (f): prompt and new tokens per request, requests per cache, its share of the budget
KVQ_PROMPT, KVQ_NEW, KVQ_REQUESTS, KVQ_BUDGET_S = 2048, 32, 2, 150
KVQ_TOP = 20
KVQ_CONFIGS = ("llama-3.1-8b.json",)
PLANNER_OVERHEAD = 1.5 * GIB  # kvbench plan's assumption (PlanInput.overhead_gib): what (d) measures
# Agreement: the allocator holds the cache tensors rounded up to 512-byte blocks; NVML sees whole
# segments the caching allocator reserved (2 MiB granularity, 20 MiB for large blocks, fragmentation).
ALLOCATOR_REL, ALLOCATOR_ABS = 0.01, 4 * MIB
NVML_REL, NVML_ABS = 0.05, 64 * MIB


def no_gpu_message(error: str | None) -> str:
    return (f"no NVIDIA GPU found (NVML: {error or 'no device'}): the GPU checks need one; nothing was run")


# --- pure: rows and tables -----------------------------------------------------------------------

def within(measured: float | None, expected: float | None, rel: float, abs_: float) -> bool | None:
    if measured is None or expected is None:
        return None
    return abs(measured - expected) <= max(rel * abs(expected), abs_)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def fmt_ok(x: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "-"}[x]


def sampler_row(requested: int, events: dict, snaps: dict, sampled: dict) -> dict:
    """Check (a) from the probe's events (ready, allocated), NVML read at those moments, and the sampler's
    peaks. ``snaps[x]`` = {"device_used", "process_bytes"}; ``sampled`` = peaks over the hold."""
    device_delta = snaps["allocated"]["device_used"] - snaps["ready"]["device_used"]
    proc = [snaps[k].get("process_bytes") for k in ("ready", "allocated")]
    process_delta = proc[1] - proc[0] if None not in proc else None
    allocator_delta = events["allocated"]["allocated"] - events["ready"]["allocated"]
    sampled_device = sampled.get("device_over_ready")
    sampled_process = sampled.get("process_over_ready")
    return {"requested_bytes": requested, "allocator_delta_bytes": allocator_delta,
            "nvml_device_delta_bytes": device_delta, "nvml_process_delta_bytes": process_delta,
            "sampled_device_delta_bytes": sampled_device, "sampled_process_delta_bytes": sampled_process,
            "sampler_hz": sampled.get("hz"), "sampler_samples": sampled.get("samples"),
            "process_found": snaps["allocated"].get("process_found"),
            "device_ok": within(device_delta, requested, NVML_REL, NVML_ABS),
            "process_ok": within(process_delta, requested, NVML_REL, NVML_ABS),
            "sampled_ok": within(sampled_device, requested, NVML_REL, NVML_ABS),
            "rate_ok": sampled.get("hz") is not None and sampled["hz"] >= 19.0}


def kv_row(model: str, predicted: float, before: dict, after: dict, snap_before: dict, snap_after: dict) -> dict:
    """Check (b), one cell: the three measurements of one generate call's KV cache against the model."""
    allocator = after["allocated"] - before["allocated"]
    nvml = snap_after["device_used"] - snap_before["device_used"]
    pb, pa = snap_before.get("process_bytes"), snap_after.get("process_bytes")
    return {"model": model, "prompt_tokens": after["prompt"], "batch": after["batch"], "new_tokens": after["new"],
            "predicted_bytes": predicted, "cache_bytes": after["cache_bytes"], "allocator_delta_bytes": allocator,
            "allocator_peak_delta_bytes": after["max_allocated"] - before["allocated"],
            "nvml_device_delta_bytes": nvml, "nvml_process_delta_bytes": pa - pb if None not in (pa, pb) else None,
            "generate_s": after.get("seconds"),
            "cache_over_predicted": ratio(after["cache_bytes"], predicted),
            "allocator_over_cache": ratio(allocator, after["cache_bytes"]),
            "nvml_over_cache": ratio(nvml, after["cache_bytes"]),
            "cache_ok": after["cache_bytes"] == round(predicted),
            "allocator_ok": within(allocator, after["cache_bytes"], ALLOCATOR_REL, ALLOCATOR_ABS),
            "nvml_ok": within(nvml, after["cache_bytes"], NVML_REL, NVML_ABS)}


def overhead_row(model: str, idle: dict, ready: dict, loaded_event: dict, loaded: dict, kv_rows: list[dict]) -> dict:
    """(d) for one model, from NVML at three moments of its probe (idle: before it started; ready: CUDA context
    up, nothing allocated; loaded: weights in place, kernels warmed) and its cells: memory besides weights and
    KV. ``overhead`` is what the planner's 1.5 GiB stands for: everything on the GPU at the largest cell's peak
    but the weights and the KV (the CUDA context and libraries, the allocator's slack, the activations)."""
    weights = loaded_event.get("allocated")
    context = ready["device_used"] - idle["device_used"]
    at_load = loaded["device_used"] - idle["device_used"]
    cells = [r for r in kv_rows if "error" not in r and r.get("model") == model]
    activations = max((r["allocator_peak_delta_bytes"] - r["cache_bytes"] for r in cells), default=None)
    overhead = at_load - weights + activations if weights is not None and activations is not None else None
    return {"model": model, "context_bytes": context, "weights_bytes": weights, "loaded_device_delta_bytes": at_load,
            "at_load_bytes": at_load - weights if weights is not None else None,
            "activations_peak_bytes": activations, "overhead_bytes": overhead,
            "largest_cell": max(((r["prompt_tokens"], r["batch"]) for r in cells),
                                key=lambda c: c[0] * c[1], default=None),
            "over_assumption": ratio(overhead, PLANNER_OVERHEAD)}


def engine_row(engine: str, status: str, cells: list[dict], seconds: float | None, note: str = "") -> dict:
    ok = [c for c in cells if c.get("status") in ("ok", "flagged")]
    best = max(ok, key=lambda c: c.get("kv_bytes_peak_predicted") or 0) if ok else {}
    return {"engine": engine, "status": status, "cells": len(cells), "cells_ok": len(ok), "seconds": seconds,
            "largest_cell": f"{best['prompt_tokens']} x{best['concurrency']}" if best else None,
            "kv_predicted_bytes": best.get("kv_bytes_peak_predicted"), "kv_in_use_bytes": best.get("kv_in_use_peak_bytes"),
            "kv_pool_bytes": best.get("kv_pool_bytes_engine"), "allocator_bytes": best.get("kv_allocator_bytes_peak"),
            "gpu_process_peak_bytes": best.get("gpu_process_peak_bytes"),
            "gpu_device_peak_bytes": best.get("gpu_device_peak_bytes"), "note": note}


def verdict(result: dict) -> tuple[bool, list[str]]:
    """(every check ran and agreed, the problems)."""
    problems = list(result.get("skipped", []))
    s = result.get("sampler")
    if not s:
        problems.append("(a) the NVML sampler check did not run")
    else:
        for key, what in (("device_ok", "NVML device delta"), ("sampled_ok", "sampled device delta"),
                          ("rate_ok", "sampler rate")):
            if s.get(key) is False:
                problems.append(f"(a) {what} disagrees with the allocation")
    if not result.get("kv"):
        problems.append("(b) no transformers KV measurement on CUDA")
    for r in result.get("kv", []):
        if "error" in r:
            problems.append(f"(b) {r['model']} {r['prompt_tokens']} x{r['batch']}: {r['error']}")
            continue
        for key in ("cache_ok", "allocator_ok", "nvml_ok"):
            if r.get(key) is False:
                problems.append(f"(b) {r['model']} {r['prompt_tokens']} x{r['batch']}: {key[:-3]} disagrees")
    for r in result.get("kv_quant", []):
        if "error" in r:
            problems.append(f"(f) {r['model']} {r['kv_dtype']}: {r['error']}")
        elif r.get("cache_ok") is False:
            problems.append(f"(f) {r['model']} {r['kv_dtype']}: cache bytes disagree with the hf rules")
    for e in result.get("engines", []):
        if e["status"] not in ("finished", "not installed"):
            problems.append(f"(c) {e['engine']}: {e['status']}")
    return not problems, problems


def render_markdown(result: dict) -> str:
    env = result.get("environment", {})
    gpus = ", ".join(f"{g['name']} ({fmt_gib(g['memory_bytes'])})" for g in env.get("gpus", [])) or "-"
    lines = [f"# kvbench GPU check {result.get('id', '')}", "",
             f"Command: `{result.get('command', '')}`", "",
             f"Started {result.get('started_at', '-')}, {result.get('seconds', 0):.0f} s. GPUs: {gpus}; "
             f"driver {env.get('driver', '-')}; NVML memory API {env.get('memory_api', '-')}; "
             f"torch {env.get('torch', '-')} (CUDA {env.get('cuda', '-')}), transformers "
             f"{env.get('transformers', '-')} from `{env.get('torch_python', '-')}`.", ""]
    ok, problems = verdict(result)
    lines += ["**All checks agreed.**" if ok else "**Problems:** " + "; ".join(problems), ""]
    lines += ["## (a) NVML sampler against a real allocation", ""]
    s = result.get("sampler")
    if s:
        lines += ["| allocated | allocator delta | NVML device delta | NVML process delta | sampled device peak "
                  "| sampled process peak | sampler rate | agrees |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|",
                  f"| {fmt_bytes(s['requested_bytes'])} | {fmt_bytes(s['allocator_delta_bytes'])} "
                  f"| {fmt_bytes(s['nvml_device_delta_bytes'])} | {fmt_bytes(s['nvml_process_delta_bytes'])} "
                  f"| {fmt_bytes(s['sampled_device_delta_bytes'])} | {fmt_bytes(s['sampled_process_delta_bytes'])} "
                  f"| {s['sampler_hz'] or 0:.1f} Hz ({s['sampler_samples']}) "
                  f"| device {fmt_ok(s['device_ok'])}, sampled {fmt_ok(s['sampled_ok'])}, "
                  f"process {fmt_ok(s['process_ok'])}, rate {fmt_ok(s['rate_ok'])} |", ""]
        if not s.get("process_found"):
            lines += ["NVML did not list the allocating process's pid (a container with its own pid namespace "
                      "sees host pids): per-process figures are not attributable here; the device delta is.", ""]
    else:
        lines += ["not run", ""]
    lines += ["## (b) transformers on CUDA: the KV cache three ways", "",
              f"One `generate` call per row ({NEW_TOKENS} new tokens): predicted = kvbench.kv.geometry (hf rules) for "
              "prompt + new - 1 tokens; cache = the cache tensors' numel x element_size; allocator = "
              "`torch.cuda.memory_allocated()` after - before (the cache is all that is left); NVML = device "
              "used after - before, with the allocator's cached blocks released on both sides.", "",
              "| model | prompt | batch | predicted | cache tensors | allocator delta | NVML delta | "
              "cache / predicted | allocator / cache | NVML / cache | allocator peak delta | agrees |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result.get("kv", []):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['prompt_tokens']} | {r['batch']} | {fmt_bytes(r.get('predicted_bytes'))} "
                         f"| {r['error']} | | | | | | | **no** |")
            continue
        lines.append(f"| {r['model']} | {r['prompt_tokens']} | {r['batch']} | {fmt_bytes(r['predicted_bytes'])} "
                     f"| {fmt_bytes(r['cache_bytes'])} | {fmt_bytes(r['allocator_delta_bytes'])} "
                     f"| {fmt_bytes(r['nvml_device_delta_bytes'])} | {fmt_ratio(r['cache_over_predicted'])} "
                     f"| {fmt_ratio(r['allocator_over_cache'])} | {fmt_ratio(r['nvml_over_cache'])} "
                     f"| {fmt_bytes(r['allocator_peak_delta_bytes'])} | cache {fmt_ok(r['cache_ok'])}, allocator "
                     f"{fmt_ok(r['allocator_ok'])}, NVML {fmt_ok(r['nvml_ok'])} |")
    lines += ["", "## (d) runtime overhead: memory besides weights and KV (issue 15 item 4)", "",
              "Per model, NVML's device use over the idle device: at `ready` (the CUDA context, nothing "
              "allocated) and at `loaded` (weights in place, kernels warmed, cached blocks released); weights = "
              "the allocator's live bytes at `loaded`; activations = the largest cell's allocator peak during "
              "`generate` minus its cache; overhead = (loaded - weights) + activations, what `kvbench plan` "
              f"assumes is {fmt_gib(PLANNER_OVERHEAD)} per GPU (`kvbench plan --overhead-from` takes an engine run's "
              "figure instead).", "",
              "| model | CUDA context | weights | loaded - weights | activations peak (cell) | overhead | "
              "overhead / 1.5 GiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for o in result.get("overhead", []):
        cell = f" ({o['largest_cell'][0]} x{o['largest_cell'][1]})" if o.get("largest_cell") else ""
        lines.append(f"| {o['model']} | {fmt_bytes(o['context_bytes'])} | {fmt_bytes(o['weights_bytes'])} "
                     f"| {fmt_bytes(o['at_load_bytes'])} | {fmt_bytes(o['activations_peak_bytes'])}{cell} "
                     f"| {fmt_bytes(o['overhead_bytes'])} | {fmt_ratio(o['over_assumption'])} |")
    if not result.get("overhead"):
        lines.append("| not measured | | | | | | |")
    if result.get("llama_build"):
        b = result["llama_build"]
        lines += ["", "## (e) llama.cpp's CUDA server built here", "",
                  f"From `{b.get('source')}`: {b['status']}"
                  + (f" in {b['seconds']:.0f} s" if b.get("seconds") is not None else "")
                  + (f"; `llama-server --list-devices`: {b['devices']}" if b.get("devices") else "")
                  + (f"; {b['note']}" if b.get("note") else "")]
    if result.get("kv_quant"):
        lines += ["", "## (f) KV quantisation: transformers' QuantizedCache against its bf16 cache", "",
                  "Per model and KV dtype, the same random-id prompts one at a time (greedy, the top-20 of log_softmax "
                  "over the raw logits per position): cache = the bytes the cache object held after `generate` (codes, "
                  "scales, shifts, residual), predicted = the hf KV rules for prompt + new - 1 tokens with new - 1 "
                  "decoded; allocator = `memory_allocated()` after - before the call; KL = KL(bf16 || quantised), a "
                  "top-20 lower bound, over the positions whose contexts are still identical. quanto's unpack runs "
                  "as its own torch code on the GPU (its CUDA kernel would be a JIT nvcc build). Random weights "
                  "(a config) give near-uniform distributions: their KL is no quality figure; the bytes are.", "",
                  "| model | KV dtype | prompt + new | predicted | cache | allocator delta | bytes/token | saved "
                  "| identical | first diff | KL mean | KL max | agrees |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in result["kv_quant"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['kv_dtype']} | {r['prompt_tokens']} + {r['new_tokens']} "
                             f"| {r['error']} | | | | | | | | | **no** |")
                continue
            base = r["kv_dtype"] == "bf16"
            kl = (lambda v: "-" if base or v is None else ("0" if v == 0 else f"{v:.2e}"))
            lines.append(
                f"| {r['model']} | {r['kv_dtype']} | {r['prompt_tokens']} + {r['new_tokens']} "
                f"| {fmt_bytes(r['predicted_bytes'])} | {fmt_bytes(r['cache_bytes'])} "
                f"| {fmt_bytes(r.get('allocator_delta_bytes'))} | {r['bytes_per_token']:,.1f} "
                f"| {'-' if base or r.get('saved') is None else format(r['saved'] * 100, '.1f') + ' %'} "
                f"| {'-' if base or r.get('identical_share') is None else format(r['identical_share'] * 100, '.0f') + ' %'} "
                f"| {'-' if base or 'first_difference' not in r else (r['first_difference'] if r['first_difference'] is not None else 'none')} "
                f"| {kl(r.get('kl_mean'))} | {kl(r.get('kl_max'))} | cache {fmt_ok(r['cache_ok'])} |")
    lines += ["", "## (c) engines through `kvbench run` (GPU default benchmark)", ""]
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
    return "\n".join(lines) + "\n"


def kv_cells(max_context: int | None, new_tokens: int = NEW_TOKENS) -> list[tuple[int, int]]:
    """The (prompt, batch) cells that fit the model's context, in order, without duplicates."""
    limit = (max_context or 2048) - new_tokens
    out = []
    for prompt, batch in KV_CELLS:
        p = limit if prompt == "max" else prompt
        if p <= limit and (p, batch) not in out:
            out.append((p, batch))
    return out


# --- measuring -----------------------------------------------------------------------------------

class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Probe:
    """backends/hf/scripts/gpu_probe.py in a CUDA torch interpreter, stepped through its events."""

    def __init__(self, python: str, args: list[str], log: Path, script: Path = PROBE):
        self.log = log.open("w")
        self.proc = subprocess.Popen([python, str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, cwd=PROBE.parent,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float) -> dict:
        end = time.monotonic() + max(timeout, 0.1)
        while True:
            try:
                line = self.lines.get(timeout=max(0.05, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the GPU probe said nothing for {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"the GPU probe exited ({self.proc.wait()}); see {self.log.name}")
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                return event

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def nvml_snapshot(nvml, pids: set[int], settle_s: float = 0.2, readings: int = 3) -> dict:
    """NVML at one moment: the median of a few readings once the driver's figures have settled."""
    time.sleep(settle_s)
    used, procs, found = [], [], set()
    for _ in range(readings):
        used.append(nvml.device_used_bytes())
        mem = nvml.process_memory(pids)
        procs.append(mem.bytes)
        found |= mem.pids_found
        time.sleep(0.02)
    known = sorted(p for p in procs if p is not None)
    return {"device_used": sorted(used)[len(used) // 2], "process_bytes": known[len(known) // 2] if known else None,
            "process_found": bool(found)}


def find_torch_python(explicit: str | None) -> tuple[str | None, dict, list[str]]:
    """The first interpreter whose torch sees CUDA: --torch-python, the hf environments, this one, python3."""
    from kvbench.common.envs import kvbench_home

    candidates = [explicit] if explicit else []
    candidates += sorted(str(p) for p in (kvbench_home() / "envs").glob("hf-*/bin/python"))
    candidates += [sys.executable, "python3"]
    tried = []
    for python in dict.fromkeys(candidates):
        try:
            out = subprocess.run([python, str(PROBE), "info"], capture_output=True, text=True, timeout=60)
            info = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            info = {}
        if info.get("cuda_available"):
            return python, info, tried
        tried.append(f"{python}: " + ("torch without CUDA" if info else "no torch"))
    return None, {}, tried


def check_sampler(nvml, python: str, alloc_bytes: int, budget: Budget, logs: Path, script: Path = PROBE) -> dict:
    from kvbench.run.samplers import ProcessTreeMemorySampler

    baseline = nvml.idle_baseline()
    probe = Probe(python, ["alloc", "--bytes", str(alloc_bytes)], logs / "probe_alloc.log", script)
    try:
        pids = {probe.proc.pid}
        sampler = ProcessTreeMemorySampler(probe.proc.pid, 20.0, nvml, baseline)
        sampler.start()
        events, snaps = {}, {}
        try:
            events["ready"] = probe.next(min(120, budget.left()))
            snaps["ready"] = nvml_snapshot(nvml, pids)
            t_ready = time.perf_counter()
            probe.go()
            events["allocated"] = probe.next(min(60, budget.left()))
            snaps["allocated"] = nvml_snapshot(nvml, pids)
            time.sleep(1.0)  # the sampler sees the allocation held for a second
        finally:
            sampler.stop()
        probe.go()
        events["freed"] = probe.next(30)
        snaps["freed"] = nvml_snapshot(nvml, pids)
    finally:
        probe.close()
    samples = sampler.samples
    at_ready = [s for s in samples if s.t <= t_ready] or samples[:1]
    ready_dev = at_ready[-1].gpu_device_used_bytes
    ready_proc = at_ready[-1].gpu_process_bytes
    span = samples[-1].t - samples[0].t if len(samples) > 1 else 0
    dev = [s.gpu_device_used_bytes for s in samples if s.gpu_device_used_bytes is not None]
    proc = [s.gpu_process_bytes for s in samples if s.gpu_process_bytes is not None]
    sampled = {"hz": (len(samples) - 1) / span if span else None, "samples": len(samples),
               "device_over_ready": max(dev) - ready_dev if dev and ready_dev is not None else None,
               "process_over_ready": max(proc) - ready_proc if proc and ready_proc is not None else None}
    row = sampler_row(alloc_bytes, events, snaps, sampled)
    row["baseline"] = baseline.to_dict() if baseline else None
    row["freed_device_delta_bytes"] = snaps["freed"]["device_used"] - snaps["ready"]["device_used"]
    return row


def check_kv(nvml, python: str, model_dir: Path, name: str, budget: Budget, logs: Path,
             script: Path = PROBE, cells: list[tuple[int, int]] | None = None,
             overhead: list[dict] | None = None) -> list[dict]:
    """(b) for one model: a folder with weights, or a config.json file (a random-weight model built on the GPU)."""
    from kvbench.backends.hf.adapter import HFBackend
    from kvbench.kv.model_config import geometry_from_hf
    from kvbench.kv.rules import KVQuestion

    geom = geometry_from_hf(model_dir)
    limit = (geom.max_context or 2048) - NEW_TOKENS
    cells = [(p, b) for p, b in cells if p <= limit] if cells else kv_cells(geom.max_context)
    # the probe runs in its own folder: the path must not be relative
    source = ["--config" if model_dir.is_file() else "--model", str(model_dir.resolve())]
    idle = nvml_snapshot(nvml, set(), settle_s=0.0)  # before the probe: no CUDA context of it yet
    probe = Probe(python, ["kv", *source, "--cells", ",".join(f"{p}x{b}" for p, b in cells),
                           "--new", str(NEW_TOKENS)], logs / f"probe_kv_{name}.log", script)
    rows = []
    try:
        pids = {probe.proc.pid}
        probe.next(min(120, budget.left()))  # ready
        ready = nvml_snapshot(nvml, pids)
        probe.go()
        loaded_event = probe.next(min(300, budget.left()))  # loaded
        loaded = nvml_snapshot(nvml, pids)
        probe.go()
        for prompt, batch in cells:
            if budget.left() < 30:
                rows.append({"model": name, "prompt_tokens": prompt, "batch": batch, "error": "skipped: time budget"})
                continue
            predicted = HFBackend.kv_rules.answer(KVQuestion(geom, "bf16", prompt + NEW_TOKENS - 1, batch)).bytes_per_gpu
            before = probe.next(60)
            snap_before = nvml_snapshot(nvml, pids)
            probe.go()
            after = before if before["event"] == "cell_error" else probe.next(max(10, budget.left() - 20))
            if after["event"] == "cell_error":
                rows.append({"model": name, "prompt_tokens": prompt, "batch": batch, "predicted_bytes": predicted,
                             "error": after["error"]})
                probe.go()
                continue
            snap_after = nvml_snapshot(nvml, pids)
            rows.append(kv_row(name, predicted, before, after, snap_before, snap_after))
            probe.go()
            probe.next(60)  # cell_freed
            probe.go()
        if overhead is not None:
            overhead.append(overhead_row(name, idle, ready, loaded_event, loaded, rows))
    except (TimeoutError, RuntimeError) as exc:
        rows.append({"model": name, "prompt_tokens": "-", "batch": "-", "error": str(exc)})
    finally:
        probe.close()
    return rows


def kv_quant_caches() -> dict:
    """{KV dtype: cache_config or None (the bf16 DynamicCache)}: the baseline first, then the hf backend's
    quantised dtypes as its adapter starts them."""
    from kvbench.backends.hf.kvrules import QUANTIZED

    return {"bf16": None, **{name: setting.cache_config() for name, setting in QUANTIZED.items()}}


def kv_quant_rows(name: str, geom, events: list[dict], prompt: int, new: int) -> list[dict]:
    """(f)'s rows from the probe's kvq_cell events: bytes held against the hf rules (to the byte), the
    allocator's delta, and the output change against the bf16 cache's on the same prompts."""
    from kvbench.backends.hf.adapter import HFBackend
    from kvbench.common.divergence import compare_requests
    from kvbench.kv.rules import KVQuestion

    def records(event):
        return {str(i): {"tokens": r["tokens"], "top": [{int(t): lp for t, lp in pos} for pos in r["top"]],
                         "k": len(r["top"][0]) if r["top"] else 0} for i, r in enumerate(event["requests"])}

    cells = {e["kv_dtype"]: e for e in events if e.get("event") == "kvq_cell"}
    base = cells.get("bf16")
    rows = []
    for dtype, e in cells.items():
        row = {"model": name, "kv_dtype": dtype, "prompt_tokens": prompt, "new_tokens": new}
        if "error" in e:
            rows.append({**row, "error": e["error"]})
            continue
        q = KVQuestion(geom, dtype, prompt + new - 1, 1, options={"decoded_tokens": new - 1})
        predicted = HFBackend.kv_rules.answer(q).bytes_per_gpu
        held = e["cache_bytes"]
        row.update(predicted_bytes=predicted, cache_bytes=held[0], cache_ok=all(b == predicted for b in held),
                   allocator_delta_bytes=(e.get("allocator_delta") or [None])[0],
                   bytes_per_token=held[0] / (prompt + new - 1), seconds=e.get("seconds"))
        if base is not None and "error" not in base:
            row["saved"] = 1 - held[0] / base["cache_bytes"][0]
            d = compare_requests(records(base), records(e))
            row.update(identical_share=d.identical_share, first_difference=d.first_difference_min,
                       kl_mean=d.kl_mean, kl_max=d.kl_max, top_k=d.top_k, requests=d.requests)
        rows.append(row)
    return rows


def check_kv_quant(python: str, source: Path, name: str, budget: Budget, logs: Path, script: Path = PROBE,
                   device: str = "cuda", prompt: int = KVQ_PROMPT, new: int = KVQ_NEW,
                   requests: int = KVQ_REQUESTS, limit_s: float = KVQ_BUDGET_S) -> list[dict]:
    """(f) for one model (a folder with weights, or a config.json: random weights built on the device)."""
    from kvbench.kv.model_config import geometry_from_hf

    geom = geometry_from_hf(source)
    timeout = max(10.0, min(limit_s, budget.left() - 30))
    argv = [python, str(script), "kvquant", "--config" if source.is_file() else "--model", str(source.resolve()),
            "--caches", json.dumps(kv_quant_caches()), "--prompt", str(prompt), "--new", str(new),
            "--requests", str(requests), "--top", str(KVQ_TOP), "--device", device]
    if device == "cuda":
        argv.append("--torch-unpack")  # quanto's CUDA unpack is a JIT nvcc build: minutes, past the time box
    log = logs / f"probe_kvquant_{name}.log"
    try:
        with log.open("w") as err:
            out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout,
                                 cwd=PROBE.parent, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}).stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rows = kv_quant_rows(name, geom, _events(out), prompt, new)
        return rows + [{"model": name, "kv_dtype": "-", "prompt_tokens": prompt, "new_tokens": new,
                        "error": f"skipped: time budget ({timeout:.0f} s)"}]
    rows = kv_quant_rows(name, geom, _events(out), prompt, new)
    if not rows:
        rows.append({"model": name, "kv_dtype": "-", "prompt_tokens": prompt, "new_tokens": new,
                     "error": f"the probe returned no cell; see {log}"})
    return rows


def _events(out: str) -> list[dict]:
    events = []
    for line in out.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


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


def cuda_architecture(nvml) -> str:
    """The first GPU's compute capability as CMake wants it ("90" for 9.0), from NVML; "native" (CMake >= 3.24
    asks the driver) where NVML does not say. One architecture: compiling ggml's CUDA kernels for all of them
    would not fit a short loan."""
    try:
        major, minor = nvml.nv.nvmlDeviceGetCudaComputeCapability(nvml.handles[0])
        return f"{int(major)}{int(minor)}"
    except Exception:
        return "native"


def llama_build_argv(src: Path, build: Path, jobs: int, arch: str = "native") -> list[list[str]]:
    """(e) The commands that build llama-server with CUDA from llama.cpp's sources (the options of
    build_llama_server.sh, plus CUDA for this machine's GPU), then list the devices it sees."""
    return [["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_NATIVE=ON"],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
            [str(build / "bin" / "llama-server"), "--list-devices"]]


def build_llama(source: Path, out: Path, budget: Budget, reserve_s: float = 30, arch: str = "native") -> dict:
    """(e) Build llama.cpp's CUDA llama-server from ``source`` (an archive pack_llama_source.sh made, or a
    folder holding llama.cpp/) within what is left of the budget; the devices it lists. Never fails the run:
    the status says what happened."""
    import tarfile

    row = {"source": str(source), "status": "not run", "seconds": None, "devices": None, "note": "",
           "cuda_architecture": arch}
    t0 = time.monotonic()
    try:
        if source.is_file():
            with tarfile.open(source) as tar:
                try:
                    tar.extractall(out / "llama-src", filter="data")
                except TypeError:  # a Python before 3.11.4 / 3.10.12: no extraction filters
                    tar.extractall(out / "llama-src")
            source = out / "llama-src"
        src = source / "llama.cpp" if (source / "llama.cpp" / "CMakeLists.txt").exists() else source
        if not (src / "CMakeLists.txt").exists():
            return {**row, "status": "no CMakeLists.txt in the source"}
        log = (out / "logs" / "llama_build.log").open("w")
        for argv in llama_build_argv(src, out / "llama-build", os.cpu_count() or 4, arch):
            left = budget.left() - reserve_s
            if left < 30:
                return {**row, "status": "skipped: time budget", "seconds": time.monotonic() - t0,
                        "note": f"stopped before `{' '.join(argv[:3])}`"}
            done = subprocess.run(argv, stdout=subprocess.PIPE if argv[-1] == "--list-devices" else log,
                                  stderr=subprocess.STDOUT, text=True, timeout=left)
            if done.returncode != 0:
                return {**row, "status": f"`{Path(argv[0]).name} {argv[1]}` exited {done.returncode}",
                        "seconds": time.monotonic() - t0, "note": "see logs/llama_build.log"}
            if argv[-1] == "--list-devices":
                devices = [line.strip() for line in (done.stdout or "").splitlines() if "CUDA" in line]
                row["devices"] = "; ".join(devices) or "none with CUDA"
        return {**row, "status": "built", "seconds": time.monotonic() - t0}
    except subprocess.TimeoutExpired as exc:
        return {**row, "status": "time box reached", "seconds": time.monotonic() - t0, "note": str(exc.cmd[:3])}
    except (OSError, tarfile.TarError) as exc:
        return {**row, "status": f"failed: {exc}", "seconds": time.monotonic() - t0}


def run_kv_quant(result: dict, python: str, device: str, budget: Budget, logs: Path) -> None:
    """(f) on the embedded model (real weights) and a random-weight 8B GQA config, within its share of the
    budget; on the CPU (a dry run) the embedded model's config with short prompts."""
    from kvbench.backends.hf.adapter import HFBackend
    from kvbench.common import models

    targets: list[tuple[str, Path]] = []
    try:
        hf_dir = models.resolve("smollm2", HFBackend.gguf_converter(python=Path(python)), log=print).hf_dir
        targets.append(("smollm2", hf_dir) if device == "cuda" else ("smollm2 (random weights)", hf_dir / "config.json"))
    except models.ModelError as exc:
        result["skipped"].append(f"(f) smollm2: {exc}")
    if device == "cuda":
        targets += [(Path(c).stem, CONFIG_DIR / c) for c in KVQ_CONFIGS]
    shape = (KVQ_PROMPT, KVQ_NEW, KVQ_REQUESTS) if device == "cuda" else (64, 4, 1)
    end = time.monotonic() + KVQ_BUDGET_S
    for name, source in targets:
        left = min(end - time.monotonic(), budget.left() - 60)
        if left < 30:
            result["skipped"].append(f"(f) {name}: time budget")
            continue
        print(f"(f) KV quantisation on {device}: {name}", flush=True)
        result.setdefault("kv_quant", []).extend(
            check_kv_quant(python, source, name, budget, logs, device=device, prompt=shape[0], new=shape[1],
                           requests=shape[2], limit_s=left))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.selfcheck.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_check.md/json (default results/gpu/<time>-<gpu>)")
    parser.add_argument("--model", action="append", default=[], help="an extra local HF model folder (repeatable)")
    parser.add_argument("--config", action="append", default=[], type=Path,
                        help="a config.json: (b) builds a random-weight model of it on the GPU (repeatable; "
                             "default: an 8B GQA, a hybrid sliding-window and an MLA geometry, "
                             f"{', '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--no-configs", action="store_true", help="(b) without the default configs")
    parser.add_argument("--llama-source", type=Path,
                        help="(e) a llama.cpp source archive or folder (backends/llamacpp/scripts/pack_llama_source.sh "
                             "makes one under 64 MiB): build its CUDA llama-server here if the time allows")
    parser.add_argument("--families", action="store_true",
                        help="(b) also on kvbench validate's families (random-weight models of bench/run/kv_families.toml)")
    parser.add_argument("--no-embedded", action="store_true", help="(b) without the embedded model")
    parser.add_argument("--budget-s", type=float, default=540, help="the whole check's time budget (default 540)")
    parser.add_argument("--alloc-gib", type=float, default=4.0, help="size of check (a)'s allocation")
    parser.add_argument("--engines", default="hf,vllm,llamacpp", help="engines for check (c); '' for none")
    parser.add_argument("--torch-python", help="an interpreter whose torch sees CUDA (default: found)")
    parser.add_argument("--no-kv-quant", action="store_true", help="without (f), transformers' quantised cache")
    parser.add_argument("--kv-quant-device", default="cuda", choices=["cuda", "cpu"],
                        help="(f) on the CPU instead: a dry run of the same step (smaller prompts)")
    args = parser.parse_args(argv)
    t_start = time.monotonic()
    budget = Budget(args.budget_s)
    command = shlex.join(["python", "-m", "kvbench.selfcheck.gpu_check", *(sys.argv[1:] if argv is None else argv)])

    from kvbench.common.hardware import NVML

    nvml = NVML()
    if not nvml.available:
        print(no_gpu_message(nvml.error), file=sys.stderr)
        return EXIT_NO_GPU

    from kvbench.common import hardware
    from kvbench.run import default_bench

    names = nvml.device_names()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "results" / "gpu" / f"{stamp}-{names[0].lower().replace('nvidia', '').strip().replace(' ', '-')}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        driver = nvml.nv.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:
        driver = None
    result: dict = {"id": out.name, "command": command, "started_at": datetime.now(timezone.utc).isoformat(),
                    "environment": {"gpus": nvml.devices(), "driver": driver}, "skipped": []}

    def save():
        result["seconds"] = time.monotonic() - t_start
        result["environment"]["memory_api"] = nvml.memory_api
        result["ok"], result["problems"] = verdict(result)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "gpu_check.md").write_text(render_markdown(result))

    python, info, tried = find_torch_python(args.torch_python)
    result["environment"].update({"torch_python": python, **{k: info.get(k) for k in ("torch", "cuda", "transformers")}})
    print(f"GPU: {', '.join(names)}; CUDA torch: {python or 'none found'}", flush=True)
    if python is None:
        result["skipped"].append("(a), (b): no interpreter whose torch sees CUDA (" + "; ".join(tried) + ")")
    else:
        try:
            print("(a) NVML sampler against a real allocation", flush=True)
            result["sampler"] = check_sampler(nvml, python, int(args.alloc_gib * GIB), budget, out / "logs")
        except (TimeoutError, RuntimeError) as exc:
            result["skipped"].append(f"(a) failed: {exc}")
        save()
        if info.get("transformers"):
            from kvbench.backends.hf.adapter import HFBackend
            from kvbench.common import models

            targets = []
            if not args.no_embedded:
                try:
                    # This torch interpreter converts the GGUF once if needed (offline: a local conversion).
                    convert = HFBackend.gguf_converter(python=Path(python))
                    targets.append(("smollm2", models.resolve("smollm2", convert, log=print).hf_dir, None))
                except models.ModelError as exc:
                    result["skipped"].append(f"(b) smollm2: {exc}")
            targets += [(Path(m).name, Path(m), None) for m in args.model]
            configs = args.config or ([] if args.no_configs else [CONFIG_DIR / c for c in DEFAULT_CONFIGS])
            targets += [(c.stem, c, CONFIG_CELLS) for c in configs]
            if args.families:
                from kvbench.run.validate import families

                configs = out / "configs"
                configs.mkdir(exist_ok=True)
                for f in families():
                    (configs / f"{f.name}.json").write_text(json.dumps(f.config))
                    targets.append((f.name, configs / f"{f.name}.json", FAMILY_CELLS))
            for name, source, cells in targets:
                if budget.left() < 60:
                    result["skipped"].append(f"(b) {name}: time budget")
                    continue
                print(f"(b) transformers on CUDA: {name}", flush=True)
                try:
                    result.setdefault("kv", []).extend(check_kv(nvml, python, source, name, budget, out / "logs",
                                                                cells=cells, overhead=result.setdefault("overhead", [])))
                except (TimeoutError, RuntimeError) as exc:  # one model that will not load is its own row
                    result.setdefault("kv", []).append({"model": name, "prompt_tokens": "-", "batch": "-",
                                                        "error": str(exc)})
                save()
        else:
            result["skipped"].append(f"(b): {python} has torch but not transformers")
    if python is not None and info.get("transformers") and not args.no_kv_quant:
        run_kv_quant(result, python, args.kv_quant_device, budget, out / "logs")
        save()
    if args.llama_source:
        print(f"(e) building llama.cpp's CUDA server from {args.llama_source}", flush=True)
        result["llama_build"] = build_llama(args.llama_source, out, budget, arch=cuda_architecture(nvml))
        save()
    engines = [e for e in args.engines.split(",") if e]
    if engines:
        try:
            gpu_bench = default_bench.gpu_default_bench("smollm2", hardware.detect_gpus(nvml))
            print(f"(c) engines via kvbench run: {', '.join(engines)} ({gpu_bench.note})", flush=True)
            result["engines"], result["engine_command"] = check_engines(engines, "smollm2", gpu_bench.run_args(), out, budget)
        except Exception as exc:  # the engines are the optional part: say why and keep the rest
            result["skipped"].append(f"(c) failed: {type(exc).__name__}: {exc}")
    save()
    ok, problems = verdict(result)
    print(render_markdown(result))
    print(f"written: {out / 'gpu_check.md'} and gpu_check.json ({result['seconds']:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
