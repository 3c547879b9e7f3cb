"""Hugging Face TGI's KV rules: how it sizes, stores and rounds its cache. Imports only kvbench.kv."""
from __future__ import annotations

from kvbench.kv.geometry import KVGeometry, LayerKV, decompressed, round_up
from kvbench.kv.rules import KVQuestion, KVRules, with_kinds


class TGIKV(KVRules):
    """TGI's paged KV cache (from its source and docs; no TGI server ran here): the pool is
    max_batch_total_tokens = blocks x BLOCK_SIZE, and a request reserves prompt + max_new_tokens (the
    ``context``) in whole blocks of 1 (flashinfer, the default), 16 (paged) or 256 (flashdecoding) on every
    layer: TGI keeps no sliding-window saving, and stores DeepSeek's MLA decompressed (every head, K of
    qk_nope + qk_rope, V of v_head_dim). fp8 only as e4m3fn / e5m2."""

    engine = "tgi"
    version = "3.3.5"
    has_blocks = True
    dtypes = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "f16": "fp16", "float16": "fp16",
              "fp8": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn", "fp8_e4m3fn": "fp8_e4m3fn", "fp8_e5m2": "fp8_e5m2"}

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
