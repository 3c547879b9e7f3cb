"""Hugging Face TGI's KV rules: how it sizes, stores and rounds its cache. Imports only kvbench.kv."""
from __future__ import annotations

from typing import ClassVar

from kvbench.kv.geometry import KVGeometry, LayerKV, decompressed, round_up
from kvbench.kv.rules import KVQuestion, KVRules, Number, Whole, with_kinds

from . import gpumem

# server/text_generation_server/models/__init__.py get_model (main, Jan 2026): these model types' flash
# classes pass default_dtype=torch.bfloat16 (Llama 4 dtype=torch.bfloat16); FlashCausalLM's default is
# torch.float16, whatever the config's torch_dtype says
BF16_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "gemma", "gemma2", "gemma3", "gemma3_text", "dbrx",
                              "qwen2_vl", "qwen2_5_vl", "mllama", "idefics3", "paligemma", "llama4", "llama4_text"})
FP16_QUANTISERS = ("awq", "exl2", "gptq", "marlin")  # "These quantizers only work with float16 params."


class TGIKV(KVRules):
    """TGI's paged KV cache (from its source and docs; no TGI server ran here): the pool is
    max_batch_total_tokens = blocks x BLOCK_SIZE, and a request reserves prompt + max_new_tokens (the
    ``context``) in whole blocks of 1 (flashinfer, the default), 16 (paged) or 256 (flashdecoding) on every
    layer: TGI keeps no sliding-window saving, and stores DeepSeek's MLA decompressed (every head, K of
    qk_nope + qk_rope, V of v_head_dim). fp8 only as e4m3fn / e5m2."""

    engine = "tgi"
    fraction_option = "cuda_memory_fraction"
    version = "3.3.5"
    rule_options = {"cuda_memory_fraction": Number(0, 1), "max_batch_prefill_tokens": Whole()}  # a fraction of the GPU
    has_blocks = True
    dtypes = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "f16": "fp16", "float16": "fp16",
              "fp8": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn", "fp8_e4m3fn": "fp8_e4m3fn", "fp8_e5m2": "fp8_e5m2"}

    def serving_dtype(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        """No --dtype: float16 for the AWQ/GPTQ/EXL2/Marlin quantisers, else each model's default_dtype
        (bfloat16 for :data:`BF16_MODEL_TYPES`, float16 for the rest); the KV takes it (kv_cache_dtype = dtype)."""
        method = next((f.split("=", 1)[1] for f in geometry.flags if f.startswith("quant_method=")), "")
        if method in FP16_QUANTISERS:
            return "fp16"
        return "bf16" if geometry.model_type in BF16_MODEL_TYPES else "fp16"

    def serving_note(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        served = self.serving_dtype(geometry, capability)
        return (f"TGI without --dtype: {served}, its default for {geometry.model_type or 'this model type'} "
                f"(the config's {geometry.dtype or 'none'} is not read)")

    def checkpoint_kv_dtype(self, geometry: KVGeometry) -> str | None:
        """A compressed-tensors checkpoint whose kv_cache_scheme is 8-bit float gets fp8_e4m3fn (on CUDA
        with flashinfer, TGI's default attention)."""
        method = next((f.split("=", 1)[1] for f in geometry.flags if f.startswith("quant_method=")), "")
        return "fp8_e4m3fn" if method == "compressed-tensors" and "kv_cache_fp8" in geometry.flags else None

    kv_lever_dtypes = ("fp8",)
    weight_formats: ClassVar[dict[str, float]] = {"fp8": 1.0, "int8": 1.0, "int4": 0.5}

    def kv_dtype_flag(self, dtype: str) -> str:
        return f"--kv-cache-dtype {self.dtypes.get(dtype, dtype)}"

    def weights_flag(self, fmt: str) -> str:
        return {"fp8": "--quantize fp8", "int8": "--quantize eetq", "int4": "an AWQ/GPTQ checkpoint"}.get(fmt, fmt)

    def limit_flag(self, limit: int, batch: int) -> str:
        return f"--max-total-tokens {limit}"

    def concurrency_flag(self, batch: int) -> str:
        return f"--max-concurrent-requests {batch}"

    def tp_flag(self, tp: int) -> str:
        return f"--num-shard {tp}"

    def stored(self, q: KVQuestion) -> KVGeometry:
        return with_kinds(decompressed(q.geometry), {"sliding": "full", "chunked": "full"})

    def block_size(self, q: KVQuestion) -> int:
        return q.block_size or 1

    def tokens_kept(self, layer: LayerKV, tokens: int, q: KVQuestion) -> int:
        return round_up(tokens, self.block_size(q)) if layer.stores else 0

    def note(self, q: KVQuestion, stored: KVGeometry) -> str:
        return (f"blocks of {self.block_size(q)} tokens for prompt + max_new_tokens; "
                + ("DeepSeek stored decompressed" if q.geometry.mla else "no sliding-window saving"))

    def sequences_in_pool(self, geometry: KVGeometry, pool_tokens: int, context: int, details: dict) -> int | None:
        return pool_tokens // round_up(context, int(details.get("block_size") or 1))

    # --- its memory on a GPU at startup (gpumem.py) -------------------------------------------------------
    def startup_memory(self, q):
        return gpumem.startup_memory(self, q)

