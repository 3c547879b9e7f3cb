"""SGLang's memory on a GPU at startup. Imports only kvbench.kv.

SGLang (0.5.23 read; see kvrules.py) budgets against the GPU's total and its ``mem_fraction_static``
(auto: :func:`kvrules.auto_mem_fraction_static`, by GPU memory and tp): the KV pool gets what loading left free
less total x (1 - fraction) (mem_cache/kv_cache_configurator.py _profile_available_bytes), that is
total x fraction - weights - what the process held before loading (CUDA context, NCCL). Activations and CUDA
graphs live in the (1 - fraction) share and are not subtracted again.
"""
from __future__ import annotations

from pathlib import Path

from kvbench.kv.startup import FittedConstant, Refusal, fitted_range, read_fitted, StartupMemory, StartupQuestion, StartupTerm
from kvbench.kv.units import GIB

# arg_groups/memory_hook.py handle_gpu_memory_settings: (GPU memory below, MiB) -> (chunked_prefill_size,
# decode CUDA-graph max_bs with tp < 4, with tp >= 4)
_MEMORY_TIERS = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160),
                 (90 * 1024, 8192, 256, 512), (160 * 1024, 8192, 256, 512), (float("inf"), 16384, 512, 512))


def prefill_graph_sizes(max_bs: int) -> list[int]:
    """arg_groups/cuda_graph_hook.py generate_prefill_cuda_graph_batch_sizes (480-497)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_bs + 1, 512)]
    return [s for s in sizes if s <= max_bs]


def auto_mem_fraction_static(gpu_mib: float, tp: int = 1, mla: bool = False, chunked_prefill_size: int | None = None,
                             max_running_requests: int | None = None) -> float:
    """What ``--mem-fraction-static`` auto (None) resolves to on one CUDA GPU of ``gpu_mib`` MiB, no pipeline
    or data parallelism, no speculative decoding, not multimodal (arg_groups/memory_hook.py
    handle_gpu_memory_settings 83-345 and reserve_for_graph_mb 357-400; post-capture KV sizing is off by
    default, environ.py SGLANG_ENABLE_POST_CAPTURE_KV_SIZING False):

    reserved MiB = 512 + 1.5 x max(chunked_prefill_size, 2048) + tp / 8 x 1024 + the CUDA graphs' reserve
    (2 x the decode graphs' max batch, + 8 per prefill graph size, or 1.5 GiB for MLA), at least 10 GiB on a
    GPU over 60 GiB; the fraction is round((gpu - reserved) / gpu, 3). The fraction bounds weights + KV pool:
    SGLang's KV budget is the free memory after loading less the free memory before it x (1 - fraction)
    (mem_cache/kv_cache_configurator.py _profile_available_bytes 2990-3060)."""
    _, chunked, small_tp_bs, big_tp_bs = next(t for t in _MEMORY_TIERS if gpu_mib < t[0])
    chunked = chunked_prefill_size or chunked
    max_bs = small_tp_bs if tp < 4 else big_tp_bs
    if max_running_requests is not None and max_bs > max_running_requests:
        max_bs = max_running_requests
    prefill_max_bs = min(8192, chunked) if mla else chunked
    graphs = max_bs * 2 + (1.5 * 1024 if mla else len(prefill_graph_sizes(prefill_max_bs)) * 8)
    reserved = 512 + max(chunked, 2048) * 1.5 + tp / 8 * 1024 + graphs
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


#: The process's memory before loading weights at tp > 1, as SGLang logs it ("Init torch distributed ends.
#: mem usage=1.96 GB", TP0 of 8 x H200, sgl-project/sglang#11716). No tp 1 log was found: the same figure
#: is used there and the class says unverified.
FIT_RECORDS = read_fitted(Path(__file__).with_name("fitted.toml"))
FITTED = {key: float(record["value"]) for key, record in FIT_RECORDS.items()}
FITS = (FittedConstant("preload_gib", "GiB", ("preload_gib",), from_pool=True,
                       why="what the process holds before loading at tp 1 or over PCIe (NCCL's few channels)"),
        FittedConstant("preload_gib_nvlink", "GiB", ("preload_gib",), from_pool=True,
                       why="what the process holds before loading at tp > 1 over NVLink (NCCL's many channels)"))
#: Classes whose every corpus check holds with its own source left out of the fit (none yet: docs/plan.md)
VERIFIED_CLASSES: frozenset[str] = frozenset()


def startup_memory(rules, q: StartupQuestion) -> StartupMemory:
    option = q.options.get("mem_fraction_static")
    tp = max(1, q.kv.tp)
    if option:
        fraction, why = float(option), f"--mem-fraction-static {float(option)}"
    else:
        mla = q.geometry.mla is not None
        fraction = auto_mem_fraction_static(q.cuda_bytes / 2**20, tp, mla)
        why = (f"mem_fraction_static auto {fraction} for {q.cuda_bytes / GIB:.1f} GiB at tp {tp} "
               "(arg_groups/memory_hook.py handle_gpu_memory_settings, 0.5.23)")
    # kv_cache_configurator.py _profile_available_bytes: the pool is what loading left free less the memory free
    # before loading x (1 - fraction): (total - held before loading) x fraction - weights
    key = "preload_gib_nvlink" if tp > 1 and q.interconnect == "nvlink" else "preload_gib"
    preload = FITTED[key]
    terms = (StartupTerm("before loading", preload * fraction * GIB,
                         f"fitted: {preload:g} GiB held before the weights (CUDA context, NCCL; \"Init torch distributed "
                         f"ends. mem usage\"), x the fraction {fraction}: {fitted_range(FIT_RECORDS[key])}", True),)
    k = "sglang tp>1" if tp > 1 else "sglang tp1"
    ok = k in VERIFIED_CLASSES
    return StartupMemory("sglang", "SGLang", fraction, why, q.cuda_bytes, q.cuda_source, terms, k, ok,
                         "" if ok else f"unverified: no public SGLang startup log of class '{k}' checked")


def startup_refusal(rules, q: StartupQuestion, available: float, one_request: float, longest: int) -> Refusal | None:
    if available <= 0:
        fraction = q.options.get("mem_fraction_static") or "auto"
        return Refusal(f"Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static={fraction}.",
                       "raise --mem-fraction-static, or split the weights: --tp 2 (or a quantised checkpoint)")
    if one_request > available:
        return Refusal(f"the pool holds {longest:,} tokens, fewer than one request of the --context-length "
                       f"{q.limit:,}", f"--context-length {longest} or --kv-cache-dtype fp8_e4m3")
    return None
