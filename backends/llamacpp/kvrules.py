"""llama.cpp's KV rules: llama-server's (backends/shared/llama_server_kv.py) at the version kvbench builds, and
the cases that check them against the engine. Imports only kvbench.kv and the shared rules."""
from __future__ import annotations

from ..shared.llama_server_kv import LlamaServerKV

# The embedded model's cases: (cache type, context, slots)
EMBEDDED_CASES = (("f16", 512, 1), ("f16", 4096, 2), ("q8_0", 1000, 1), ("q8_0", 4096, 1), ("q4_0", 2048, 1),
                  ("q4_0", 8192, 1))
FAMILY_CASE = (2048, 2)  # context per slot, slots: windows of 64 leave a window cache smaller than the slot


class LlamaCppKV(LlamaServerKV):
    """llama-server as built from the llama.cpp vendored in llama-cpp-python 0.3.36."""

    engine = "llamacpp"
    version = "0.3.36"
