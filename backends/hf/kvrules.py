"""transformers' KV rules: how it sizes, stores and rounds its cache. Imports only kvbench.kv."""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from kvbench.kv.geometry import KVGeometry, LayerKV, decompressed
from kvbench.kv.rules import KVQuestion, KVRules, parse_version


class TransformersKV(KVRules):
    """transformers' DynamicCache, as ``generate`` fills it (transformers 5.24 read; cache_utils.py and the
    model files): exactly the tokens cached, no pool.

    - sliding and chunked layers keep their last window - 1 (chunk - 1) tokens (DynamicSlidingWindowLayer);
    - MLA (DeepSeek-V2/V3, MiniCPM3, ...): the latent, keys of kv_lora_rank and values of qk_rope_head_dim,
      since 5.20; decompressed heads before;
    - Falcon with new_decoder_architecture broadcasts its KV heads to every query head before caching
      (modeling_falcon.py, _split_heads); multi_query caches one head.
    """

    engine = "hf"
    no_pool_label = "no pool (static batching)"
    pool_at_start = False
    version = "5.24.0"
    answer_is_in_use = True  # the cache tensors a load holds: what the worker measures
    dtypes = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "f16": "fp16",
              "fp32": "fp32", "float32": "fp32", "f32": "fp32"}

    def serving_dtype(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        """from_pretrained's dtype defaults to "auto" in transformers 5 (modeling_utils.py): the config's
        dtype, float32 included; a config naming none takes its weights' dtype (bf16 assumed here)."""
        return {"fp32": "fp32", "fp16": "fp16"}.get(geometry.dtype or "", "bf16")

    def serving_note(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        if geometry.dtype:
            return f"transformers dtype=\"auto\": the config's {geometry.dtype}"
        return "transformers dtype=\"auto\": the config names none (the weights' dtype; bf16 assumed)"

    weight_formats: ClassVar[dict[str, float]] = {"int8": 1.0, "int4": 0.5}  # bitsandbytes load_in_8bit / load_in_4bit

    def kv_dtype_flag(self, dtype: str) -> str:
        return f"dtype={dtype}"

    def weights_flag(self, fmt: str) -> str:
        return {"int8": "BitsAndBytesConfig(load_in_8bit=True)", "int4": "BitsAndBytesConfig(load_in_4bit=True)"}.get(fmt, fmt)

    def limit_flag(self, limit: int, batch: int) -> str:
        return f"max_length={limit}"

    def concurrency_flag(self, batch: int) -> str:
        return f"a batch of {batch}"

    def tp_flag(self, tp: int) -> str:
        return f"tp_plan=\"auto\" over {tp} GPUs"

    def stored(self, q: KVQuestion) -> KVGeometry:
        g = q.geometry
        if g.mla and parse_version(q.version or self.version) < (5, 20):
            return decompressed(g)
        if "new_decoder_architecture" in g.flags and g.num_attention_heads:
            return replace(g, layers=tuple(replace(layer, kv_heads=g.num_attention_heads) if layer.stores else layer
                                           for layer in g.layers))
        return g

    def tokens_kept(self, layer: LayerKV, tokens: int, q: KVQuestion) -> int:
        if layer.kind in ("sliding", "chunked") and layer.span:
            return min(tokens, layer.span - 1)
        return tokens if layer.stores else 0

    def note(self, q: KVQuestion, stored: KVGeometry) -> str:
        parts = ["DynamicCache: exact tokens, sliding/chunked layers keep window - 1"]
        if stored.mla:
            parts.append("MLA latent")
        elif q.geometry.mla:
            parts.append("MLA decompressed (before transformers 5.20)")
        if stored is not q.geometry and not q.geometry.mla:
            parts.append("KV heads broadcast to every query head (Falcon new_decoder_architecture)")
        return "; ".join(parts)
