"""KV-cache arithmetic: pure functions from a model's geometry to bytes.

The geometry comes from an HF ``config.json`` (``text_config`` for multimodal wrappers) or a GGUF
file's metadata. head_dim is read from the config before it is derived from hidden/heads, because many
models (Gemma, Qwen3, ...) set it explicitly to something else. Nothing is guessed: a config that
lacks a needed key raises :class:`MissingConfigKeys` naming the keys.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Bytes per element. llama.cpp's quantised types carry per-block scales: q8_0 stores 32 values in 34 bytes.
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "f32": 4, "float32": 4,
    "fp16": 2, "f16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
    "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32,
}


class MissingConfigKeys(ValueError):
    def __init__(self, source: str, keys: list[str]):
        super().__init__(f"{source} lacks {', '.join(keys)}: the KV formula needs them")
        self.keys = keys


class UnknownKVDtype(ValueError):
    def __init__(self, dtype: str):
        super().__init__(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(KV_DTYPE_BYTES))}")


@dataclass(frozen=True)
class KVGeometry:
    """What the KV formula needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    max_context: int | None = None
    sliding_window: int | None = None
    num_sliding_layers: int = 0  # layers that keep at most ``sliding_window`` tokens

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers


def dtype_bytes(dtype: str) -> float:
    try:
        return KV_DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise UnknownKVDtype(dtype) from None


def kv_bytes_per_token_per_layer(geom: KVGeometry, dtype: str) -> float:
    return geom.num_kv_heads * (geom.head_dim_k + geom.head_dim_v) * dtype_bytes(dtype)


def kv_bytes_per_token(geom: KVGeometry, dtype: str) -> float:
    """Bytes one cached token takes across all layers: 2 x layers x kv_heads x head_dim x dtype for MHA/GQA."""
    return geom.num_layers * kv_bytes_per_token_per_layer(geom, dtype)


def kv_bytes_for_sequence(geom: KVGeometry, dtype: str, cached_tokens: int) -> float:
    """Exact formula for one sequence of ``cached_tokens`` (sliding layers capped at the window)."""
    per_layer = kv_bytes_per_token_per_layer(geom, dtype)
    if geom.num_sliding_layers and geom.sliding_window:
        sliding = geom.num_sliding_layers * min(cached_tokens, geom.sliding_window)
    else:
        sliding = geom.num_sliding_layers * cached_tokens
    return per_layer * (geom.num_full_layers * cached_tokens + sliding)


# --- reading the geometry ------------------------------------------------------------------------

def load_hf_config(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    config = json.loads(path.read_text())
    return config.get("text_config") or config


def geometry_from_hf_config(config: dict, source: str = "config.json") -> KVGeometry:
    need = ["num_hidden_layers", "num_attention_heads"]
    missing = [k for k in need if k not in config]
    if "head_dim" not in config and "hidden_size" not in config:
        missing.append("head_dim or hidden_size")
    if missing:
        raise MissingConfigKeys(source, missing)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads  # absent means MHA
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    sliding_layers = 0
    layer_types = config.get("layer_types")
    if layer_types:
        sliding_layers = sum(1 for t in layer_types if t == "sliding_attention")
    elif window and config.get("use_sliding_window", True):
        sliding_layers = layers  # e.g. Mistral-7B-v0.1: every layer windowed
    return KVGeometry(num_layers=layers, num_kv_heads=kv_heads, head_dim_k=head_dim, head_dim_v=head_dim,
                      max_context=config.get("max_position_embeddings"),
                      sliding_window=window if sliding_layers else None, num_sliding_layers=sliding_layers)


def geometry_from_gguf(path: str | Path) -> KVGeometry:
    from gguf import GGUFReader  # heavy import only when a GGUF is read

    fields = GGUFReader(str(path)).fields
    def value(key):
        f = fields.get(key)
        return None if f is None else f.contents()
    arch = value("general.architecture")
    heads = value(f"{arch}.attention.head_count")
    kv_heads = value(f"{arch}.attention.head_count_kv") or heads
    layers = value(f"{arch}.block_count")
    embd = value(f"{arch}.embedding_length")
    missing = [k for k, v in [("block_count", layers), ("attention.head_count", heads)] if v is None]
    if missing:
        raise MissingConfigKeys(str(path), [f"{arch}.{k}" for k in missing])
    head_k = value(f"{arch}.attention.key_length") or embd // heads
    head_v = value(f"{arch}.attention.value_length") or head_k
    return KVGeometry(num_layers=layers, num_kv_heads=kv_heads, head_dim_k=head_k, head_dim_v=head_v,
                      max_context=value(f"{arch}.context_length"))


def round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)
