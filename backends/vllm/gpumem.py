"""vLLM's memory on a GPU as it reaches it at startup, term by term. Imports only kvbench.kv.

How vLLM sizes its pool (read in vllm/v1/worker/gpu_worker.py determine_available_memory, vllm/utils/mem_utils.py
memory_profiling; v0: vllm/worker/worker.py determine_num_available_blocks):

    KV bytes = CUDA's total (torch.cuda.mem_get_info) x gpu_memory_utilization
               - weights as loaded - the profile run's torch peak increase - non-torch increase
               (- the CUDA-graph estimate, from 0.21)

- gpu_memory_utilization: 0.9 (engine/arg_utils.py, every release before 0.33), 0.92 in 0.33
  (shared/reference/kv-accounting.md).
- The profile run (V1: gpu_model_runner.py profile_run) is a dummy forward of max_num_batched_tokens tokens
  (_dummy_run) and then, with the forward's hidden states still held, the sampler on the last token of
  min(max_num_seqs, max_num_batched_tokens) requests (_dummy_sampler_run: float32 logits, top-k/top-p).
  The forward's temporaries are freed before the sampler runs, so V1's peak is the larger of the two, not
  their sum. Defaults (engine/arg_utils.py): v0 without chunked prefill max(max_model_len, 2048), with chunked
  prefill (on by default past 32K) 512; V1 (0.8 on) the OpenAI server's 2048 and 256 requests, from 0.10 by GPU
  memory (get_batch_defaults: >= 70 GiB and not an A100: 8192 tokens, 1024 requests), at most
  max_num_seqs x max_model_len tokens.
- The sampler's bytes per request per vocab entry follow the top-k/top-p path vLLM takes
  (v1/sample/ops/topk_topp_sampler.py): the PyTorch sort path (0.8-0.9; 0.11.1-0.16, after PR #26859 turned
  the FlashInfer sampler off by default), FlashInfer's kernel (0.10-0.11.0, on by default where flashinfer is
  installed) and the Triton top-k/top-p path (0.17 on; from 0.21 FlashInfer is the default again, but the
  profile run also warms the native path, gpu_model_runner.py _dummy_sampler_run). Neither figure is in
  vLLM's source: both are fitted on public startup logs (:data:`FITTED`), as is the forward's peak per token.
- From 0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on by default: "CUDA graph memory profiling is
  enabled (default since v0.21.0)") the budget also loses vLLM's CUDA-graph estimate
  (gpu_model_runner.py profile_cudagraph_memory: the largest first capture of any mode plus the second
  capture's increase times the other graphs of each mode).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvbench.kv.rules import parse_version
from kvbench.kv.startup import FittedConstant, Refusal, fitted_range, read_fitted, StartupMemory, StartupQuestion, StartupTerm
from kvbench.kv.units import GIB

#: Constants no source states, fitted on public startup logs (fitted.toml, written by `python -m
#: kvbench.selfcheck.startup_fit --write`: each the median over the sources whose logs measure it, with its range).
#: What each stands for:
#: - activation_scale: the forward's peak / (tokens x 2 B x (3 I / tp + 4 H)) (v0, where the forward made the peak)
#: - sampler_copies: v0 (0.6.5-0.7), the sampler's float32 logits copies added to the forward's peak
#:   (max_num_seqs x vocab x 4 B each)
#: - v1_sampler_bytes_sort / _fast: V1's dummy sampler, bytes per request per vocab entry (float32 logits and the
#:   top-k/top-p path's temporaries) on the PyTorch sort path (0.8-0.9, 0.11.1-0.16) and on FlashInfer's
#:   (0.10-0.11.0) or the Triton path (0.17 on)
#: - non_torch_*: non-torch memory per GPU (GiB) by vLLM's accounting, which changed twice: 0.6.4 and before counted
#:   the increase after loading; 0.6.5-0.6.6 the CUDA context too, per rank; from 0.7 the increase again
#: - mxfp4_loaded_ratio: MXFP4 experts as the Marlin / Triton kernels hold them before compute capability 10
#: - cudagraph_first_mib / cudagraph_per_graph_mib: vLLM's CUDA-graph estimate (profile_cudagraph_memory, logged
#:   from 0.19, out of the pool from 0.21): the first FULL capture (read off the 0.19.0 H100 debug line) and each
#:   further graph's increase
FIT_RECORDS = read_fitted(Path(__file__).with_name("fitted.toml"))
FITTED = {key: float(record["value"]) for key, record in FIT_RECORDS.items()}

#: How a public startup log measures each FITTED constant (kvbench.selfcheck.startup_fit fits them). A log that
#: logs only its pool measures the first ``from_pool`` constant its figure moves with, in this order.
FITS = (
    FittedConstant("activation_scale", "x", ("activation_gib",), why="the forward's peak per token"),
    FittedConstant("sampler_copies", "x", ("activation_gib",), why="v0's float32 logits copies"),
    FittedConstant("v1_sampler_bytes_sort", "B", ("activation_gib",), from_pool=True,
                   why="the sort path's bytes per request per vocab entry"),
    FittedConstant("v1_sampler_bytes_fast", "B", ("activation_gib",), from_pool=True,
                   why="the FlashInfer / Triton path's bytes per request per vocab entry"),
    FittedConstant("non_torch_v064", "GiB", ("non_torch_gib",)),
    FittedConstant("non_torch_v065_per_tp", "GiB", ("non_torch_gib",)),
    FittedConstant("non_torch_v07_tp1", "GiB", ("non_torch_gib",)),
    FittedConstant("non_torch_v07_tpn", "GiB", ("non_torch_gib",), why="tp > 1 over NVLink"),
    FittedConstant("non_torch_v07_tpn_pcie", "GiB", ("non_torch_gib",), why="tp > 1 over PCIe"),
    FittedConstant("non_torch_v018_tp1", "GiB", ("non_torch_gib",)),
    FittedConstant("non_torch_v018_tpn", "GiB", ("non_torch_gib",), why="tp > 1 over NVLink"),
    FittedConstant("non_torch_v018_tpn_pcie", "GiB", ("non_torch_gib",), why="tp > 1 over PCIe"),
    FittedConstant("mxfp4_loaded_ratio", "x", ("weights_gib",)),
    FittedConstant("cudagraph_first_mib", "MiB", ("cudagraph_first_mib",)),
    FittedConstant("cudagraph_per_graph_mib", "MiB", ("cudagraph_per_graph_mib", "cudagraph_estimate_gib"),
                   why="each further graph's increase, Hopper (FlashAttention 3) at tp 1"),
    FittedConstant("cudagraph_per_graph_mib_tpn", "MiB", ("cudagraph_per_graph_mib", "cudagraph_estimate_gib"),
                   why="each further graph's increase at tp > 1 (the all-reduce's buffers in every graph)"),
    FittedConstant("cudagraph_per_graph_mib_pre_hopper", "MiB", ("cudagraph_per_graph_mib", "cudagraph_estimate_gib"),
                   why="each further graph's increase before Hopper (FlashAttention 2) at tp 1"),
)

#: Classes whose every corpus check holds within its tolerance with the log's own source left out of the fit, on
#: logs of three sources or more (tests/planner/test_startup_logs.py checks it).
VERIFIED_CLASSES: frozenset[str] = frozenset()  # none since the corpus of 100 logs: docs/plan.md
#: Where the CUDA-graph estimate (taken out of the pool from 0.21) was checked within 0.5 GiB: the Hopper logs
#: at tp 1 (FlashAttention 3). Elsewhere the logs estimated more than the model: the A100 (FlashAttention 2)
#: log 1.6 GiB more, the 2 x H100 log 1.0 GiB more (its graphs cost 12-20 MiB each, not 6).
CUDAGRAPH_CHECKED_MAJORS = frozenset({9})
CUDAGRAPH_OFF_GIB = 1.6


def cudagraph_checked(q: StartupQuestion) -> bool:
    """Whether the CUDA-graph estimate of this deployment is of a kind the corpus checked (Hopper, tp 1)."""
    return (q.kv.capability or (0, 0))[0] in CUDAGRAPH_CHECKED_MAJORS and max(1, q.kv.tp) == 1


def default_utilization(version: tuple[int, ...]) -> float:
    return 0.92 if version >= (0, 33) else 0.9


def is_v1(version: tuple[int, ...], options: dict) -> bool:
    """V1 is the engine from 0.8 (VLLM_USE_V1=0 kept v0 until 0.10)."""
    flag = options.get("use_v1")
    if flag is not None:
        return str(flag).lower() not in ("0", "false", "off", "no")
    return version >= (0, 8)


def big_gpu(capability: tuple[int, int] | None) -> bool:
    """arg_utils.py get_batch_defaults: 70 GiB or more and not an A100. The question carries the compute
    capability: 9.x (H100, H200) and 10.x (B200) are read as that row; any other (A100, L4, A10G, RTX cards)
    as the smaller one."""
    return (capability or (8, 0))[0] in (9, 10)


def eager(q: StartupQuestion) -> bool:
    return str(q.options.get("enforce_eager", "")).lower() in ("1", "true", "yes", "on")


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
    seqs, _ = max_num_seqs(q, rules)
    n = rules.max_num_batched_tokens(replace(q.kv, batch=seqs), q.limit)
    return n, (f"V1: max_num_batched_tokens {n:,} for this GPU (arg_utils.py get_batch_defaults, at most "
               f"max_num_seqs x max_model_len)")


def max_num_seqs(q: StartupQuestion, rules) -> tuple[int, str]:
    option = q.options.get("max_num_seqs")
    if option:
        return int(option), f"--max-num-seqs {int(option)}"
    version = parse_version(q.kv.version or rules.version)
    if is_v1(version, q.options) and version >= (0, 10) and big_gpu(q.kv.capability):
        return 1024, "max_num_seqs 1024 (arg_utils.py: 70 GiB or more, not an A100)"
    return 256, "max_num_seqs 256 (arg_utils.py default)"


def sampler_path(version: tuple[int, ...]) -> tuple[str, str]:
    """(FITTED key, why) for V1's dummy sampler by version (v1/sample/ops/topk_topp_sampler.py)."""
    if version < (0, 17):
        # 0.10-0.11.0 take FlashInfer's sampler only where flashinfer is installed, an optional extra of their wheels
        # (required from 0.11.1, which turned its sampler off by default, PR #26859): a pip install sorts. An image
        # that ships flashinfer (the A100 0.10.1.1 logs of the corpus) profiles less: docs/plan.md
        return "v1_sampler_bytes_sort", ("the PyTorch sort top-k/top-p path (0.8-0.16: flashinfer an optional extra "
                                         "before 0.11.1, its sampler off by default from 0.11.1)")
    return "v1_sampler_bytes_fast", ("the Triton top-k/top-p path (0.17 on; from 0.21 FlashInfer's is the default "
                                     "but _dummy_sampler_run warms the native path too)")


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
    reqs = min(seqs, tokens)
    forward_why = (f"{FITTED['activation_scale']} x {tokens:,} tokens x {per_token:,.0f} B (3 x {mlp:,} / {tp} + "
                   f"4 x {w.hidden:,} at 2 B)")
    if w.experts and is_v1(version, q.options):  # the fused-MoE kernels' workspaces, where larger
        moe, moe_why = moe_workspace(q, rules, tokens)
        if moe > forward:
            forward, forward_why = moe, f"the fused-MoE workspaces, {moe_why}"
    if is_v1(version, q.options):
        # gpu_model_runner.py profile_run: the forward's temporaries are freed before _dummy_sampler_run, which
        # runs with the forward's hidden states (tokens x hidden x 2 B) still held
        key, path = sampler_path(version)
        held = tokens * w.hidden * 2
        sampler = FITTED[key] * reqs * w.vocab
        peak = max(forward, held + sampler)
        which = "the forward" if forward >= held + sampler else "the sampler"
        return StartupTerm("profile peak", peak,
                           f"fitted: the larger of the forward ({forward_why}: {forward / GIB:.2f} GiB) and the "
                           f"sampler ({FITTED[key]} B x {reqs} requests x {w.vocab:,} vocab, {path}, with the "
                           f"{tokens:,} hidden states held: {(held + sampler) / GIB:.2f} GiB): {which} "
                           f"(v1/worker/gpu_model_runner.py profile_run, read on main past 0.21; the same order in "
                           f"0.8-0.19 logs); {why}; {why_seqs}", True)
    # v0: 0.6.4 and before measured the forward's peak alone (the RTX 3090 logs); the sampler counts from 0.6.5
    sampler = FITTED["sampler_copies"] * reqs * w.vocab * 4 if version >= (0, 6, 5) else 0.0
    return StartupTerm("profile peak", forward + sampler,
                       f"fitted: {forward_why} + {FITTED['sampler_copies']} x {reqs} requests x {w.vocab:,} vocab "
                       f"x 4 B; {why}; {why_seqs}", True)


def non_torch(q: StartupQuestion, rules) -> StartupTerm:
    """Non-torch memory by how vLLM counted it (it changed twice) and, at tp > 1, by the interconnect: NCCL
    connects far more channels over NVLink (24 or more on an HGX H100) than over PCIe (2), and NVLS, custom
    all-reduce and the FlashInfer all-reduce workspace need NVLink or P2P (pynccl.py, custom_all_reduce.py,
    symm_mem.py; NCCL's init.cc and nvls.cc)."""
    version = parse_version(q.kv.version or rules.version)
    tp = max(1, q.kv.tp)
    link = "" if tp == 1 or q.interconnect != "pcie" else "_pcie"
    if version and version < (0, 6, 5):
        key, why = "non_torch_v064", "0.6.4 and before: the increase after loading"
    elif version and version < (0, 7):
        key, why = "non_torch_v065_per_tp", f"0.6.5-0.6.6: the CUDA context and NCCL, x {tp} ranks"
    elif version and version < (0, 18):
        key = "non_torch_v07_tp1" if tp == 1 else f"non_torch_v07_tpn{link}"
        why = "0.7-0.17: the increase during profiling (cuBLAS; at tp > 1 NCCL, custom all-reduce)"
    else:
        key = "non_torch_v018_tp1" if tp == 1 else f"non_torch_v018_tpn{link}"
        why = "0.18 on: the increase during profiling" + ("" if tp == 1 else ": NCCL's lazily connected channels and "
                                                         "the all-reduce workspaces")
    where = "" if tp == 1 else f" over {q.interconnect}"
    if link and not FIT_RECORDS[key].get("sources"):  # no public log of PCIe at this version: NVLink's, the larger
        key, where = key.removesuffix(link), ", NVLink's figure (no public log over PCIe at this version)"
    gib = FITTED[key] * (tp if key == "non_torch_v065_per_tp" else 1)
    return StartupTerm("non-torch memory", gib * GIB, f"fitted: {gib:.2f} GiB{where}, {fitted_range(FIT_RECORDS[key])}; "
                       f"{why}", True)


def moe_workspace(q: StartupQuestion, rules, tokens: int) -> tuple[float, str]:
    """The fused-MoE kernels' workspaces in the profile run's forward (bf16, reused layer after layer): 0.19 Triton
    (fused_moe.py, modular_kernel.py) 2 B x M x k x (max(I, H) + max(2I, H)); 0.10 Triton / Marlin
    (fused_experts_impl, fused_marlin_moe.py) 2 B x M x k x (max(2I, H) + I), M the batched tokens (chunked at
    VLLM_FUSED_MOE_CHUNK_SIZE 32768), k the experts per token, I the expert width over tp, H the hidden size."""
    w = q.widths
    m, k, i, h = min(tokens, 32768), w.experts_per_token, w.expert_intermediate / max(1, q.kv.tp), w.hidden
    version = parse_version(q.kv.version or rules.version)
    if version >= (0, 19):
        return 2 * m * k * (max(i, h) + max(2 * i, h)), f"2 B x {m:,} x {k} x (max(I, H) + max(2I, H)), I {i:,.0f}"
    return 2 * m * k * (max(2 * i, h) + i), f"2 B x {m:,} x {k} x (max(2I, H) + I), I {i:,.0f}"


def capture_sizes(largest: int) -> int:
    """How many CUDA graphs of each mode vLLM captures up to ``largest`` tokens (config/compilation.py: 1, 2, 4,
    then every 8 to 256, then every 16)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 1025, 16)]
    return sum(1 for n in sizes if n <= largest)


def per_graph_key(q: StartupQuestion) -> str:
    """Which per-graph increase applies: graphs at tp > 1 hold the all-reduce's buffers; before Hopper vLLM runs
    FlashAttention 2, whose graphs the A100 log shows costlier."""
    if max(1, q.kv.tp) > 1:
        return "cudagraph_per_graph_mib_tpn"
    return "cudagraph_per_graph_mib" if (q.kv.capability or (8, 0))[0] >= 9 else "cudagraph_per_graph_mib_pre_hopper"


def cudagraph_estimate(q: StartupQuestion, rules) -> tuple[float, str]:
    """vLLM's CUDA-graph estimate (gpu_model_runner.py profile_cudagraph_memory, 0.19 on): the largest first
    capture plus, for each mode, the second capture's increase times its other graphs. FULL_AND_PIECEWISE
    (the default from 0.11): PIECEWISE graphs up to max_cudagraph_capture_size (min(2 x max_num_seqs, 512)),
    FULL decode graphs up to max_num_seqs of them."""
    if eager(q):
        return 0.0, "--enforce-eager: no CUDA graphs"
    seqs, _ = max_num_seqs(q, rules)
    largest = min(2 * seqs, 512)
    n_pw, n_full = capture_sizes(largest), capture_sizes(min(seqs, largest))
    key = per_graph_key(q)
    mib = FITTED["cudagraph_first_mib"] + FITTED[key] * (n_pw - 1 + n_full - 1)
    return mib * 2**20, (f"fitted: {FITTED['cudagraph_first_mib']:.0f} MiB first capture + "
                         f"{FITTED[key]:.0f} MiB x ({n_pw}-1 PIECEWISE + {n_full}-1 FULL) "
                         "graphs (gpu_model_runner.py profile_cudagraph_memory; vLLM 0.19.0 H100 logs)")


def cudagraph_term(q: StartupQuestion, rules) -> StartupTerm | None:
    """From 0.21 vLLM takes its CUDA-graph estimate out of the KV budget (gpu_worker.py
    determine_available_memory, VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on by default); before, graphs were
    captured after the pool was sized, outside the budget."""
    version = parse_version(q.kv.version or rules.version)
    if not is_v1(version, q.options) or version < (0, 21):
        return None
    gib, why = cudagraph_estimate(q, rules)
    return StartupTerm("CUDA graphs", gib, why + "; taken out of the pool from 0.21 (\"CUDA graph memory profiling "
                       "is enabled (default since v0.21.0)\", gpu_worker.py)", True)


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
    if kind == "dense" and family == "v1" and any(layer.kind == "sliding" for layer in q.geometry.kv_layers):
        kind = "sliding"  # the hybrid KV cache manager's pool (Gemma 2/3, Mistral's windowed layers)
    if "multimodal" in q.geometry.flags:
        kind = "multimodal"
    # tensor parallel adds NCCL's and the all-reduce's buffers and graphs: a class of its own
    return f"vllm {family} {kind}" + (" tp>1" if max(1, q.kv.tp) > 1 else "")


def startup_memory(rules, q: StartupQuestion) -> StartupMemory:
    version = parse_version(q.kv.version or rules.version)
    option = q.options.get("gpu_memory_utilization")
    fraction = float(option) if option else default_utilization(version)
    why = (f"--gpu-memory-utilization {fraction}" if option else
           f"gpu_memory_utilization {fraction} (vLLM {'0.33' if fraction == 0.92 else 'before 0.33'} default, "
           "engine/arg_utils.py)")
    graphs = cudagraph_term(q, rules)
    terms = [t for t in (weights_delta(q), activation_peak(q, rules), non_torch(q, rules), graphs) if t]
    k = klass(q, rules)
    verified, note = k in VERIFIED_CLASSES, ""
    if not verified:
        note = (f"unverified: the public startup logs of class '{k}' do not all hold within 5 % with their own source "
                "left out of the fit (docs/plan.md)")
    elif graphs is not None and graphs.bytes and not cudagraph_checked(q):
        verified = False
        note = (f"unverified {'on this GPU' if max(1, q.kv.tp) == 1 else 'at tp > 1'}: vLLM "
                f"{'.'.join(map(str, version))} takes its CUDA-graph estimate ({graphs.bytes / GIB:.2f} GiB here) out "
                f"of the pool, checked on Hopper logs at tp 1 only; the A100 and 2 x H100 logs estimated 1.0-"
                f"{CUDAGRAPH_OFF_GIB} GiB more, so the pool may be up to {CUDAGRAPH_OFF_GIB} GiB smaller (docs/plan.md)")
    return StartupMemory("vllm", "vLLM", fraction, why, q.cuda_bytes, q.cuda_source, tuple(terms), k, verified, note)


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
