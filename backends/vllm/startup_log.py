"""vLLM's startup figures as its log prints them: what `kvbench run` records beside the plan's (run.json
``startup_checks``) and what the corpus of public startup logs quotes (tests/data/startup_logs/).

The lines, by the vLLM file that prints them (read in 0.6.4, 0.6.5, 0.7-0.10 and 0.32):

- V1 (0.8 on): v1/worker/gpu_worker.py ``Available KV cache memory: 8.11 GiB`` (one line per tensor-parallel
  worker); v1/core/kv_cache_utils.py ``GPU KV cache size: 178,880 tokens`` (``CPU`` on vLLM's CPU platform) and
  ``Maximum concurrency for 2,048 tokens per request: 10.79x``; v1/worker/gpu_model_runner.py ``Model loading
  took 64.38 GiB memory and 14.38 seconds`` (``GiB and ...`` before 0.11); the CPU worker's ``Explicitly set
  (0.71/13.96) GiB for KV cache on node 0`` (v1/worker/cpu_worker.py, with --kv-cache-memory-bytes).
- v0: worker/worker.py's memory profiling in its three formats (0.6.4 ``total_gpu_memory=23.58GiB ...
  non_torch_memory=0.35GiB kv_cache_size=3.81GiB``; 0.6.5 a table, ``available_kv_cache_memory 53.29GiB``; 0.6.6
  on ``model weights take 19.86GiB; non_torch_memory takes 0.16GiB; PyTorch activation peak memory takes 36.63GiB;
  the rest of the memory reserved for KV Cache is 14.65GiB``), ``# GPU blocks: 1952`` (``# CUDA blocks`` in
  executor_base.py), model_runner.py ``Loading model weights took 14.9888 GB`` (GiB: it divides by 2**30).
- V1's profiling figures: gpu_worker.py's debug lines (0.19: ``worker init memory snapshot: ...
  total_memory=79.19GiB``, ``torch peak memory increase: 1.89GiB; non-torch forward increase memory: 0.25GiB``) and
  gpu_model_runner.py ``Estimated CUDA graph memory: 0.84 GiB total`` (0.19 on).
- The refusals (v1/core/kv_cache_utils.py check_enough_kv_cache_memory, v0 worker.py
  raise_if_cache_size_invalid): ``No available memory for the cache blocks``, ``To serve at least one request
  with the models's max seq len (L), (X GiB KV cache is needed ...``, ``The model's max seq len (L) is larger than
  the maximum number of tokens that can be stored in KV cache (N)``.

A figure vLLM prints per worker is read as the binding worker's: the KV memory the smallest (vLLM sizes every
worker's pool by the smallest), every other term the last printed.
"""
from __future__ import annotations

import re

_NUM = r"(-?\d+(?:\.\d+)?)"
_INT = r"(\d[\d,]*)"
GIB = 2**30
# "Model loading took 14.99 GiB memory and 5.21 seconds" (GPU model runner; one line per tensor-parallel worker)
# and 0.6's "Loading model weights took 14.9888 GB" (GiB: model_runner.py divides by float(2**30))
WEIGHTS_LINE = re.compile(r"(?:Model loading|Loading model weights) took (\d+(?:\.\d+)?) (GiB|GB|MiB|MB)\b")
_UNITS = {"GiB": 2**30, "GB": 2**30, "MiB": 2**20, "MB": 2**20}
_KV_BUDGET = re.compile(r"(?:Available KV cache memory: " + _NUM + r" GiB|available_kv_cache_memory\s+" + _NUM
                        + r" ?GiB|kv_cache_size=" + _NUM + r"GiB|reserved for KV Cache is " + _NUM + r" ?GiB"
                        + r"|Explicitly set \(" + _NUM + r"/[\d.]+\) GiB for KV cache"
                        + r"|larger than the available KV cache memory \(" + _NUM + r" GiB\))")
# V1's refusal: "To serve at least one request with the models's max seq len (32768), (0.95 GiB KV cache is needed"
_ONE_REQUEST = re.compile(r"max seq len \((\d+)\), \(" + _NUM + r" GiB KV cache is needed")
_POOL_TOKENS = re.compile(r"\b(GPU|CPU) KV cache size: " + _INT + " tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for " + _INT + r" tokens per request: " + _NUM + "x")
# "# GPU blocks: 1952, # CPU blocks: 2048": the CPU blocks are v0's swap space, not the pool
_BLOCKS = re.compile(r"\b(?:GPU|CUDA) blocks: (\d+)")
# 0.6.5-0.6.6's profiling table and 0.6.6 on: "model weights take 14.96GiB"; V1's debug "...; weights memory: 17.22GiB."
_WEIGHTS_TAKE = re.compile(r"(?:model weights take\s+|; weights memory: )" + _NUM + r" ?GiB")
# v0's "total_gpu_memory=23.58GiB" / "total_gpu_memory (8.00GiB)"; V1's debug "worker init memory snapshot: ...
# total_memory=79.19GiB" (v1/worker/gpu_worker.py, 0.19)
_CUDA_TOTAL = re.compile(r"(?:total_gpu_memory(?:=|\s+|\s*\()|\btotal_memory=)" + _NUM + r" ?GiB")
# V1's debug "Memory profiling takes 18.17 seconds. Total non KV cache memory: 17.12GiB; torch peak memory increase:
# 1.89GiB; non-torch forward increase memory: 0.25GiB; weights memory: 14.99GiB." (v1/worker/gpu_worker.py)
_NON_TORCH = re.compile(r"(?:non_torch_memory(?:=|\s+takes\s+|\s+)|non-torch forward increase memory: )" + _NUM
                        + r" ?GiB")
_PEAK = re.compile(r"(?:PyTorch activation peak memory(?:\s+takes)?\s+|torch peak memory increase: )" + _NUM + r" ?GiB")
# "Estimated CUDA graph memory: 0.84 GiB total" (v1/worker/gpu_model_runner.py profile_cudagraph_memory, 0.19 on;
# taken out of the KV budget from 0.21)
_GRAPHS = re.compile(r"Estimated CUDA graph memory: " + _NUM + r" GiB total")
REFUSALS = re.compile(r"(No available memory for the cache blocks\.[^\n]*|To serve at least one request with the "
                      r"models's max seq len \(\d+\)[^\n]*|The model's max seq len \(\d+\) is larger than the maximum "
                      r"number of tokens that can be stored in KV cache \(\d+\)[^\n]*)")


def weights_bytes(text: str, workers: int = 1) -> float | None:
    """The weights as vLLM reports loading them, summed over the last ``workers`` lines (one per tensor-parallel
    worker); None where it prints none (its CPU runner)."""
    found = WEIGHTS_LINE.findall(text)
    if not found:
        return None
    return sum(float(n) * _UNITS[unit] for n, unit in found[-workers:])


def line_of(text: str, m: re.Match) -> str:
    """The whole log line a match is on."""
    end = text.find("\n", m.end())
    return text[text.rfind("\n", 0, m.start()) + 1:end if end >= 0 else len(text)].strip()


def _first_group(match: re.Match) -> str:
    return next(g for g in match.groups() if g is not None)


def startup_figures(text: str) -> dict | None:
    """The figures of :mod:`kvbench.backends.base` ``Backend.startup_figures_from_log`` from a vLLM log (the last
    start's where it restarted), each with the line it was read from; None where it prints none of them."""
    out: dict = {}
    lines: list[str] = []

    def seen(m: re.Match) -> None:
        line = line_of(text, m)
        if line not in lines:
            lines.append(line)

    budgets = list(_KV_BUDGET.finditer(text))
    if budgets:
        worst = min(budgets, key=lambda m: float(_first_group(m)))
        out["kv_budget_bytes"] = float(_first_group(worst)) * GIB
        seen(worst)
        out["device"] = "cpu" if "Explicitly set" in worst[0] else "gpu"  # the CPU worker's line, else a GPU worker's
    if tokens := list(_POOL_TOKENS.finditer(text)):
        m = tokens[-1]
        out["pool_tokens"], out["device"] = int(m[2].replace(",", "")), m[1].lower()
        seen(m)
    if conc := list(_CONCURRENCY.finditer(text)):
        m = conc[-1]
        out["concurrency_limit"], out["concurrency"] = int(m[1].replace(",", "")), float(m[2])
        seen(m)
    if blocks := list(_BLOCKS.finditer(text)):
        out["blocks"] = int(blocks[-1][1])
        seen(blocks[-1])
    if weights := list(WEIGHTS_LINE.finditer(text)):
        out["weights_bytes"] = float(weights[-1][1]) * _UNITS[weights[-1][2]]
        seen(weights[-1])
    elif weights := list(_WEIGHTS_TAKE.finditer(text)):
        out["weights_bytes"] = float(weights[-1][1]) * GIB
        seen(weights[-1])
    if total := list(_CUDA_TOTAL.finditer(text)):
        out["cuda_total_bytes"] = float(total[-1][1]) * GIB
    terms = {}
    for name, pattern in (("non-torch memory", _NON_TORCH), ("profile peak", _PEAK), ("CUDA graphs", _GRAPHS)):
        if found := list(pattern.finditer(text)):
            terms[name] = float(found[-1][1]) * GIB
            seen(found[-1])
    if terms:
        out["terms"] = terms
    if one := list(_ONE_REQUEST.finditer(text)):
        out["one_request_limit"], out["one_request_bytes"] = int(one[-1][1]), float(one[-1][2]) * GIB
    if refusal := list(REFUSALS.finditer(text)):
        out["refusal"] = refusal[-1][1].strip()
    if out:
        if "device" not in out and ("cuda_total_bytes" in out or "weights_bytes" in out):
            out["device"] = "gpu"  # only vLLM's GPU runners print these
        out["lines"] = lines
    return out or None
