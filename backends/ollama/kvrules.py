"""Ollama's KV rules: how it sizes, stores and rounds its cache. Imports only kvbench.kv."""
from __future__ import annotations

from ..shared.llama_server_kv import LlamaServerKV


class OllamaKV(LlamaServerKV):
    """Ollama runs llama.cpp's llama-server (since v0.30) with -np OLLAMA_NUM_PARALLEL and the cache type
    OLLAMA_KV_CACHE_TYPE, which takes f16, q8_0 or q4_0: llama.cpp's rules with those three types."""

    engine = "ollama"
    version = "0.30.0"
    dtypes = {"f16": "f16", "fp16": "f16", "float16": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}
    rule_options = {k: v for k, v in LlamaServerKV.rule_options.items() if k != "draft_kv_dtype"}  # no draft

    def kv_dtype_flag(self, dtype: str) -> str:
        return f"OLLAMA_KV_CACHE_TYPE={dtype} (with OLLAMA_FLASH_ATTENTION=1)"

    def weights_flag(self, fmt: str) -> str:
        return f"a {fmt} tag of the model"

    def limit_flag(self, limit: int, batch: int) -> str:
        return f"num_ctx {limit} with OLLAMA_NUM_PARALLEL={batch}"

    def concurrency_flag(self, batch: int) -> str:
        return f"OLLAMA_NUM_PARALLEL={batch}"

    def tp_flag(self, tp: int) -> str:
        return f"{tp} GPUs"

    # Ollama starts its runner without any of llama-server's speculative flags: no speculative decoding
    def speculative_flag(self, spec) -> str | None:
        return None

    def draft_kv(self, q, spec, limit: int):
        return None
