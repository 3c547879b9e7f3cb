"""(f) KV quantisation on CUDA: transformers' QuantizedCache (optimum-quanto int4 and int2, the hf backend's
quanto-int4/int2) beside its bf16 cache on the same prompts, for the embedded model (real weights: the output
change means something) and a random-weight 8B GQA model (head_dim 128): the bytes the cache object held
against the hf KV rules, the allocator's delta, and the greedy match and top-20 KL
(kvbench.common.divergence). ``--kv-quant-device cpu`` runs the same step on the CPU (a dry run)."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from kvbench.kv.units import fmt_bytes
from kvbench.selfcheck.engines import TRANSFORMERS, engine_module

from .common import Budget, embedded_hf_dir, fmt_ok
from .kv import CONFIG_DIR
from .probe import PROBE_ENV, probe_events, probe_script

# (f): prompt and new tokens per request, requests per cache, its share of the budget
KVQ_PROMPT, KVQ_NEW, KVQ_REQUESTS, KVQ_BUDGET_S = 2048, 32, 2, 150
KVQ_TOP = 20
KVQ_CONFIGS = ("llama-3.1-8b.json",)


def kv_quant_caches() -> dict:
    """{KV dtype: cache_config or None (the bf16 DynamicCache)}: the baseline first, then the hf backend's
    quantised dtypes as its adapter starts them."""
    quantized = engine_module(TRANSFORMERS, "kvrules").QUANTIZED
    return {"bf16": None, **{name: setting.cache_config() for name, setting in quantized.items()}}


def kv_quant_rows(name: str, geom, events: list[dict], prompt: int, new: int) -> list[dict]:
    """(f)'s rows from the probe's kvq_cell events: bytes held against the hf rules (to the byte), the
    allocator's delta, and the output change against the bf16 cache's on the same prompts."""
    from kvbench.backends import kv_rules
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
        predicted = kv_rules(TRANSFORMERS).answer(q).bytes_per_gpu
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


def check_kv_quant(python: str, source: Path, name: str, budget: Budget, logs: Path, script: Path | None = None,
                   device: str = "cuda", prompt: int = KVQ_PROMPT, new: int = KVQ_NEW,
                   requests: int = KVQ_REQUESTS, limit_s: float = KVQ_BUDGET_S) -> list[dict]:
    """(f) for one model (a folder with weights, or a config.json: random weights built on the device)."""
    from kvbench.kv.model_config import geometry_from_hf

    geom = geometry_from_hf(source)
    timeout = max(10.0, min(limit_s, budget.left() - 30))
    argv = [python, str(script or probe_script()), "kvquant", "--config" if source.is_file() else "--model",
            str(source.resolve()), "--caches", json.dumps(kv_quant_caches()), "--prompt", str(prompt), "--new", str(new),
            "--requests", str(requests), "--top", str(KVQ_TOP), "--device", device]
    if device == "cuda":
        argv.append("--torch-unpack")  # quanto's CUDA unpack is a JIT nvcc build: minutes, past the time box
    log = logs / f"probe_kvquant_{name}.log"
    try:
        with log.open("w") as err:
            out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout,
                                 cwd=probe_script().parent, env={**os.environ, **PROBE_ENV}).stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rows = kv_quant_rows(name, geom, probe_events(out), prompt, new)
        return rows + [{"model": name, "kv_dtype": "-", "prompt_tokens": prompt, "new_tokens": new,
                        "error": f"skipped: time budget ({timeout:.0f} s)"}]
    rows = kv_quant_rows(name, geom, probe_events(out), prompt, new)
    if not rows:
        rows.append({"model": name, "kv_dtype": "-", "prompt_tokens": prompt, "new_tokens": new,
                     "error": f"the probe returned no cell; see {log}"})
    return rows


def run_kv_quant(result: dict, python: str, device: str, budget: Budget, logs: Path) -> None:
    """(f) on the embedded model (real weights) and a random-weight 8B GQA config, within its share of the
    budget; on the CPU (a dry run) the embedded model's config with short prompts."""
    from kvbench.common.models import ModelError

    targets: list[tuple[str, Path]] = []
    try:
        hf_dir = embedded_hf_dir(python)
        targets.append(("smollm2", hf_dir) if device == "cuda" else ("smollm2 (random weights)", hf_dir / "config.json"))
    except ModelError as exc:
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


def problems(result: dict) -> list[str]:
    out = []
    for r in result.get("kv_quant", []):
        if "error" in r:
            out.append(f"(f) {r['model']} {r['kv_dtype']}: {r['error']}")
        elif r.get("cache_ok") is False:
            out.append(f"(f) {r['model']} {r['kv_dtype']}: cache bytes disagree with the hf rules")
    return out


def markdown(result: dict) -> list[str]:
    if not result.get("kv_quant"):
        return []
    lines = ["", "## (f) KV quantisation: transformers' QuantizedCache against its bf16 cache", "",
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
    return lines
