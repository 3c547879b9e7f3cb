"""transformers' KV rules: how it sizes, stores and rounds its cache. Imports only kvbench.kv."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from kvbench.kv.geometry import KVGeometry, LayerKV, decompressed, dtype_bytes
from kvbench.kv.rules import KVAnswer, KVQuestion, KVRuleError, KVRules, Whole, parse_version


@dataclass(frozen=True)
class QuantizedKV:
    """One of transformers' QuantizedCache settings (cache_implementation="quantized"), as the worker builds it:
    ``QuantizedCache(backend, config, nbits, q_group_size, residual_length)``, axis 0 for keys and values."""

    backend: str  # "quanto" (optimum-quanto)
    nbits: int  # 4 or 2
    q_group_size: int = 64
    residual_length: int = 128

    def cache_config(self) -> dict:
        """generate's cache_config for the same cache (cache_implementation="quantized")."""
        return {"backend": self.backend, "nbits": self.nbits, "q_group_size": self.q_group_size,
                "residual_length": self.residual_length}


#: The quantised KV dtypes the hf backend offers: transformers' QuantizedCache over optimum-quanto (the hf
#: recipe installs it). Group 64 (transformers' default): quanto needs heads x tokens x head_dim divisible by
#: it, which head_dim 64 or 128 gives for any token count; 128 would refuse odd token counts at head_dim 64.
QUANTIZED: dict[str, QuantizedKV] = {"quanto-int4": QuantizedKV("quanto", 4), "quanto-int2": QuantizedKV("quanto", 2)}


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
    #: `kvbench plan --engine-option decoded_tokens=N`: of each sequence's cached tokens, the last N were decoded
    #: one at a time (a quantised cache keeps N mod residual_length of them unquantised); the runner passes
    #: output - 1. Default 0: the whole context prefilled.
    rule_options = {"decoded_tokens": Whole(0)}
    answer_is_in_use = True  # the cache tensors a load holds: what the worker measures
    dtypes = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "f16": "fp16",
              "fp32": "fp32", "float32": "fp32", "f32": "fp32", **{name: name for name in QUANTIZED}}

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
        if dtype in QUANTIZED:
            return f'cache_implementation="quantized", cache_config={QUANTIZED[dtype].cache_config()}'
        return f"dtype={dtype}"

    # --- transformers' QuantizedCache (quanto) --------------------------------------------------------------
    def quantised_kv_dtypes(self) -> list[str]:
        return list(QUANTIZED)

    def compute_dtype(self, q: KVQuestion) -> str:
        """The dtype a quantised cache's model runs in, its residual tokens and its scales and shifts are
        held in: the baseline's (the model's serving dtype), as the worker loads the model in it."""
        return self.serving_dtype(q.geometry, q.capability)

    def quantized_layer_bytes(self, layer: LayerKV, tokens: int, batch: int, decoded: int, setting: QuantizedKV,
                              element: float) -> float:
        """Bytes one QuantizedLayer holds for ``batch`` sequences of ``tokens`` cached tokens, the last ``decoded``
        of them fed one at a time after the prompt's prefill; read from transformers 5.24's cache_utils.py
        (QuantizedLayer.update, QuantoQuantizedLayer._quantize) and optimum-quanto 0.2.7 (MaxOptimizer,
        tensor/grouped.py, tensor/packed.py, WeightQBitsTensor):

        - the prompt's states are quantised whole on the first update; each decoded token then joins the
          residual (the model's dtype) until the residual would reach ``residual_length``, when every state is
          quantised again and the residual emptied: ``decoded mod residual_length`` tokens sit in the residual;
        - keys and values [batch, kv_heads, T, head_dim] each: quanto groups them (axis 0) into
          ``G = batch x kv_heads x T x head_dim / q_group_size`` rows of ``q_group_size`` values, packs the
          rows of nbits-bit codes 8 / nbits rows to a uint8 row (``ceil(G x nbits / 8)`` rows of
          ``q_group_size`` bytes) and keeps a scale and a shift per row in the model's dtype (2 x G values).
        """
        residual = min(tokens, decoded % setting.residual_length)
        quantised = tokens - residual
        out = 0.0
        for head_dim in (layer.head_dim_k, layer.head_dim_v):
            values = batch * layer.kv_heads * quantised * head_dim
            if values % setting.q_group_size:
                raise KVRuleError(f"quanto's groups of {setting.q_group_size} do not divide {values:,} values "
                                  f"(kv_heads x tokens x head_dim {head_dim}): transformers refuses the cache")
            rows = values // setting.q_group_size
            out += math.ceil(rows * setting.nbits / 8) * setting.q_group_size + 2 * rows * element
            out += batch * layer.kv_heads * residual * head_dim * element
        return out

    def check_quantized(self, q: KVQuestion) -> None:
        stored = self.stored(q)
        if stored.mla or any(layer.kind != "full" for layer in stored.layers):
            raise KVRuleError("transformers' QuantizedCache takes models of full-attention layers only "
                              "(cache_utils.py QuantizedCache refuses other layer types)")

    def layer_bytes_per_token(self, stored: KVGeometry, layer: LayerKV, dtype: str, tp: int) -> float:
        setting = QUANTIZED.get(dtype)
        if setting is None:
            return super().layer_bytes_per_token(stored, layer, dtype, tp)
        # per token, long run: the nbits codes and a scale and a shift per group (the residual not counted)
        element = dtype_bytes(self.serving_dtype(stored))  # the scales' and shifts' dtype
        per_value = setting.nbits / 8 + 2 * element / setting.q_group_size
        return layer.kv_heads // max(1, tp) * (layer.head_dim_k + layer.head_dim_v) * per_value

    def answer(self, q: KVQuestion) -> KVAnswer:
        dtype = self.resolve_dtype(q)
        setting = QUANTIZED.get(dtype)
        if setting is None:
            return super().answer(q)
        self.check(q)
        self.check_quantized(q)
        if q.tp != 1:
            raise KVRuleError("transformers' QuantizedCache is not planned over several GPUs")
        stored = self.stored(q)
        element = dtype_bytes(self.compute_dtype(q))
        decoded = int(q.options.get("decoded_tokens", 0))
        total = sum(self.quantized_layer_bytes(layer, q.context, q.batch, decoded, setting, element)
                    for layer in stored.layers if layer.stores)
        return KVAnswer(self.engine, dtype, total, q.batch * q.context, 0, self.bytes_per_token(q),
                        f"QuantizedCache ({setting.backend} int{setting.nbits}, groups of {setting.q_group_size}, "
                        f"residual {setting.residual_length}): packed codes + a scale and shift per group, "
                        f"{min(q.context, decoded % setting.residual_length)} tokens in the residual")
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
