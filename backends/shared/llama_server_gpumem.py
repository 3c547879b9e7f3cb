"""llama.cpp's memory on a CUDA GPU at startup, as llama-server allocates it (the rules of every engine that
runs llama-server use it). Imports only kvbench.kv.

llama.cpp takes no fraction of the GPU: it allocates the weights, the KV cache for its cells and the compute
buffer the scheduler reserves for the largest graph (src/llama-context.cpp graph_reserve at n_ubatch tokens
against every KV cell), and fails with cudaMalloc's out of memory where they do not fit. Without flash
attention the graph holds the attention scores, n_ubatch x n_kv x n_head in float32, and the KQ mask,
n_ubatch x n_kv in float32; the rest of the graph (the MLP's and the output's tensors) is fitted.
"""
from __future__ import annotations

from pathlib import Path

from kvbench.kv.startup import FittedConstant, Refusal, fitted_range, read_fitted, StartupMemory, StartupQuestion, StartupTerm
from kvbench.kv.units import MIB

#: Constants no source states, fitted on public startup logs (kvbench.selfcheck.startup_fit): the compute buffer
#: beyond the scores and the mask (MiB), first read off the logdetective n_ctx 2048 log (164 MiB = 128 + 4 + 32).
FIT_RECORDS = read_fitted(Path(__file__).with_name("fitted.toml"))
FITTED = {key: float(record["value"]) for key, record in FIT_RECORDS.items()}
FITS = (FittedConstant("compute_rest_mib", "MiB", ("compute_mib",), why="the graph beyond the scores and the mask"),)
N_UBATCH = 512  # common/common.h n_ubatch default
#: Classes whose every corpus check holds with its own source left out of the fit (none yet: docs/plan.md)
VERIFIED_CLASSES: frozenset[str] = frozenset()


def _flash(q: StartupQuestion) -> bool:
    """-fa: "auto" by default in the llama.cpp of 0.3.36 (on for CUDA where the kernels support the head size)."""
    v = q.options.get("flash_attn")
    return v is None or str(v).lower() in ("1", "true", "on", "yes", "auto")


def compute_buffer(q: StartupQuestion, cells: int) -> StartupTerm:
    ubatch = int(q.options.get("n_ubatch") or N_UBATCH)
    heads = q.geometry.num_attention_heads or 0
    if _flash(q):
        rest = FITTED["compute_rest_mib"]
        return StartupTerm("compute buffer", rest * MIB, f"fitted: {rest:g} MiB; with flash attention the "
                           "scores are not materialised (no log with flash attention checked)", True)
    scores = ubatch * cells * (heads + 1) * 4
    rest = FITTED["compute_rest_mib"]
    return StartupTerm("compute buffer", scores + rest * MIB,
                       f"{ubatch} ubatch x {cells:,} cells x ({heads} heads + the mask) x 4 B (llama-context.cpp "
                       f"graph_reserve, no flash attention) + {rest:g} MiB fitted (logdetective#106 log)", True)


def startup_memory(rules, q: StartupQuestion) -> StartupMemory:
    a = rules.deployment(q.kv.__class__(**{**q.kv.__dict__, "context": q.limit, "batch": max(1, q.batch)}), q.limit)
    k = "llamacpp cuda " + ("flash-attn" if _flash(q) else "no-flash-attn")
    ok = k in VERIFIED_CLASSES
    return StartupMemory("llamacpp", "llama.cpp", 1.0, "llama.cpp allocates what it needs (no fraction)",
                         q.cuda_bytes, q.cuda_source, (compute_buffer(q, a.tokens_full),), k, ok,
                         "" if ok else f"unverified: no public llama.cpp startup log of class '{k}' checked")


def startup_refusal(rules, q: StartupQuestion, available: float, one_request: float, longest: int) -> Refusal | None:
    if one_request <= available:
        return None
    return Refusal(f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {one_request / MIB:.2f} MiB on device 0: "
                   "cudaMalloc failed: out of memory",
                   f"-c {longest} (fewer cells), --cache-type-k q8_0 --cache-type-v q8_0, -fa on, or fewer -ngl layers")
