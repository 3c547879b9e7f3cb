"""llama.cpp's figures at startup as its log prints them: the buffers per device (weights, KV, compute, output), the KV
caches with their cells, and cudaMalloc's refusal. The adapter reads its pool from them (``kv_pool_from_log``);
`kvbench run` records them beside the plan's (run.json ``startup_checks``), and the corpus of public startup logs
quotes them (tests/data/startup_logs/).

The lines, by the llama.cpp source that prints them: src/llama-model.cpp ``load_tensors: CUDA0 model buffer size``
(``llm_load_tensors: CUDA0 buffer size`` before the b4000s), src/llama-kv-cache.cpp ``llama_kv_cache: CUDA0 KV
buffer size`` (``llama_kv_cache_init:``, ``llama_kv_cache_unified:`` in older builds) and with ``-lv 4`` its
``size = ... (N cells, L layers, S/S seqs)`` line, src/llama-context.cpp ``llama_context: CUDA0 compute buffer
size`` (``sched_reserve:`` in the 0.3.36 build, ``llama_new_context_with_model:`` before) and ``llama_context: CPU
output buffer size`` (the logits, host memory on every build), ggml-cuda's
``cudaMalloc failed: out of memory``.
"""
from __future__ import annotations

import re

from kvbench.kv.units import MIB

from ..shared.llama_log import KV_LINE, parse_kv_log


# load_tensors:        CUDA0 model buffer size =  4403.49 MiB   /   llama_kv_cache:      CUDA0 KV buffer size =   720.00 MiB
# (older: llm_load_tensors:  CUDA0 buffer size =  3992.51 MiB / llama_kv_cache_init:  CUDA0 KV buffer size = ...)
BUFFER_LINE = re.compile(r"(?P<what>(?:llm_)?load_tensors|llama_kv_cache(?:_unified|_init)?):\s+(?P<device>\S+) "
                         r"(?:(?P<kind>model|KV) )?buffer size =\s*(?P<mib>\d+(?:\.\d+)?) MiB")
# sched_reserve:      CUDA0 compute buffer size =   164.00 MiB (llama_context:, llama_new_context_with_model: before)
COMPUTE_LINE = re.compile(r"(?:sched_reserve|llama_context|llama_new_context_with_model):\s+(?P<device>\S+) "
                          r"compute buffer size =\s*(?P<mib>\d+(?:\.\d+)?) MiB")
# llama_context:        CPU  output buffer size =     0.19 MiB (the logits rows: n_seq_max x n_vocab floats)
OUTPUT_LINE = re.compile(r"llama_context:\s+(?P<device>\S+)\s+output buffer size =\s*(?P<mib>\d+(?:\.\d+)?) MiB")
N_CTX_LINE = re.compile(r"(?:llama_context|llama_new_context_with_model): n_ctx\s+=\s*(\d+)")
KV_SELF_LINE = re.compile(r"KV self size\s+=\s*(\d+(?:\.\d+)?) MiB")
# llama_model_load_from_file_impl: using device CUDA0 (NVIDIA RTX A6000) - 48267 MiB free (src/llama.cpp)
FREE_LINE = re.compile(r"using device (?P<device>\S+) \(.*\) - (?P<mib>\d+) MiB free")
OOM_LINE = re.compile(r"(ggml_backend_cuda_buffer_type_alloc_buffer: allocating [\d.]+ MiB on device \d+: cudaMalloc "
                      r"failed: out of memory)")


def parse_buffers(text: str) -> dict:
    """The model and KV buffers per device as llama.cpp logs them at load ({"model": {dev: bytes}, "kv": ...};
    the last load in the log)."""
    out: dict = {"model": {}, "kv": {}}
    for m in BUFFER_LINE.finditer(text):
        kind = "kv" if m["kind"] == "KV" else "model"
        if kind == "model" and m["device"] in out["model"]:  # a second load: start again
            out = {"model": {}, "kv": {}}
        out[kind][m["device"]] = out[kind].get(m["device"], 0) + round(float(m["mib"]) * MIB)
    return out


def on_gpu(device: str) -> bool:
    """A device of the GPU backends (CUDA0, ROCm0, Vulkan0, Metal), not the host (CPU, CPU_Mapped, CUDA_Host)."""
    return not device.upper().startswith("CPU") and not device.endswith("_Host")


def _per_gpu_or_host(buffers: dict[str, float]) -> tuple[float | None, bool]:
    """The fullest GPU's bytes where any GPU holds a buffer (layers split over GPUs: not an even share), else
    the host's, summed."""
    gpu = [b for dev, b in buffers.items() if on_gpu(dev)]
    if gpu:
        return float(max(gpu)), True
    return (float(sum(buffers.values())), False) if buffers else (None, False)


# What llama-server logs before it loads a draft model, whose own weights and KV cache lines follow:
# common/speculative.cpp's "common_speculative_init_result: loading draft model" (the 0.3.36 build), the server's
# "srv    load_model: loading draft model" before
DRAFT_LOG_MARK = re.compile(r"(?:common_speculative_init_result|load_model): loading draft model")


def split_draft_log(text: str) -> tuple[str, str]:
    """llama-server's log as (the target's part, the draft model's part: "" without one)."""
    m = DRAFT_LOG_MARK.search(text)
    return (text[:m.start()], text[m.start():]) if m else (text, "")


def startup_figures(text: str) -> dict | None:
    """The figures of ``Backend.startup_figures_from_log`` from a llama.cpp log (per GPU: the fullest one's): the
    target's, and a draft model's KV cache (``draft_kv_pool_bytes``) where the log loads one after it."""
    text, draft = split_draft_log(text)
    out: dict = {}
    # the draft's part without its mark line (read again, it would split again)
    draft_figures = startup_figures(draft.partition("\n")[2]) if draft else None
    if draft_figures and "kv_pool_bytes" in draft_figures:
        out["draft_kv_pool_bytes"] = draft_figures["kv_pool_bytes"]
    lines = [line.strip() for line in text.splitlines()
             if BUFFER_LINE.search(line) or COMPUTE_LINE.search(line) or KV_LINE.search(line) or OUTPUT_LINE.search(line)
             or N_CTX_LINE.search(line) or OOM_LINE.search(line) or FREE_LINE.search(line)]
    buffers = parse_buffers(text)
    kv, kv_gpu = _per_gpu_or_host(buffers["kv"])
    caches = parse_kv_log(text)
    if kv is None and caches:
        kv = sum(c["mib"] for c in caches) * MIB
    if kv is None and (self_size := KV_SELF_LINE.findall(text)):
        kv = float(self_size[-1]) * MIB
    if kv is not None:
        out["kv_pool_bytes"] = kv
    if caches:
        out["pool_tokens"] = max(c["cells"] * c["streams"] for c in caches)
    elif n_ctx := N_CTX_LINE.findall(text):
        out["pool_tokens"] = int(n_ctx[-1])
    weights, weights_gpu = _per_gpu_or_host(buffers["model"])
    if weights is not None:
        out["weights_bytes"] = weights
    compute: dict[str, float] = {}
    for m in COMPUTE_LINE.finditer(text):
        compute[m["device"]] = float(m["mib"]) * MIB  # a second context replaces the first
    if compute:
        out["terms"] = {"compute buffer": _per_gpu_or_host(compute)[0]}
    if output := [float(m["mib"]) * MIB for m in OUTPUT_LINE.finditer(text)]:
        out.setdefault("terms", {})["output buffer"] = output[-1]  # host memory, on a GPU build too
    free = {m["device"]: float(m["mib"]) * MIB for m in FREE_LINE.finditer(text)}
    if free:  # what the fullest device found free when the model loaded
        out["free_at_load_bytes"] = max(free.values())
    if oom := OOM_LINE.findall(text):
        out["refusal"] = oom[-1]
    if not out:
        return None
    out["device"] = "gpu" if kv_gpu or weights_gpu or any(on_gpu(d) for d in compute) else "cpu"
    out["lines"] = lines + (draft_figures["lines"] if draft_figures else [])
    return out
