"""vLLM's memory on a GPU as it reaches it at startup, term by term. Imports only kvbench.kv.

How vLLM sizes its pool (read in vllm/v1/worker/gpu_worker.py determine_available_memory, vllm/utils
memory_profiling; v0: vllm/worker/worker.py determine_num_available_blocks):

    KV bytes = CUDA's total (torch.cuda.mem_get_info) x gpu_memory_utilization
               - weights as loaded - the profile run's torch peak - non-torch memory (- a CUDA-graph estimate
                 from 0.33)

- gpu_memory_utilization: 0.9 (engine/arg_utils.py, every release before 0.33), 0.92 in 0.33
  (shared/reference/kv-accounting.md).
- The profile run is a dummy forward of max_num_batched_tokens tokens and, in V1, the sampler at max_num_seqs
  requests. Its defaults (engine/arg_utils.py): v0 without chunked prefill max(max_model_len, 2048), with
  chunked prefill (on by default past 32K) 512; V1 (0.8 on) the OpenAI server's 2048 and 256 requests, from
  0.10 by GPU memory (>= 70 GiB and not an A100: 8192 tokens, 1024 requests).
- The peak itself is no figure in vLLM's source: it is what PyTorch's allocator saw. It is modelled here as
  activations per token (the MLP's gate/up and activation outputs, 3 x intermediate / tp, and four
  hidden-wide copies) x tokens x 2 bytes, plus the sampler's float32 logits, and scaled by constants fitted
  on public startup logs (tests/data/startup_logs/, :data:`FITTED`); each ledger line says so.
"""
from __future__ import annotations

from kvbench.kv.rules import parse_version
from kvbench.kv.startup import Refusal, StartupMemory, StartupQuestion, StartupTerm
from kvbench.kv.units import GIB

#: Constants no source states, fitted on the corpus's fit set (selfcheck/startup_logs.py --fit prints the fit
#: and the held-out error; docs/plan.md shows both tables).
FITTED = {
    # the profile peak / (tokens x 2 B x (3 I / tp + 4 H)): the RTX 3090 Llama-3.1-8B log at 20,000 tokens
    "activation_scale": 0.935,
    # the sampler's float32 logits copies at the peak (max_num_seqs x vocab x 4 B each): the H100 Llama-3-8B log
    "sampler_copies": 3.4,
    # non-torch memory per GPU (GiB) by vLLM's accounting, which changed twice: 0.6.4 and before counted the
    # increase after loading (RTX 3090 log: 0.35); 0.6.5-0.6.6 counted the CUDA context too, per rank
    # (H100 logs: 1.79 at tp 1, 3.58 at tp 2 (per GPU x tp)); from 0.7 the increase again (H100 0.16 at tp 1;
    # tp > 1: 0.25 (2 x 4090, 0.7.2), 0.38 (4 x A100 40GB, 0.8.3): 0.3)
    "non_torch_v064": 0.35, "non_torch_v065_per_tp": 1.79, "non_torch_v07_tp1": 0.16, "non_torch_v07_tpn": 0.3,
    # V1 (0.10 on) on Hopper with an MoE checkpoint: what the profile run and its kernels' workspaces hold
    # besides the modelled activations (GiB), fitted on the gpt-oss-120b 0.10.1 H100 log (-2.14 GiB left);
    # held out: Qwen3-235B-A22B-FP8 at tp 4 (8.02 against 8.11 GiB) and gpt-oss-120b at 0.95 / 1024 tokens
    # (2.39 against 1.71 GiB: off by 0.68 GiB, so the class stays unverified)
    "v1_moe_extra": 5.6,
    # MXFP4 experts as the Marlin / Triton kernels hold them on a GPU without native FP4 (before 10.0):
    # loaded / on-disk bytes, fitted on the gpt-oss-120b H100 0.14.1 log (64.38 GiB loaded)
    "mxfp4_loaded_ratio": 1.06,
}

#: Classes whose corpus logs the rule matches within the check's tolerance (tests/planner/test_startup_logs.py
#: checks this list against the corpus both ways).
VERIFIED_CLASSES = frozenset({"vllm v0 dense"})


def default_utilization(version: tuple[int, ...]) -> float:
    return 0.92 if version >= (0, 33) else 0.9


def is_v1(version: tuple[int, ...], options: dict) -> bool:
    """V1 is the engine from 0.8 (VLLM_USE_V1=0 kept v0 until 0.10)."""
    flag = options.get("use_v1")
    if flag is not None:
        return str(flag).lower() not in ("0", "false", "off", "no")
    return version >= (0, 8)


def big_gpu(capability: tuple[int, int] | None) -> bool:
    """arg_utils.py: 70 GiB or more and not an A100. The question carries the compute capability: 9.x (H100,
    H200) and 10.x (B200) are read as that row."""
    return (capability or (8, 0))[0] >= 9


def profile_tokens(q: StartupQuestion, rules) -> tuple[int, str]:
    """The dummy forward's tokens: --max-num-batched-tokens, or vLLM's default for this version and GPU."""
    option = q.options.get("max_num_batched_tokens")
    if option:
        return int(option), f"--max-num-batched-tokens {int(option)}"
    version = parse_version(q.kv.version or rules.version)
    if not is_v1(version, q.options):
        if q.limit > 32768:
            return 512, "v0: chunked prefill on past 32K, max_num_batched_tokens 512 (engine/arg_utils.py)"
        n = max(q.limit, 2048)
        return n, f"v0: max_num_batched_tokens = max(max_model_len, 2048) = {n:,} (config.py SchedulerConfig)"
    if version < (0, 10):
        return min(2048, q.limit), "V1 before 0.10: the OpenAI server's max_num_batched_tokens 2048 (arg_utils.py)"
    n = rules.max_num_batched_tokens(q.kv, q.limit)
    return n, f"V1: max_num_batched_tokens {n:,} for this GPU (arg_utils.py get_batch_defaults)"


def max_num_seqs(q: StartupQuestion, rules) -> tuple[int, str]:
    option = q.options.get("max_num_seqs")
    if option:
        return int(option), f"--max-num-seqs {int(option)}"
    version = parse_version(q.kv.version or rules.version)
    if is_v1(version, q.options) and version >= (0, 10) and big_gpu(q.kv.capability):
        return 1024, "max_num_seqs 1024 (arg_utils.py: 70 GiB or more, not an A100)"
    return 256, "max_num_seqs 256 (arg_utils.py default)"


def activation_peak(q: StartupQuestion, rules) -> StartupTerm:
    w = q.widths
    tokens, why = profile_tokens(q, rules)
    seqs, why_seqs = max_num_seqs(q, rules)
    if w is None:
        return StartupTerm("profile peak", 0.0, "unknown: the config gives no widths (hidden_size)", True)
    tp = max(1, q.kv.tp)
    mlp = w.experts_per_token * w.expert_intermediate if w.experts else w.intermediate
    per_token = 2 * (3 * mlp / tp + 4 * w.hidden)
    forward = FITTED["activation_scale"] * tokens * per_token
    version = parse_version(q.kv.version or rules.version)
    # 0.6.4 and before measured the forward's peak alone (the RTX 3090 logs); the sampler counts from 0.6.5
    sampler = FITTED["sampler_copies"] * min(seqs, tokens) * w.vocab * 4 if version >= (0, 6, 5) else 0.0
    return StartupTerm("profile peak", forward + sampler,
                       f"fitted: {FITTED['activation_scale']} x {tokens:,} tokens x {per_token:,.0f} B (3 x "
                       f"{mlp:,} / {tp} + 4 x {w.hidden:,} at 2 B) + {FITTED['sampler_copies']} x {min(seqs, tokens)} "
                       f"requests x {w.vocab:,} vocab x 4 B; {why}; {why_seqs}", True)


def non_torch(q: StartupQuestion, rules) -> StartupTerm:
    version = parse_version(q.kv.version or rules.version)
    tp = max(1, q.kv.tp)
    if version and version < (0, 6, 5):
        gib, why = FITTED["non_torch_v064"], "0.6.4 and before: the increase after loading (RTX 3090 log)"
    elif version and version < (0, 7):
        gib, why = FITTED["non_torch_v065_per_tp"] * tp, f"0.6.5-0.6.6: the CUDA context and NCCL, {tp} ranks (H100 logs)"
    else:
        gib = FITTED["non_torch_v07_tp1"] if tp == 1 else FITTED["non_torch_v07_tpn"]
        why = "0.7 on: the increase during profiling (cuBLAS, NCCL, custom all-reduce)"
    return StartupTerm("non-torch memory", gib * GIB, f"fitted: {gib:.2f} GiB; {why}", True)


def moe_extra(q: StartupQuestion, rules) -> StartupTerm | None:
    version = parse_version(q.kv.version or rules.version)
    if not (q.widths and q.widths.experts and is_v1(version, q.options) and version >= (0, 10)):
        return None
    gib = FITTED["v1_moe_extra"]
    return StartupTerm("MoE profile extra", gib * GIB, f"fitted: {gib} GiB that V1 (0.10 on) holds for an MoE "
                       "checkpoint beyond the modelled activations (gpt-oss-120b on H100, 0.10.1)", True)


def weights_delta(q: StartupQuestion) -> StartupTerm | None:
    """MXFP4 experts repacked for Marlin / Triton on Hopper (compute capability 9.x). On an RTX 3090 (8.6) the
    held-out gpt-oss-20b log loaded 12.88 GiB against 12.82 on disk: no repack growth there."""
    if q.quant_method != "mxfp4" or (q.kv.capability or (8, 0))[0] != 9:
        return None
    ratio = FITTED["mxfp4_loaded_ratio"]
    return StartupTerm("weights as loaded", q.weights_bytes * (ratio - 1),
                       f"fitted: MXFP4 weights held at {ratio} x their size on disk by the Marlin / Triton MoE "
                       "kernels vLLM selects on Hopper (quantization/mxfp4.py; gpt-oss-120b on "
                       "H100, 0.14.1: 64.38 GiB loaded)", True)


def klass(q: StartupQuestion, rules) -> str:
    version = parse_version(q.kv.version or rules.version)
    family = "v1" if is_v1(version, q.options) else "v0"
    kind = "moe" if q.widths and q.widths.experts else "dense"
    if "multimodal" in q.geometry.flags:
        kind = "multimodal"
    return f"vllm {family} {kind}"


def startup_memory(rules, q: StartupQuestion) -> StartupMemory:
    version = parse_version(q.kv.version or rules.version)
    option = q.options.get("gpu_memory_utilization")
    fraction = float(option) if option else default_utilization(version)
    why = (f"--gpu-memory-utilization {fraction}" if option else
           f"gpu_memory_utilization {fraction} (vLLM {'0.33' if fraction == 0.92 else 'before 0.33'} default, "
           "engine/arg_utils.py)")
    terms = [t for t in (weights_delta(q), activation_peak(q, rules), non_torch(q, rules), moe_extra(q, rules)) if t]
    if version >= (0, 33):
        terms.append(StartupTerm("CUDA graphs", 0.0, "not modelled: 0.33 subtracts its CUDA-graph estimate; no public "
                                 "0.33 log yet (the class is unverified)", True))
    k = klass(q, rules)
    return StartupMemory("vllm", "vLLM", fraction, why, q.cuda_bytes, q.cuda_source, tuple(terms), k,
                         k in VERIFIED_CLASSES,
                         "" if k in VERIFIED_CLASSES else f"unverified: no public startup log of class '{k}' "
                         "matches within 5 % (docs/plan.md)")


def startup_refusal(rules, q: StartupQuestion, available: float, one_request: float, longest: int) -> Refusal | None:
    """vLLM's own refusals at start (v1/core/kv_cache_utils.py check_enough_kv_cache_memory; v0 worker.py
    raise_if_cache_size_invalid)."""
    if available <= 0:
        return Refusal("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                       "initializing the engine.",
                       "raise --gpu-memory-utilization, or free memory: a smaller checkpoint (or its quantised "
                       "one), --tensor-parallel-size 2, or a smaller --max-num-batched-tokens")
    if one_request <= available:
        return None
    version = parse_version(q.kv.version or rules.version)
    if is_v1(version, q.options):
        msg = (f"To serve at least one request with the models's max seq len ({q.limit}), ({one_request / GIB:.2f} "
               f"GiB KV cache is needed, which is larger than the available KV cache memory ({available / GIB:.2f} "
               f"GiB). Based on the available memory, the estimated maximum model length is {longest}. Try "
               "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
    else:
        msg = (f"The model's max seq len ({q.limit}) is larger than the maximum number of tokens that can be stored "
               f"in KV cache ({longest}). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
               "when initializing the engine.")
    return Refusal(msg, f"--max-model-len {longest} (or --kv-cache-dtype fp8, or --tensor-parallel-size 2)")
