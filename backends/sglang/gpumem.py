"""SGLang's memory on a GPU at startup. Imports only kvbench.kv.

SGLang (0.5.23 read; see kvrules.py) budgets against the GPU's total and its ``mem_fraction_static``
(auto: :func:`kvrules.auto_mem_fraction_static`, by GPU memory and tp): the KV pool gets what loading left free
less total x (1 - fraction) (mem_cache/kv_cache_configurator.py _profile_available_bytes), that is
total x fraction - weights - what the process held before loading (CUDA context, NCCL). Activations and CUDA
graphs live in the (1 - fraction) share and are not subtracted again.
"""
from __future__ import annotations

from kvbench.kv.startup import Refusal, StartupMemory, StartupQuestion, StartupTerm
from kvbench.kv.units import GIB

#: The process's memory before loading weights at tp > 1, as SGLang logs it ("Init torch distributed ends.
#: mem usage=1.96 GB", TP0 of 8 x H200, sgl-project/sglang#11716). No tp 1 log was found: the same figure
#: is used there and the class says unverified.
PRELOAD_GIB = 1.96
VERIFIED_CLASSES = frozenset({"sglang tp>1"})


def startup_memory(rules, q: StartupQuestion) -> StartupMemory:
    from .kvrules import auto_mem_fraction_static

    option = q.options.get("mem_fraction_static")
    tp = max(1, q.kv.tp)
    if option:
        fraction, why = float(option), f"--mem-fraction-static {float(option)}"
    else:
        mla = q.geometry.mla is not None
        fraction = auto_mem_fraction_static(q.cuda_bytes / 2**20, tp, mla)
        why = (f"mem_fraction_static auto {fraction} for {q.cuda_bytes / GIB:.1f} GiB at tp {tp} "
               "(arg_groups/memory_hook.py handle_gpu_memory_settings, 0.5.23)")
    terms = (StartupTerm("before loading", PRELOAD_GIB * GIB,
                         f"CUDA context and NCCL before the weights: {PRELOAD_GIB} GiB (\"Init torch distributed ends. "
                         "mem usage=1.96 GB\", 8 x H200, sgl-project/sglang#11716)", tp == 1),)
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
