"""llama.cpp's memory on a CUDA GPU at startup, as llama-server allocates it (the rules of every engine that
runs llama-server use it). Imports only kvbench.kv.

llama.cpp takes no fraction of the GPU: it allocates the weights, the KV cache for its cells and the compute
buffer the scheduler reserves for the largest graph, and fails with cudaMalloc's out of memory where they do not
fit. The compute buffer (src/llama-context.cpp graph_reserve: n_ubatch tokens against every KV cell, every token
an output) is what ggml-alloc's graph allocator needs for that graph: a tensor's memory is reused once its last
consumer is placed, so the buffer is the largest set of tensors live at once, not their sum. Three moments bound
it (src/llama-graph.cpp build_attn_mha, build_moe_ffn, the output head), all float32 unless said:

- attention: without flash attention the scores, n_kv x n_ubatch x n_head, and the KQ mask, n_kv x n_ubatch;
  with flash attention (ggml_flash_attn_ext) no scores and the mask in f16. Beside them Q (n_head x head_dim_k),
  the attention output (n_head x head_dim_v) and two hidden-size tensors (the residual and the block's normed
  input, whose freed block the scores cannot use), each x n_ubatch. MLA (DeepSeek) attends with Q absorbed into
  the latent: head_dim_k = kv_lora_rank + rope, head_dim_v = kv_lora_rank. A quantised cache changes nothing
  here: the CUDA kernels convert K and V in their own pool, outside the compute buffer.
- the MoE FFN (ggml_mul_mat_id): the router's logits (n_expert), gate and up (n_expert_used x n_ff_exp each), the
  experts' outputs before their sum (n_expert_used x n_embd) and two hidden-size tensors, x n_ubatch, beside the
  mask, which lives until the last layer; a dense FFN: gate and up of n_ff and two hidden-size tensors.
- the output: the logits, n_vocab x n_ubatch, and the normed hidden state.

With one stream per sequence (no unified cache) the batch's tokens split over the streams and each attends to its
stream's cells: the scores and the mask are those of one stream's cells x n_ubatch. A weight kept in host memory
(-ot exps=CPU, --cpu-moe) is copied into the compute buffer for its op (ggml-backend's scheduler offloads any op of
32 rows or more to the GPU, one weight per split): ``host_weight_copy`` adds the largest such tensor to the FFN's
moment; a plan keeps every weight on the GPU.
"""
from __future__ import annotations

from pathlib import Path

from kvbench.kv.startup import (FittedConstant, Refusal, StartupMemory, StartupQuestion, StartupTerm, fitted_range,
                                read_fitted)
from kvbench.kv.units import MIB

#: Constants no source states, fitted on public startup logs (kvbench.selfcheck.startup_fit): what is not free
#: when llama.cpp loads (the CUDA context it creates, and other processes'; its "MiB free" device line). The
#: compute buffer is the graph's largest live set, every part of it from llama.cpp's source (tests/planner/
#: test_llamacpp_compute_buffer.py checks each against a log).
FIT_RECORDS = read_fitted(Path(__file__).with_name("fitted.toml"))
FITTED = {key: float(record["value"]) for key, record in FIT_RECORDS.items()}
FITS = (FittedConstant("not_free_at_load_mib", "MiB", ("free_at_load_mib",),
                       why="CUDA's total less what llama.cpp finds free at load"),)
N_UBATCH = 512  # common/common.h n_ubatch default
F32 = 4
F16 = 2
#: Classes whose every corpus check holds with its own source left out of the fit (none yet: docs/plan.md)
VERIFIED_CLASSES: frozenset[str] = frozenset()


def _flash(q: StartupQuestion) -> bool:
    """-fa: "auto" by default in the llama.cpp of 0.3.36 (on for CUDA where the kernels support the head size)."""
    v = q.options.get("flash_attn")
    return v is None or str(v).lower() in ("1", "true", "on", "yes", "auto")


def graph_moments(q: StartupQuestion, cells: int, host_weight_copy: float = 0.0) -> dict[str, tuple[float, str]]:
    """{moment: (bytes, how)} of the reserve graph's live tensors at its attention, its FFN and its output, for
    ``cells`` KV cells in all (every stream); ``host_weight_copy``: the bytes of the largest weight kept in host
    memory that the FFN copies in (0: every weight on the GPU)."""
    g, w = q.geometry, q.widths
    streams = 1 if q.options.get("unified") else max(1, q.kv.batch)
    n_kv = max(1, cells // streams)  # one stream's cells
    ubatch = min(int(q.options.get("n_ubatch") or N_UBATCH), max(1, cells))  # graph_reserve: min(n_ctx, n_ubatch)
    heads = g.num_attention_heads or (w.heads if w else 0)
    full = next((layer for layer in g.layers if layer.kind == "full"), g.layers[0] if g.layers else None)
    if g.mla is not None:  # Q absorbed into the latent: attends over kv_lora_rank + rope, out of kv_lora_rank
        dk, dv, how_dims = g.mla.latent, g.mla.kv_lora_rank, "MLA latent "
    else:
        dk, dv, how_dims = (full.head_dim_k, full.head_dim_v or full.head_dim_k, "") if full else (0, 0, "")
    hidden = w.hidden if w else heads * dk
    flash = _flash(q)
    mask = n_kv * ubatch * (F16 if flash else F32)
    scores = 0 if flash else n_kv * ubatch * heads * F32
    beside = ubatch * F32 * (heads * dk + heads * dv + 2 * hidden)
    out: dict[str, tuple[float, str]] = {}
    out["attention"] = (scores + mask + beside, (
        f"{n_kv:,} cells x {ubatch} ubatch x ({'the f16 mask' if flash else f'{heads} heads of scores + the mask'})"
        + ("" if flash else " x 4 B") + f" + {ubatch} x ({heads} x {how_dims}{dk} Q + {heads} x {dv} out + "
        f"2 x {hidden} hidden) x 4 B"))
    if w is None:
        return out
    if w.experts:
        ffn = ubatch * F32 * (w.experts + 2 * w.experts_per_token * w.expert_intermediate
                              + w.experts_per_token * w.hidden + 2 * w.hidden)
        how = (f"{ubatch} x ({w.experts} router + 2 x {w.experts_per_token} x {w.expert_intermediate} gate/up + "
               f"{w.experts_per_token} x {w.hidden} experts' out + 2 x {w.hidden} hidden) x 4 B + the mask")
    else:
        ffn = ubatch * F32 * (2 * w.intermediate + 2 * w.hidden)
        how = f"{ubatch} x (2 x {w.intermediate} gate/up + 2 x {w.hidden} hidden) x 4 B + the mask"
    if host_weight_copy:
        how += f" + {host_weight_copy / MIB:,.2f} MiB weight copied from host memory"
    out["ffn"] = (ffn + mask + host_weight_copy, how)
    out["output"] = (ubatch * F32 * (w.vocab + w.hidden), f"{ubatch} x ({w.vocab:,} logits + {w.hidden} hidden) x 4 B")
    return out


def compute_buffer(q: StartupQuestion, cells: int, host_weight_copy: float = 0.0) -> StartupTerm:
    moments = graph_moments(q, cells, host_weight_copy)
    name, (peak, how) = max(moments.items(), key=lambda kv: kv[1][0])
    others = ", ".join(f"{k} {b / MIB:,.1f} MiB" for k, (b, _) in moments.items() if k != name)
    return StartupTerm("compute buffer", peak,
                       f"the reserve graph's largest live set, at its {name}: {how} (llama-context.cpp graph_reserve, "
                       f"ggml-alloc; flash attention {'on' if _flash(q) else 'off'}){'; ' + others if others else ''}")


def not_free_at_load() -> StartupTerm:
    """What CUDA's total loses before llama.cpp allocates: the CUDA context it creates (ggml_cuda_init) and what
    other processes hold (a desktop's display on a consumer card), as the "MiB free" of its device lines shows."""
    mib = FITTED["not_free_at_load_mib"]
    return StartupTerm("CUDA context", mib * MIB, f"fitted: {mib:.0f} MiB not free at load (the CUDA context, and "
                       f"other processes'), {fitted_range(FIT_RECORDS['not_free_at_load_mib'])}", True)


def startup_memory(rules, q: StartupQuestion) -> StartupMemory:
    a = rules.deployment(q.kv.__class__(**{**q.kv.__dict__, "context": q.limit, "batch": max(1, q.batch)}), q.limit)
    k = "llamacpp cuda " + ("flash-attn" if _flash(q) else "no-flash-attn")
    ok = k in VERIFIED_CLASSES
    return StartupMemory("llamacpp", "llama.cpp", 1.0, "llama.cpp allocates what it needs (no fraction)",
                         q.cuda_bytes, q.cuda_source, (compute_buffer(q, a.tokens_full), not_free_at_load()), k, ok,
                         "" if ok else f"unverified: no public llama.cpp startup log of class '{k}' checked")


def startup_refusal(rules, q: StartupQuestion, available: float, one_request: float, longest: int) -> Refusal | None:
    if one_request <= available:
        return None
    return Refusal(f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {one_request / MIB:.2f} MiB on device 0: "
                   "cudaMalloc failed: out of memory",
                   f"{rules.limit_flag(longest, max(1, q.batch)) if longest else 'fewer cells'}, --cache-type-k q8_0 "
                   "--cache-type-v q8_0, -fa on, or fewer -ngl layers")
