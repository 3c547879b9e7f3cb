"""SGLang's KV rules: how it sizes, stores and rounds its token pool. Imports only kvbench.kv.

Read from SGLang 0.5.23 (the ``sglang`` wheel's own sources, pyproject version 0.5.23; file:line as in that
release). No SGLang server ran here (docs/engines.md says why): every rule below is the source's, checked
against hand-computed cases in tests/backends/sglang/test_adapter.py.
"""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from kvbench.kv.geometry import KVGeometry, LayerKV, cdiv, decompressed, round_up
from kvbench.kv.rules import Choice, KVAnswer, KVQuestion, KVRuleError, KVRules, Number, Switch, with_kinds
from kvbench.kv.speculative import DraftKV, ngram_kv

from . import gpumem
from .gpumem import auto_mem_fraction_static, prefill_graph_sizes  # noqa: F401  (their home before)

#: Model types SGLang runs with its MLA backend (configs/model_config.py _derive_model_shapes: the
#: architectures DeepseekV2/V3, Kimi K2 (DeepseekV3ForCausalLM), Glm4MoeLite, LongcatFlash, MiniCPM3, Dots3Note,
#: HYV4, MistralLarge3, GigaChat35): their pool is MLATokenToKVPool, one latent row per token and layer.
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite", "longcat_flash", "minicpm3",
                             "dots3_note", "hy_v4", "mistral_large_3", "gigachat35"})
#: DeepSeek's sparse attention (DSA) adds an indexer key cache to every token (DSATokenToKVPool): not modelled.
DSA_MODEL_TYPES = frozenset({"deepseek_v32", "glm_moe_dsa", "glm5_next"})
#: Model types whose architecture is in configs/model_config.py is_hybrid_swa_model (GptOss, Llama4ForConditional-
#: Generation, Gemma4, Step3p5, MiMoV2, ...): full and sliding layers get separate pools. Gemma 2 and 3 are not:
#: arg_groups/model_overrides/gemma2_gemma3.py sets disable_hybrid_swa_memory ("not yet supported"), so their
#: sliding layers keep every token, as do Mistral's.
HYBRID_SWA_MODEL_TYPES = frozenset({"gpt_oss", "llama4", "llama4_text", "gemma4", "gemma4_text", "step3p5",
                                    "mimo_v2_flash"})
#: arg_groups/fields/schedule.py swa_full_tokens_ratio: "fallback=0.8".
SWA_FULL_TOKENS_RATIO = 0.8
#: environ.py SGLANG_SWA_EVICTION_INTERVAL = EnvInt(128): SWA tokens outside the window are freed this often.
SWA_EVICTION_INTERVAL = 128
#: Attention backends that force a page size (arg_groups/overrides.py _mla_backend_page_constraints,
#: _intel_xpu_page_constraint): backend -> (page sizes it takes, the page it changes any other to).
PAGE_CONSTRAINTS = {"flashmla": ((64,), 64), "trtllm_mla": ((32, 64), 64), "cutedsl_mla": ((32, 64), 64),
                    "trtllm_mha": ((16, 32, 64, 128), 64), "hpc_ops": ((64,), 64), "intel_xpu": ((64, 128), 128)}
class SGLangKV(KVRules):
    """SGLang's token pool (0.5.23; see the module docstring for the files read).

    - Sizing (model_executor/pool_configurator.py DefaultPoolConfigurator.calculate_pool_sizes 637-647):
      ``max_total_num_tokens = budget // cell_size``, rounded down to whole pages; ``--max-total-tokens`` only
      lowers it (kv_cache_configurator.py _apply_token_constraints). cell_size = every KV layer's
      kv_heads_per_gpu x (head_dim + v_head_dim) x dtype bytes (_compute_cell_size 340-535; heads per GPU
      max(1, heads // tp), configs/model_config.py get_num_kv_heads).
    - Buffers (mem_cache/memory_pool.py MHATokenToKVPool._kv_buffer_shapes 2567-2578, MLATokenToKVPool
      _create_buffers 4856-4872): each layer holds ``size + page_size`` rows, the extra page a padding slot
      that absorbs dummy writes; logged as ``KV Cache is allocated. dtype: ..., #tokens: N, K size: X GB,
      V size: Y GB`` (X, Y in GiB, ``KV size`` for MLA; _finalize_allocation_log 2073-2100).
    - Pages: ``--page-size`` defaults to 1 (arg_groups/overrides.py _page_size_default 1341-1363); the
      attention backend forces others (:data:`PAGE_CONSTRAINTS`), and on SM100 (compute capability 10.x)
      SGLang's default backend for MHA is trtllm_mha (page 64), or fa4 (page 128) where K and V widths
      differ (model_override_base.py get_default_attn_backend). A sequence holds whole pages.
    - MLA (:data:`MLA_MODEL_TYPES`): one latent of kv_lora_rank + qk_rope_head_dim per token and layer, no
      V, on every tensor-parallel rank (calculate_mla_kv_cache_dim).
    - Hybrid sliding-window models (:data:`HYBRID_SWA_MODEL_TYPES`): a full pool and an SWA pool
      (HybridSWAPoolConfigurator 656-922): cell = full layers' bytes + swa_full_tokens_ratio (0.8) x SWA
      layers' bytes; full pool = budget // cell pages, SWA pool = full x ratio, each rounded down to pages.
      A request is admitted to the SWA pool for min(its tokens, window) + one page (validate_swa_pool_size),
      and keeps at most window + SGLANG_SWA_EVICTION_INTERVAL (128) + a page there (compute_swa_request_cap).
      Chunked layers of Llama 4 are its SWA layers (get_hybrid_layer_ids). Every other model with a window
      keeps every token on every layer.
    - KV dtype (mem_cache/kv_cache_dtype.py configure_kv_cache_dtype): ``auto`` is the model dtype, except a
      ModelOpt/FP8 checkpoint whose kv_cache_quant_algo is FP8 (fp8_e4m3). fp8_e4m3 / fp8_e5m2 store one byte
      (as uint8). The model dtype, ``--dtype auto`` (configs/model_config.py _get_and_verify_dtype): the
      config's; a float32 (or unnamed) config in float16, bfloat16 for Gemma; GPT-OSS's MXFP4 checkpoints
      in bfloat16 (arg_groups/model_overrides/gpt_oss.py).
    """

    engine = "sglang"
    version = "0.5.23"
    has_blocks = True  # pages (KVQuestion.block_size is --page-size)
    pool_from_budget = True
    fraction_option = "mem_fraction_static"
    # sglang:kv_used_tokens counts the pages the running requests hold, which is what answer() counts
    answer_is_in_use = True
    # --attention-backend's choices (0.5.23 arg_groups/choices.py:69-99 ATTENTION_BACKEND_CHOICES); the SWA ratio's
    # range is SGLang's check (arg_groups/kv_cache_hook.py:427); mem_fraction_static, which SGLang does not
    # range-check, is a fraction of the GPU's memory that must leave some for activations
    rule_options = {
        "attention_backend": Choice(("triton", "torch_native", "flex_attention", "dsa", "nsa", "qsa", "dsv4", "compressed",
                                     "fa3", "fa4", "flashinfer", "llada2_cfg_flashinfer", "flashmla", "trtllm_mla",
                                     "cutedsl_mla", "tokenspeed_mla", "trtllm_mha", "hpc_ops", "minicpm_flashattn",
                                     "minicpm_flashinfer", "aiter", "wave", "intel_amx", "ascend", "intel_xpu")),
        "swa_full_tokens_ratio": Number(0, 1), "disable_hybrid_swa_memory": Switch(),
        "mem_fraction_static": Number(0, 1, high_open=True)}
    # kvbench's names -> SGLang's KV dtype; fp16 and fp32 are the model dtype (--dtype), which auto KV takes
    dtypes = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "f16": "fp16",
              "fp32": "fp32", "float32": "fp32", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
              "fp8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
    kv_lever_dtypes = ("fp8",)
    weight_formats: ClassVar[dict[str, float]] = {"fp8": 1.0, "int8": 1.0, "int4": 0.5}

    # --- dtypes -----------------------------------------------------------------------------------
    def serving_dtype(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        if geometry.model_type == "gpt_oss" and "quant_method=mxfp4" in geometry.flags:
            return "bf16"
        config = geometry.dtype or "fp32"
        if config == "fp32":
            return "bf16" if geometry.model_type.startswith("gemma") else "fp16"
        return config

    def serving_note(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        served = self.serving_dtype(geometry, capability)
        named = geometry.dtype or "none (float32 assumed)"
        if named == served:
            return f"SGLang --dtype auto: the config's {served}"
        return f"SGLang --dtype auto: the config's {named} served in {served}"

    def checkpoint_kv_dtype(self, geometry: KVGeometry) -> str | None:
        method = next((f.split("=", 1)[1] for f in geometry.flags if f.startswith("quant_method=")), "")
        fp8_config = method.startswith("modelopt") or method == "fp8"
        return "fp8_e4m3" if fp8_config and "kv_cache_fp8" in geometry.flags else None

    # --- flags ------------------------------------------------------------------------------------
    def kv_dtype_flag(self, dtype: str) -> str:
        kv = self.dtypes.get(dtype, dtype)
        return f"--kv-cache-dtype {kv}" if kv.startswith("fp8") else f"--dtype {kv}"

    def weights_flag(self, fmt: str) -> str:
        return {"fp8": "an FP8 checkpoint (or --quantization fp8)", "int8": "an int8 W8A8 checkpoint",
                "int4": "an int4 AWQ/GPTQ checkpoint"}.get(fmt, f"{fmt} weights")

    def limit_flag(self, limit: int, batch: int) -> str:
        return f"--context-length {limit}"

    def concurrency_flag(self, batch: int) -> str:
        return f"--max-running-requests {batch}"

    def tp_flag(self, tp: int) -> str:
        return f"--tp-size {tp}"

    def pp_flag(self, pp: int) -> str | None:
        return f"--pp-size {pp}"

    def dp_attention_flag(self, gpus: int) -> str | None:
        """DP attention (docs: advanced_features/dp_dpa_smg_guide): attention data-parallel over the ``gpus``
        ranks of a tensor-parallel group of the same size, each holding the KV of its own requests; the FFN
        tensor- (or expert-) parallel over all of them."""
        return f"--tp-size {gpus} --dp-size {gpus} --enable-dp-attention"

    # --- what it stores ---------------------------------------------------------------------------
    def hybrid(self, q: KVQuestion) -> bool:
        """Whether SGLang gives the sliding (or chunked) layers a pool of their own."""
        if str(q.options.get("disable_hybrid_swa_memory") or "").lower() in ("1", "true", "yes", "on"):
            return False
        kinds = {layer.kind for layer in q.geometry.kv_layers}
        return q.geometry.model_type in HYBRID_SWA_MODEL_TYPES and bool(kinds & {"sliding", "chunked"})

    def stored(self, q: KVQuestion) -> KVGeometry:
        g = q.geometry
        if g.mla and g.model_type not in MLA_MODEL_TYPES:
            g = decompressed(g)  # MHATokenToKVPool with the config's head dims
        if not self.hybrid(q):
            g = with_kinds(g, {"sliding": "full", "chunked": "full"})
        return g

    def check(self, q: KVQuestion) -> None:
        if q.geometry.model_type in DSA_MODEL_TYPES:
            raise KVRuleError(f"sglang: {q.geometry.model_type}'s DSA indexer cache (DSATokenToKVPool) is not "
                              "modelled by kvbench's SGLang rules")
        ratio = self.swa_ratio(q)
        if not 0 < ratio <= 1:
            raise KVRuleError(f"sglang: swa_full_tokens_ratio must be in (0, 1], not {ratio}")
        super().check(q)

    def swa_ratio(self, q: KVQuestion) -> float:
        value = q.options.get("swa_full_tokens_ratio")
        return SWA_FULL_TOKENS_RATIO if value in (None, "") else float(value)

    def page_size(self, q: KVQuestion) -> int:
        """--page-size as SGLang resolves it for this question (see the class docstring)."""
        stored = self.stored(q)
        backend = q.options.get("attention_backend")
        sm100 = q.device == "gpu" and q.capability is not None and q.capability[0] == 10
        if backend is None and sm100 and stored.mla is None:
            asymmetric = any(layer.head_dim_k != layer.head_dim_v for layer in stored.kv_layers)
            backend = "fa4" if asymmetric else "trtllm_mha"
        page = q.block_size or 1
        if backend == "fa4" and sm100 and stored.mla is None:
            return 128  # _fa4_page_constraint
        if backend in PAGE_CONSTRAINTS:
            allowed, forced = PAGE_CONSTRAINTS[backend]
            return page if page in allowed else forced
        return page

    def cells(self, q: KVQuestion) -> tuple[float, float]:
        """(bytes per token of the full pool's layers, of the SWA pool's layers) on one GPU; (all, 0) for a
        model without an SWA pool."""
        stored, dtype = self.stored(q), self.resolve_dtype(q)
        full = swa = 0.0
        for layer in stored.kv_layers:
            b = self.layer_bytes_per_token(stored, layer, dtype, q.tp)
            if layer.kind in ("sliding", "chunked"):
                swa += b
            else:
                full += b
        return full, swa

    def cell_size(self, q: KVQuestion) -> float:
        """Bytes of the budget one token of max_total_num_tokens takes (the full pool's token, with its share
        of the SWA pool in a hybrid model)."""
        full, swa = self.cells(q)
        return full + self.swa_ratio(q) * swa if swa else full

    def bytes_per_block(self, q: KVQuestion) -> float:
        return self.page_size(q) * self.cell_size(q)

    def blocks_per_sequence(self, q: KVQuestion, tokens: int, limit: int | None = None) -> int:
        """Pages one request of ``tokens`` holds in the full pool."""
        return cdiv(tokens, self.page_size(q))

    def max_total_num_tokens(self, q: KVQuestion, budget_bytes: float) -> int:
        """The full pool SGLang makes of a KV budget in bytes (calculate_pool_sizes)."""
        page = self.page_size(q)
        return int(budget_bytes // self.cell_size(q)) // page * page

    def swa_tokens(self, q: KVQuestion, full_tokens: int) -> int:
        """The SWA pool beside a full pool of ``full_tokens`` (HybridSWAPoolConfigurator._solve_pool_sizes)."""
        page = self.page_size(q)
        return int(full_tokens * self.swa_ratio(q)) // page * page

    @staticmethod
    def window(stored: KVGeometry) -> int | None:
        spans = [layer.span for layer in stored.kv_layers if layer.kind in ("sliding", "chunked") and layer.span]
        return max(spans) if spans else None

    def tokens_kept(self, layer: LayerKV, tokens: int, q: KVQuestion) -> int:
        if not layer.stores:
            return 0
        page = self.page_size(q)
        whole = round_up(tokens, page)
        if layer.kind in ("sliding", "chunked") and layer.span:
            return min(whole, layer.span + SWA_EVICTION_INTERVAL + page)
        return whole

    def answer(self, q: KVQuestion) -> KVAnswer:
        a = super().answer(q)
        page = self.page_size(q)
        full, swa = self.cells(q)
        stored = self.stored(q)
        note = f"whole pages of {page} token{'s' if page > 1 else ''}, plus one padding page per pool"
        if swa:
            note += (f"; hybrid SWA: a full pool and an SWA pool of {self.swa_ratio(q):g} x its tokens, at most "
                     f"window + {SWA_EVICTION_INTERVAL} + a page kept on the sliding layers")
        elif q.geometry.count("sliding") or q.geometry.count("chunked"):
            note += "; windows not kept (no hybrid SWA pool for this model)"
        if stored.mla:
            note += "; MLA latent"
        elif q.geometry.mla:
            note += "; MLA decompressed (not one of SGLang's MLA architectures)"
        return KVAnswer(a.engine, a.dtype, a.bytes_per_gpu, a.tokens_full, a.tokens_windowed, a.bytes_per_token,
                        note, pool_extra_bytes=page * (full + swa))

    # --- a pool the engine reports ----------------------------------------------------------------
    def _pool_question(self, geometry: KVGeometry, dtype: str, details: dict) -> KVQuestion:
        options = {k: details[k] for k in self.rule_options if details.get(k) is not None}
        return KVQuestion(geometry, dtype, block_size=int(details.get("page_size") or 1),
                          tp=int(details.get("tp") or 1),
                          device=details.get("device", "gpu"), options=options)

    def sequences_in_pool(self, geometry: KVGeometry, pool_tokens: int, context: int, details: dict) -> int | None:
        """Requests of ``context`` tokens the pools hold at once: whole pages of the full pool each, and in a
        hybrid model the SWA pool's admission charge of min(context, window) + a page each."""
        q = self._pool_question(geometry, details.get("dtype") or "auto", details)
        page = self.page_size(q)
        fits = pool_tokens // round_up(context, page)
        stored = self.stored(q)
        window = self.window(stored) if self.cells(q)[1] else None
        if window:
            swa = details.get("swa_tokens")
            swa = int(swa) if swa is not None else self.swa_tokens(q, pool_tokens)
            fits = min(fits, swa // (min(context, window) + page))
        return fits

    def pool_bytes_per_token(self, geometry: KVGeometry, dtype: str, details: dict) -> float:
        """Bytes of the pools per token of max_total_num_tokens: where the details give the token counts,
        the buffers as allocated (tokens + a padding page per pool, SWA pool's own size); else cell_size."""
        q = self._pool_question(geometry, dtype, details)
        tokens = details.get("max_total_num_tokens")
        if not tokens:
            return self.cell_size(q)
        page, (full, swa) = self.page_size(q), self.cells(q)
        swa_tokens = details.get("swa_tokens")
        swa_tokens = int(swa_tokens) if swa_tokens is not None else self.swa_tokens(q, int(tokens))
        physical = (int(tokens) + page) * full + ((swa_tokens + page) * swa if swa else 0)
        return physical / int(tokens)

    # --- its memory on a GPU at startup (gpumem.py) -------------------------------------------------------
    def startup_memory(self, q):
        return gpumem.startup_memory(self, q)

    # --- speculative decoding (0.5.23: arg_groups/fields/spec.py, model_executor/pool_configurator.py) -----------
    SPEC_ALGORITHMS = {"ngram": "NGRAM", "draft": "STANDALONE", "eagle": "EAGLE", "mtp": "NEXTN"}

    def speculative_flag(self, spec) -> str | None:
        flag = f"--speculative-algorithm {self.SPEC_ALGORITHMS[spec.method]}"
        if spec.method in ("draft", "eagle"):
            flag += f" --speculative-draft-model-path {spec.draft_name or 'HEAD'}"
        return flag + (f" --speculative-num-draft-tokens {spec.tokens}" if spec.tokens else "")

    def draft_kv(self, q: KVQuestion, spec, limit: int) -> DraftKV:
        """Read, not run (no SGLang server runs here). The draft worker gets a pool of its own with the target's
        token count (kv_cache_configurator.py configure: a draft worker takes the target's memory_pool_config)
        in the drafter's own geometry; the target sizes its pool by pricing the drafter's layers at the target's
        per-layer KV: cell_size x (1 + draft layers / target layers) (pool_configurator.py DefaultPoolConfigurator,
        "assumes the draft shares the target's per-layer KV size", eagle_draft_num_layers from
        spec_aux_hidden_state.py: num_nextn_predict_layers, else the draft's num_hidden_layers). A drafter whose
        layers hold more than the target's each takes the rest from outside the budget."""
        if spec.method == "ngram":
            return ngram_kv("SGLang: speculative/ngram_worker.py, a host-side n-gram cache")
        layers = max(1, self.stored(q).num_layers)
        priced = self.cell_size(q) * spec.layers / layers
        held = self.bytes_per_token(replace(q, geometry=spec.draft))
        deploy = self.deployment(q, limit)
        tokens = (deploy.bytes_per_gpu + deploy.pool_extra_bytes) / self.cell_size(q)
        note = (f"the draft worker's own pool of the target's tokens, {held:,.0f} B per token as its "
                f"{spec.layers} layer(s) hold it; the target's pool prices them at the target's per-layer KV, "
                f"{priced:,.0f} B per token (pool_configurator.py: cell_size x (1 + {spec.layers} / {layers})); "
                "unverified: read from SGLang 0.5.23's source, no SGLang server ran here")
        return DraftKV("its own pool of the target's token count", held, tokens * held, note, verified=False,
                       priced_per_token=priced)

    def startup_refusal(self, q, mem, available: float, one_request: float, longest: int):
        return gpumem.startup_refusal(self, q, available, one_request, longest)

