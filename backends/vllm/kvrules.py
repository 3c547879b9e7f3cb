"""vLLM's KV rules: how it sizes, stores and rounds its cache. Imports only kvbench.kv."""
from __future__ import annotations

from dataclasses import replace

from kvbench.kv.geometry import KVGeometry, cdiv, decompressed
from kvbench.kv.rules import (KVAnswer, KVQuestion, KVRuleError, KVRules, Number, Switch, Whole, parse_version,
                              with_kinds)
from kvbench.kv.speculative import DraftKV, ngram_kv

from . import gpumem

# The model types vLLM runs with its MLA backend (model_arch_config_convertor.py, is_deepseek_mla, 0.32.0):
# they cache the latent. Any other config with kv_lora_rank (MiniCPM3) is plain attention there.
MLA_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note", "deepseek_mtp",
    "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa", "glm4_moe_lite", "glm4_moe_lite_mtp", "kimi_k2",
    "kimi_linear", "longcat_flash", "pangu_ultra_moe", "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp",
    "bailing_hybrid_v3_mtp", "hy_v4", "hy_v4_mtp"})
# config/model.py _FLOAT16_NOT_SUPPORTED_MODELS: `--dtype auto` never picks float16 for these ("numerical
# instability"), so on a GPU without bf16 they run in float32
FLOAT16_NOT_SUPPORTED = frozenset({"gemma2", "gemma3", "gemma3_text", "plamo2", "glm4"})


class VLLMKV(KVRules):
    """vLLM V1's paged KV cache (0.32.0 read: v1/kv_cache_interface.py, v1/core/kv_cache_utils.py,
    config/model.py, the model files, platforms/cpu.py).

    - Pages: one block of ``block_size`` tokens per layer is kv_heads x block x (K + V head size) x dtype.
      The block size is 16 on a GPU, 128 on a CPU (16 for MLA on a CPU without AMX tiles).
    - MLA models of :data:`MLA_MODEL_TYPES`: one latent (kv_lora_rank + rope), no V, replicated on every
      tensor-parallel rank. MiniCPM3 and other configs with kv_lora_rank: every head decompressed, K of
      qk_nope + qk_rope and V zero-padded to K's size (models/minicpm3.py).
    - Hybrid models (sliding or chunked layers beside full ones), with the hybrid KV cache manager (on by
      default: GPU, and CPU in 0.32): layers of one kind form groups of G layers (G = the smallest kind's
      layer count, or the largest when it is under 1.5x the smallest; a kind's layers fill whole groups, the
      last padded); one block id spans a group, so a block is G pages; a sliding layer's blocks wholly before
      its window go back to the pool, a chunked layer's before its current chunk. Without the manager
      (``hybrid_kv_cache=off``, vLLM before 0.10, or on a CPU before 0.32) every layer keeps every token.
    - The pool holds one null block beside the sequences.
    """

    engine = "vllm"
    version = "0.32.0"
    has_blocks = True
    shares_prefix_kv = True  # the automatic prefix cache: requests that start alike share full blocks
    # answer() is the blocks a load holds, which is what kv_cache_usage_perc counts: the KV in use per GPU
    # is compared with it (CellRow.kv_peak_bytes_per_gpu_predicted)
    answer_is_in_use = True
    pool_from_budget = True
    fraction_option = "gpu_memory_utilization"
    # what `kvbench plan --engine-option` takes (KVQuestion.options): the hybrid manager on or off, and the
    # server's --max-num-batched-tokens where it is not vLLM's default (it sets a window's admission cap); the
    # ranges are vLLM's own (0.33.0 config/cache.py:215 gpu_memory_utilization Field(gt=0, le=1),
    # config/scheduler.py:48, 62 max_num_batched_tokens, max_num_seqs Field(ge=1))
    rule_options = {"hybrid_kv_cache": Switch(), "max_num_batched_tokens": Whole(), "max_num_seqs": Whole(),
                    "gpu_memory_utilization": Number(0, 1), "use_v1": Switch(), "enforce_eager": Switch()}
    dtypes = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32",
              "float32": "fp32", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}

    def supported_dtypes(self, geometry: KVGeometry, capability: tuple[int, int] | None) -> list[str]:
        """platforms/cuda.py supported_dtypes (compute capability 8.0 and later: bf16, fp16, fp32; 6.x-7.x:
        fp16, fp32), less float16 for :data:`FLOAT16_NOT_SUPPORTED` (config/model.py _is_valid_dtype)."""
        cc = capability or (8, 0)
        dtypes = ["bf16", "fp16", "fp32"] if cc >= (8, 0) else ["fp16", "fp32"] if cc >= (6, 0) else ["fp32"]
        return [d for d in dtypes if not (d == "fp16" and geometry.model_type in FLOAT16_NOT_SUPPORTED)]

    def serving_dtype(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        """config/model.py _resolve_auto_dtype: a float32 config (or one naming no dtype: _find_dtype falls
        back to float32) is served in the GPU's first supported dtype; a 16-bit config in its own dtype
        where the GPU supports it, else in that first dtype."""
        supported = self.supported_dtypes(geometry, capability)
        config = geometry.dtype or "fp32"
        if config == "fp32":
            config = supported[0]
        return config if config in supported else supported[0]

    def serving_note(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        named = geometry.dtype or "none (float32 assumed)"
        served = self.serving_dtype(geometry, capability)
        if named == served:
            return f"vLLM --dtype auto: the config's {served}"
        return f"vLLM --dtype auto: the config's {named} served in {served}, the GPU's first supported dtype"

    def checkpoint_kv_dtype(self, geometry: KVGeometry) -> str | None:
        """utils/torch_utils.py resolve_kv_cache_dtype_string: with --kv-cache-dtype auto, only a ModelOpt
        checkpoint whose kv_cache_quant_algo is FP8 picks fp8 (fp8_e4m3); any other checkpoint (DeepSeek's
        FP8 weights, compressed-tensors) keeps the model dtype unless --kv-cache-dtype says fp8."""
        method = next((f.split("=", 1)[1] for f in geometry.flags if f.startswith("quant_method=")), "")
        return "fp8_e4m3" if method.startswith("modelopt") and "kv_cache_fp8" in geometry.flags else None

    kv_lever_dtypes = ("fp8",)

    def kv_dtype_flag(self, dtype: str) -> str:
        return f"--kv-cache-dtype {dtype}"

    def weights_flag(self, fmt: str) -> str:
        return {"fp8": "an FP8 checkpoint (or --quantization fp8)", "int8": "an int8 W8A8 checkpoint",
                "int4": "an int4 AWQ/GPTQ checkpoint"}.get(fmt, f"{fmt} weights")

    def limit_flag(self, limit: int, batch: int) -> str:
        return f"--max-model-len {limit}"

    def concurrency_flag(self, batch: int) -> str:
        return f"--max-num-seqs {batch}"

    def tp_flag(self, tp: int) -> str:
        return f"--tensor-parallel-size {tp}"

    def pp_flag(self, pp: int) -> str | None:
        return f"--pipeline-parallel-size {pp}"

    def dp_attention_flag(self, gpus: int) -> str | None:
        """Data-parallel attention with expert parallel (docs: data_parallel_deployment, expert_parallel_deployment):
        each of the ``gpus`` ranks serves its own requests with the attention and dense layers whole, the
        routed experts spread over all ranks."""
        return f"--data-parallel-size {gpus} --enable-expert-parallel"

    def hybrid_manager(self, q: KVQuestion) -> bool:
        option = q.options.get("hybrid_kv_cache")
        if option is not None:
            return str(option).lower() not in ("0", "off", "false", "no")
        version = parse_version(q.version or self.version)
        return version >= (0, 10) and (q.device != "cpu" or version >= (0, 32))

    def stored(self, q: KVQuestion) -> KVGeometry:
        g = q.geometry
        if g.mla and g.model_type not in MLA_MODEL_TYPES:
            m = g.mla
            g = decompressed(g, v_head_dim=(m.qk_nope_head_dim or 0) + m.qk_rope_head_dim)
        kinds = {layer.kind for layer in g.kv_layers}
        if kinds & {"sliding", "chunked"} and "full" in kinds and not self.hybrid_manager(q):
            g = with_kinds(g, {"sliding": "full", "chunked": "full"})
        return g

    def prefix_reuse_unit(self, q: KVQuestion, details: dict | None = None) -> int | None:
        """Whole blocks (vllm/v1/core/kv_cache_manager.py: a hit is a run of full blocks whose hashes match)."""
        if details and details.get("block_size"):
            return int(details["block_size"])
        return self.block_size(q, self.stored(q))

    def block_size(self, q: KVQuestion, stored: KVGeometry) -> int:
        if q.block_size:
            return q.block_size
        if q.device == "cpu":  # vllm/platforms/cpu.py check_and_update_config (0.32.0)
            # MLA: the AMX_MLA backend where torch sees AMX tiles, which keeps the CPU default of 128;
            # the reference CPU MLA decode kernel compiles only for 16-token blocks
            return 128 if not stored.mla or "amx_tile" in q.cpu_features else 16
        return 16

    def check(self, q: KVQuestion) -> None:
        heads = q.geometry.num_attention_heads
        if q.tp > 1 and heads and heads % q.tp:
            raise KVRuleError(f"vllm: Total number of attention heads ({heads}) must be divisible by tensor "
                              f"parallel size ({q.tp})")
        if q.device == "cpu" and self.resolve_dtype(q).startswith("fp8"):
            self.check_cpu_fp8(q)
        super().check(q)

    def check_cpu_fp8(self, q: KVQuestion) -> None:
        """v1/attention/backends/cpu_attn.py _get_attn_isa (0.32.0), which fails the engine core's start: an
        fp8 KV cache on a CPU needs AVX-512 or AMX tiles (as torch sees them), and a head size that is a
        multiple of 32 where it is one of 16. ``cpu_features`` empty: the CPU is unknown, nothing refused."""
        heads = {layer.head_dim_k for layer in self.stored(q).kv_layers if layer.stores}
        if odd := sorted(h for h in heads if h % 32 and not h % 16):
            raise KVRuleError(f"vllm: FP8 KV cache requires head_size divisible by 32 on CPU (head size {odd[0]})")
        features = set(q.cpu_features)
        if features and not features & {"avx512f", "amx_tile"}:
            raise KVRuleError("vllm: FP8 KV cache on CPU requires x86 with AVX-512 or AMX; this CPU has neither "
                              "(flags: " + (" ".join(f for f in ("avx2", "avx512f", "amx_tile") if f in features)
                                            or "none of avx2, avx512f, amx_tile") + ")")

    def groups(self, stored: KVGeometry) -> tuple[list[tuple[str, int | None]], int]:
        """([(kind, span) per group], G layers per group), as _get_kv_cache_groups_uniform_page_size makes them."""
        buckets: dict[tuple, int] = {}
        for layer, n in stored.layer_counts.items():  # in the layers' order (a dict keeps the first seen)
            if layer.stores:
                key = (layer.kind, layer.span)
                buckets[key] = buckets.get(key, 0) + n
        if len(buckets) == 1 or {kind for kind, _ in buckets} == {"full"}:
            return [next(iter(buckets))], len(stored.kv_layers)
        sizes = list(buckets.values())
        g = min(sizes) if max(sizes) >= 1.5 * min(sizes) else max(sizes)
        return [key for key, n in buckets.items() for _ in range(cdiv(n, g))], g

    def page_bytes(self, stored: KVGeometry, dtype: str, block: int, tp: int) -> float:
        """One layer's block (the largest page, where layers differ: vLLM pads smaller pages up to it)."""
        return block * max(self.layer_bytes_per_token(stored, layer, dtype, tp) for layer in stored.layer_counts if layer.stores)

    def bytes_per_block(self, q: KVQuestion) -> float:
        stored = self.stored(q)
        _, g = self.groups(stored)
        return g * self.page_bytes(stored, self.resolve_dtype(q), self.block_size(q, stored), q.tp)

    @staticmethod
    def held_blocks(kind: str, span: int | None, tokens: int, block: int) -> int:
        """Blocks one sequence of ``tokens`` holds in a group of this kind."""
        blocks = cdiv(tokens, block)
        if kind == "sliding":  # blocks wholly before the window are freed (single_type_kv_cache_manager.py)
            return blocks - max(0, tokens - span + 1) // block
        if kind == "chunked":  # blocks wholly before the current chunk are freed
            return blocks - (tokens // span) * span // block
        return blocks

    def max_num_batched_tokens(self, q: KVQuestion, limit: int) -> int:
        """The server's --max-num-batched-tokens: ``q.options["max_num_batched_tokens"]`` where given, else
        vLLM 0.32's default for the OpenAI server (engine/arg_utils.py get_batch_defaults, 2895-2985, and
        _set_default_max_num_seqs_and_batched_tokens_args, 3095-3175):

        - a CPU: 2048 x the world size (arg_utils.py:2974-2978), the tensor-parallel size here;
        - a GPU by its memory (arg_utils.py:2922-2950): 16384 at 160 GiB or more (B200, B300), 8192 at
          70 GiB or more but not an A100 (H100, H200), else 2048. The question carries the GPU's compute
          capability, not its memory: 10.x is read as the 160 GiB row, 9.x as the H100/H200 row, any other
          (or none) as 2048; a GPU read wrongly takes the option.
        - then, with chunked prefill (vLLM's default), at most max_num_seqs x max_model_len
          (arg_utils.py:3165-3170). ``q.batch`` is taken as max_num_seqs (the plan's --max-num-seqs); any
          max_num_seqs >= 1 gives the same admission cap, since the cap is itself clamped to the limit.
        """
        option = q.options.get("max_num_batched_tokens")
        if option:
            return int(option)
        if q.device == "cpu":
            default = 2048 * max(1, q.tp)
        else:
            major = (q.capability or (8, 0))[0]
            default = 16384 if major == 10 else 8192 if major == 9 else 2048
        return min(max(1, q.batch) * limit, default)

    def max_in_flight_tokens(self, q: KVQuestion, limit: int) -> int:
        """config/vllm.py:577-598 max_in_flight_tokens: max_concurrent_batches x max_num_batched_tokens. One
        batch on a CPU (platforms/cpu.py:331 turns async scheduling off); two on a GPU, where async
        scheduling is on by default (config/vllm.py:1585-1644; max_concurrent_batches: 2 with it, pipeline
        parallel size 1)."""
        return (1 if q.device == "cpu" else 2) * self.max_num_batched_tokens(q, limit)

    @staticmethod
    def admission_blocks(kind: str, span: int | None, tokens: int, block: int, limit: int, in_flight: int) -> int:
        """Blocks one request of ``tokens`` takes at admission in a group of this kind, on a server started
        with a limit of ``limit`` tokens and ``in_flight`` tokens scheduled at most (:meth:`max_in_flight_tokens`).

        vLLM 0.32 admits a request by the most blocks it may hold, not by what it holds once blocks leave the
        window (:meth:`held_blocks`): a sliding group's cap is cdiv(min(window - 1 + in_flight, limit), block)
        + 1 (v1/kv_cache_interface.py SlidingWindowSpec.max_admission_blocks_per_request, 859-890), a chunked
        group's cdiv(min(chunk + in_flight, limit), block) (ChunkedLocalAttentionSpec, 813-830); a request
        reserves the smaller of its whole blocks and that cap (v1/core/single_type_kv_cache_manager.py:214-226).
        At the limit it is the cap itself: what vLLM sizes its pool by, checks one request against at start
        and logs as its maximum concurrency (max_memory_usage_bytes; kv_cache_utils.py
        get_max_concurrency_for_kv_cache_config). A full group takes every block."""
        blocks = cdiv(tokens, block)
        if kind == "sliding":
            cap = cdiv(min(span - 1 + in_flight, limit), block) + 1
        elif kind == "chunked":
            cap = cdiv(min(span + in_flight, limit), block)
        else:
            return blocks
        return cap if tokens >= limit else min(blocks, cap)

    def blocks_per_sequence(self, q: KVQuestion, tokens: int, limit: int | None = None) -> int:
        """Blocks one request of ``tokens`` takes in the pool at admission, every group (what sizes a pool and
        counts the requests it serves; :meth:`answer` counts the blocks held instead). ``limit``: the server's
        --max-model-len (None: ``tokens``, one request at the limit)."""
        stored = self.stored(q)
        block = self.block_size(q, stored)
        groups, _ = self.groups(stored)
        limit = limit or tokens
        in_flight = self.max_in_flight_tokens(q, limit)
        return sum(self.admission_blocks(kind, span, tokens, block, limit, in_flight) for kind, span in groups)

    def deployment(self, q: KVQuestion, limit: int) -> KVAnswer:
        """The pool one GPU needs for ``q.batch`` requests of ``q.context`` tokens on a server started with a
        limit of ``limit``: the blocks they take at admission (:meth:`blocks_per_sequence`), or one request at
        the limit (vLLM refuses to start without room for it), whichever is more, plus the null block."""
        self.check(q)
        typical, one = self.answer(q), self.answer(replace(q, context=limit, batch=1))
        per_block = self.bytes_per_block(q)
        batch = q.batch * self.blocks_per_sequence(q, q.context, max(limit, q.context))
        at_limit = self.blocks_per_sequence(q, limit, limit)
        admitted = ""
        if batch != q.batch * self.blocks_per_sequence_held(q, q.context) or at_limit != self.blocks_per_sequence_held(q, limit):
            admitted = "; sliding/chunked groups counted at vLLM's admission cap (window or chunk + batched tokens)"
        if limit > q.context and at_limit > batch:
            return replace(one, bytes_per_gpu=at_limit * per_block,
                           note=f"{one.note}{admitted}; one request at the {limit:,}-token limit (more than "
                                f"{q.batch} x {q.context:,})")
        return replace(typical, bytes_per_gpu=batch * per_block, note=typical.note + admitted)

    def blocks_per_sequence_held(self, q: KVQuestion, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` holds, every group (:meth:`held_blocks`: what :meth:`answer` counts)."""
        stored = self.stored(q)
        block = self.block_size(q, stored)
        groups, _ = self.groups(stored)
        return sum(self.held_blocks(kind, span, tokens, block) for kind, span in groups)

    def answer(self, q: KVQuestion) -> KVAnswer:
        self.check(q)
        stored, dtype = self.stored(q), self.resolve_dtype(q)
        block = self.block_size(q, stored)
        groups, g = self.groups(stored)
        per_block = g * self.page_bytes(stored, dtype, block, q.tp)  # bytes_per_block(q), from what is at hand
        held = [self.held_blocks(kind, span, q.context, block) for kind, span in groups]
        windowed = [h for (kind, _), h in zip(groups, held) if kind != "full"]
        note = f"whole blocks of {block} tokens per sequence, plus one null block per pool"
        if len(groups) > 1:
            note += (f"; hybrid manager: {len(groups)} groups of {g} layers, a block spans a group, blocks "
                     "outside a window or chunk freed")
        if stored.mla:
            note += "; MLA latent"
        elif q.geometry.mla:
            note += "; MLA decompressed (not one of vLLM's MLA model types)"
        if stored.layers != q.geometry.layers and not q.geometry.mla:
            note += "; windows not kept (no hybrid manager)"
        return KVAnswer(self.engine, dtype, q.batch * sum(held) * per_block, q.batch * cdiv(q.context, block) * block,
                        q.batch * windowed[0] * block if windowed else 0, self.bytes_per_token(q), note,
                        pool_extra_bytes=per_block)

    def sequences_in_pool(self, geometry: KVGeometry, pool_tokens: int, context: int, details: dict) -> int | None:
        block = int(details.get("block_size") or 16)
        blocks = int(details.get("num_gpu_blocks") or pool_tokens // block)
        options = {k: details[k] for k in ("hybrid_kv_cache", "max_num_batched_tokens") if details.get(k) is not None}
        q = KVQuestion(geometry, block_size=block, device=details.get("device", "gpu"), version=details.get("version"),
                       options=options, capability=details.get("capability"))
        limit = int(details.get("max_model_len") or context)  # the server's limit where the pool names it
        return max(0, blocks - 1) // self.blocks_per_sequence(q, context, max(limit, context))

    def pool_bytes_per_token(self, geometry: KVGeometry, dtype: str, details: dict) -> float:
        block = int(details.get("block_size") or 16)
        q = KVQuestion(geometry, dtype, block_size=block, device=details.get("device", "gpu"),
                       version=details.get("version"))
        return self.bytes_per_block(q) / block

    # --- speculative decoding (0.32.0: config/speculative.py, v1/spec_decode/, v1/core/kv_cache_utils.py) ---------
    SPEC_METHODS = {"ngram": "ngram", "draft": "draft_model", "eagle": "eagle", "mtp": "mtp"}

    def speculative_flag(self, spec) -> str | None:
        fields = [f'"method": "{self.SPEC_METHODS[spec.method]}"']
        if spec.method in ("draft", "eagle"):
            fields.append(f'"model": "{spec.draft_name or "HEAD"}"')
        fields.append(f'"num_speculative_tokens": {spec.tokens or "N"}')
        return "--speculative-config '{" + ", ".join(fields) + "}'"

    def draft_kv(self, q: KVQuestion, spec, limit: int) -> DraftKV:
        """The drafter's attention layers register in the same static forward context as the target's
        (v1/spec_decode/llm_base_proposer.py load_model: _draft_attn_layer_names), so get_kv_cache_spec gives them
        to the one pool: layers of one attention type form one KV cache group (UniformTypeKVCacheSpecs, whose page
        is the sum of its layers' pages: v1/kv_cache_interface.py), and validate_same_kv_cache_group requires the
        drafter's layers in the target's group. A block then holds every layer's page, drafter's included: the
        pool's tokens fall by target / (target + drafter) per token. The drafter's KV dtype is the target's
        cache dtype (SpeculativeConfig.kv_cache_dtype None) resolved for the drafter's own model."""
        if spec.method == "ngram":
            return ngram_kv("vLLM: v1/spec_decode/ngram_proposer.py, numpy on the host")
        dq = replace(q, geometry=spec.draft)
        stored = self.stored(q)
        block = self.block_size(q, stored)
        groups, _ = self.groups(stored)
        per_token = self.bytes_per_token(dq)
        deploy = self.deployment(q, limit)
        blocks = (deploy.bytes_per_gpu + deploy.pool_extra_bytes) / self.bytes_per_block(q)
        hybrid = len(groups) > 1
        note = (f"{spec.layers} drafter layer(s) in the target's KV cache group: each block holds their pages "
                f"beside the target's ({per_token * block:,.0f} B more per block of {block}; "
                "v1/core/kv_cache_utils.py get_kv_cache_groups, UniformTypeKVCacheSpecs); a decoding request also "
                f"holds up to {spec.tokens or 'N'} lookahead slots (num_lookahead_tokens)")
        if hybrid:
            note += ("; unverified: with a hybrid model's window groups the drafter's full layers regroup the pool, "
                     "priced here as pages added to every block")
        return DraftKV("the target's KV pool (the same blocks)", per_token, blocks * block * per_token, note,
                       verified=not hybrid)

    # --- its memory on a GPU at startup (gpumem.py) -------------------------------------------------------
    def startup_memory(self, q):
        return gpumem.startup_memory(self, q)

    def startup_refusal(self, q, mem, available: float, one_request: float, longest: int):
        return gpumem.startup_refusal(self, q, available, one_request, longest)
