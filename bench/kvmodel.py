"""KV-cache arithmetic: pure functions from a model's geometry to bytes, exact and under each engine's rules.

The geometry comes from an HF ``config.json`` (``text_config`` for multimodal wrappers), a GGUF file's
metadata, or Ollama's ``/api/show`` ``model_info`` (the same GGUF keys). Rules that published arithmetic
often gets wrong, and that this module gets right:

- head_dim is read from the config's ``head_dim`` before it is derived from hidden / heads;
- MLA (DeepSeek-V2/V3) caches one latent of kv_lora_rank + qk_rope_head_dim per token per layer, not
  num_key_value_heads full heads (the config's 128 would overstate it about 57x), and is replicated, not
  sharded, across tensor-parallel ranks;
- sliding windows: all layers (Mistral-7B-v0.1) or a hybrid pattern (Gemma 2 every other layer, Gemma 3
  five of six; ``layer_types`` wins when present); Qwen2's ``sliding_window`` counts only with
  ``use_sliding_window`` true, and then only from ``max_window_layers`` on;
- quantised KV types are counted with their block scales (q8_0: 34 bytes per 32 values).

Nothing is guessed: a config that lacks a needed key raises :class:`MissingConfigKeys` naming the keys,
an unknown dtype or engine raises an error listing the known ones.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

# Bytes per element. llama.cpp's quantised types carry per-block scales (ggml block sizes / 32 values).
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "f32": 4, "float32": 4,
    "fp16": 2, "f16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_e4m3fn": 1, "int8": 1,
    "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32,
}
ENGINES = ("vllm", "tgi", "llamacpp", "ollama", "hf")
# Defaults each engine uses when the user does not say (kv-accounting.md).
DEFAULT_BLOCK_SIZE = {"vllm": 16, "tgi": 1}  # vLLM on GPU (128 on CPU); TGI with flashinfer
LLAMACPP_PAD = 256
LLAMACPP_UBATCH = 512


class MissingConfigKeys(ValueError):
    def __init__(self, source: str, keys: list[str]):
        super().__init__(f"{source} lacks {', '.join(keys)}: the KV formula needs them")
        self.keys = keys


class UnknownKVDtype(ValueError):
    def __init__(self, dtype: str):
        super().__init__(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(KV_DTYPE_BYTES))}")


class UnknownEngine(ValueError):
    def __init__(self, engine: str):
        super().__init__(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


@dataclass(frozen=True)
class MLAShape:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None


@dataclass(frozen=True)
class KVGeometry:
    """What the KV formula needs to know about a model."""

    num_layers: int
    num_kv_heads: int  # for MLA: 1 (the latent)
    head_dim_k: int
    head_dim_v: int  # 0 for MLA: the latent serves as both K and V
    num_attention_heads: int | None = None
    max_context: int | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: keeps at most sliding_window tokens
    mla: MLAShape | None = None
    architecture: str = ""

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.sliding_layers)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def attention(self) -> str:
        if self.mla:
            return "MLA"
        if self.num_attention_heads is None or self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


def dtype_bytes(dtype: str) -> float:
    try:
        return KV_DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise UnknownKVDtype(dtype) from None


def heads_per_rank(geom: KVGeometry, tp: int = 1) -> int:
    """KV heads one tensor-parallel rank holds: never below one (heads are replicated past that);
    MLA's single latent is replicated on every rank."""
    if tp < 1:
        raise ValueError("tensor parallel size must be >= 1")
    if geom.mla:
        return 1
    return max(1, geom.num_kv_heads // tp)


def kv_bytes_per_token_per_layer(geom: KVGeometry, dtype: str, tp: int = 1) -> float:
    return heads_per_rank(geom, tp) * (geom.head_dim_k + geom.head_dim_v) * dtype_bytes(dtype)


def kv_bytes_per_token(geom: KVGeometry, dtype: str, tp: int = 1) -> float:
    """Bytes one cached token takes across all layers on one rank (sliding windows not applied).
    MHA/GQA/MQA: 2 x layers x kv_heads x head_dim x dtype; MLA: layers x (kv_lora_rank + rope dim) x dtype."""
    return geom.num_layers * kv_bytes_per_token_per_layer(geom, dtype, tp)


def kv_bytes_for_sequence(geom: KVGeometry, dtype: str, cached_tokens: int, tp: int = 1,
                          window_tokens: int | None = None) -> float:
    """Exact formula for one sequence of ``cached_tokens``: sliding layers hold at most the window
    (or ``window_tokens`` when an engine keeps a different number)."""
    per_layer = kv_bytes_per_token_per_layer(geom, dtype, tp)
    window = window_tokens if window_tokens is not None else geom.sliding_window
    sliding = geom.num_sliding_layers * (min(cached_tokens, window) if window else cached_tokens)
    return per_layer * (geom.num_full_layers * cached_tokens + sliding)


def round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


# --- engine allocation rules ---------------------------------------------------------------------

@dataclass(frozen=True)
class EngineKV:
    """KV bytes B sequences of N tokens take on one rank under an engine's rules."""

    engine: str
    bytes_per_rank: float
    tokens_full: int  # tokens (cells, slots) held per full-attention layer, all sequences
    tokens_sliding: int  # the same for sliding-window layers
    note: str


def decompressed_mla(geom: KVGeometry) -> KVGeometry:
    """DeepSeek's K/V as engines that do not keep the latent store them: every head, K = nope + rope."""
    m = geom.mla
    if m is None or m.qk_nope_head_dim is None or m.v_head_dim is None or geom.num_attention_heads is None:
        raise MissingConfigKeys("MLA config", ["qk_nope_head_dim", "v_head_dim", "num_attention_heads"])
    return replace(geom, num_kv_heads=geom.num_attention_heads, head_dim_k=m.qk_nope_head_dim + m.qk_rope_head_dim,
                   head_dim_v=m.v_head_dim, mla=None)


def engine_kv(geom: KVGeometry, dtype: str, context: int, batch: int, engine: str | None = None, tp: int = 1,
              block_size: int | None = None, hf_version: tuple[int, int] = (5, 24), unified: bool = False) -> EngineKV:
    """KV bytes for ``batch`` sequences of ``context`` tokens each, on one tensor-parallel rank.

    ``engine`` None is the exact formula. The engine rules (kv-accounting.md):
    - vllm: whole blocks of ``block_size`` per sequence (16 on GPU, 128 on CPU); sliding layers keep the
      blocks covering the last window - 1 tokens plus one block (GPU hybrid manager); MLA as the latent.
    - tgi: whole blocks (1 with flashinfer, 16 paged, 256 flashdecoding) of prompt + max_new_tokens
      (``context`` is that reservation); DeepSeek stored decompressed; fp8 only as e4m3/e5m2.
    - llamacpp / ollama: n_ctx = batch x context padded to 256, one stream per slot of n_ctx / slots
      padded to 256 (``unified``: one stream), sliding layers in a separate cache of
      min(stream, window x (slots if unified else 1) + n_ubatch) cells padded to 256.
    - hf: transformers' DynamicCache: sliding layers keep window - 1 tokens; DeepSeek decompressed
      before transformers 5.20, the latent from 5.20.
    """
    if engine is None:
        total = batch * kv_bytes_for_sequence(geom, dtype, context, tp)
        sliding = batch * (min(context, geom.sliding_window) if geom.sliding_window else context)
        return EngineKV("exact", total, batch * context, sliding if geom.num_sliding_layers else 0,
                        "formula: tokens x per-token bytes, sliding layers capped at the window")
    engine = engine.lower()
    if engine not in ENGINES:
        raise UnknownEngine(engine)
    dtype_bytes(dtype)  # validate
    per_layer = kv_bytes_per_token_per_layer
    if engine == "vllm":
        bs = block_size or DEFAULT_BLOCK_SIZE["vllm"]
        full = batch * round_up(context, bs)
        sliding = full
        if geom.sliding_window and geom.num_sliding_layers:
            keep = (math.ceil((geom.sliding_window - 1) / bs) + 1) * bs
            sliding = batch * min(round_up(context, bs), keep)
        b = per_layer(geom, dtype, tp) * (geom.num_full_layers * full + geom.num_sliding_layers * sliding)
        return EngineKV("vllm", b, full, sliding if geom.num_sliding_layers else 0,
                        f"whole blocks of {bs} tokens per sequence (plus one null block per pool)")
    if engine == "tgi":
        if dtype.lower() not in ("fp16", "f16", "bf16", "float16", "bfloat16", "fp32", "f32", "fp8_e4m3", "fp8_e4m3fn", "fp8_e5m2"):
            raise UnknownKVDtype(f"{dtype} (TGI supports fp16/bf16 and fp8_e4m3fn / fp8_e5m2)")
        g = decompressed_mla(geom) if geom.mla else geom
        bs = block_size or DEFAULT_BLOCK_SIZE["tgi"]
        full = batch * round_up(context, bs)
        # TGI has no sliding-window cache: every layer keeps the whole reservation.
        b = per_layer(g, dtype, tp) * g.num_layers * full
        return EngineKV("tgi", b, full, 0, f"blocks of {bs} tokens for prompt + max_new_tokens; "
                        + ("DeepSeek stored decompressed" if geom.mla else "no sliding-window saving"))
    if engine in ("llamacpp", "ollama"):
        n_ctx = round_up(batch * context, LLAMACPP_PAD)
        streams = 1 if unified else batch
        cells = round_up(n_ctx // streams, LLAMACPP_PAD)
        full = streams * cells
        sliding = 0
        if geom.sliding_window and geom.num_sliding_layers:
            swa_cells = round_up(min(cells, geom.sliding_window * (batch if unified else 1) + LLAMACPP_UBATCH),
                                 LLAMACPP_PAD)
            sliding = streams * swa_cells
        b = per_layer(geom, dtype, tp) * (geom.num_full_layers * full + geom.num_sliding_layers * sliding)
        return EngineKV(engine, b, full, sliding, f"{streams} stream(s) of {cells} cells (n_ctx padded to 256)"
                        + (f", sliding-window cache of {sliding // streams} cells" if sliding else ""))
    # hf
    g = decompressed_mla(geom) if geom.mla and hf_version < (5, 20) else geom
    window = geom.sliding_window - 1 if geom.sliding_window else None
    b = batch * kv_bytes_for_sequence(g, dtype, context, tp, window_tokens=window)
    return EngineKV("hf", b, batch * context, batch * min(context, window) if window and geom.num_sliding_layers else 0,
                    "DynamicCache: exact tokens, sliding layers keep window - 1")


def sequences_in_pool(engine: str, pool_tokens: int, context: int, block_size: int | None = None) -> int | None:
    """How many sequences of ``context`` tokens (prompt + output) the engine's KV pool of ``pool_tokens``
    holds at once, by the same rules as :func:`engine_kv`: the planner's maximum concurrency for that pool.

    vllm: whole blocks per sequence, one block of the pool is vLLM's null block; tgi: whole blocks of
    prompt + max_new_tokens; llamacpp / ollama: one slot of n_ctx / slots cells (padded to 256) per
    sequence; hf: no pool (None)."""
    engine = engine.lower()
    if engine == "vllm":
        bs = block_size or DEFAULT_BLOCK_SIZE["vllm"]
        return max(0, pool_tokens - bs) // round_up(context, bs)
    if engine == "tgi":
        bs = block_size or DEFAULT_BLOCK_SIZE["tgi"]
        return pool_tokens // round_up(context, bs)
    if engine in ("llamacpp", "ollama"):
        return pool_tokens // round_up(context, LLAMACPP_PAD)
    return None


# --- reading the geometry ------------------------------------------------------------------------

def load_hf_config(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config")
    if text:  # multimodal wrappers (Gemma 3, Llava, ...): the language model's config
        return {"model_type": config.get("model_type"), **text}
    return config


def _sliding_layers_from_hf(config: dict, layers: int) -> tuple[bool, ...]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(t == "sliding_attention" for t in layer_types)
    if not window:
        return (False,) * layers
    model_type = str(config.get("model_type", ""))
    if model_type.startswith("qwen2") or model_type.startswith("qwen3"):
        if not config.get("use_sliding_window", False):
            return (False,) * layers
        first = config.get("max_window_layers", 0)
        return tuple(i >= first for i in range(layers))
    pattern = config.get("sliding_window_pattern")
    if pattern is None and model_type.startswith("gemma3"):
        pattern = 6
    if pattern is None and model_type.startswith("gemma2"):
        pattern = 2
    if pattern:
        return tuple((i + 1) % pattern != 0 for i in range(layers))
    if config.get("use_sliding_window") is False:
        return (False,) * layers
    return (True,) * layers  # e.g. Mistral-7B-v0.1: every layer windowed


def geometry_from_hf_config(config: dict, source: str = "config.json") -> KVGeometry:
    need = ["num_hidden_layers", "num_attention_heads"]
    missing = [k for k in need if k not in config]
    is_mla = "kv_lora_rank" in config and config.get("kv_lora_rank")
    if is_mla:
        missing += [k for k in ("qk_rope_head_dim",) if k not in config]
    elif "head_dim" not in config and "hidden_size" not in config:
        missing.append("head_dim or hidden_size")
    if missing:
        raise MissingConfigKeys(source, missing)
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    sliding = _sliding_layers_from_hf(config, layers)
    if len(sliding) != layers:
        raise ValueError(f"{source}: layer_types has {len(sliding)} entries for {layers} layers")
    window = config.get("sliding_window") if any(sliding) else None
    common = dict(num_attention_heads=heads, max_context=config.get("max_position_embeddings"),
                  sliding_window=window, sliding_layers=sliding, architecture=str(config.get("model_type", "")))
    if is_mla:
        mla = MLAShape(config["kv_lora_rank"], config["qk_rope_head_dim"], config.get("qk_nope_head_dim"),
                       config.get("v_head_dim"))
        return KVGeometry(num_layers=layers, num_kv_heads=1, head_dim_k=mla.kv_lora_rank + mla.qk_rope_head_dim,
                          head_dim_v=0, mla=mla, **common)
    kv_heads = config.get("num_key_value_heads") or heads  # absent means MHA
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return KVGeometry(num_layers=layers, num_kv_heads=kv_heads, head_dim_k=head_dim, head_dim_v=head_dim, **common)


def geometry_from_gguf_keys(keys: dict, source: str = "GGUF") -> KVGeometry:
    """From GGUF metadata keys: a GGUF file's fields or Ollama's /api/show ``model_info``."""
    arch = keys.get("general.architecture")
    if not arch:
        raise MissingConfigKeys(source, ["general.architecture"])
    def key(name):
        return keys.get(f"{arch}.{name}")
    layers, heads = key("block_count"), key("attention.head_count")
    missing = [f"{arch}.{k}" for k, v in [("block_count", layers), ("attention.head_count", heads)] if v is None]
    if isinstance(heads, list):  # per-layer head counts (some archs): take the max
        heads = max(heads)
    kv_heads = key("attention.head_count_kv")
    kv_heads = max(kv_heads) if isinstance(kv_heads, list) else (kv_heads or heads)
    embd = key("embedding_length")
    kv_lora = key("attention.kv_lora_rank")
    head_k, head_v = key("attention.key_length"), key("attention.value_length")
    if not kv_lora and head_k is None and (embd is None or heads is None):
        missing.append(f"{arch}.attention.key_length or {arch}.embedding_length")
    if missing:
        raise MissingConfigKeys(source, missing)
    window = key("attention.sliding_window")
    pattern = key("attention.sliding_window_pattern")
    if window:
        if isinstance(pattern, list):
            sliding = tuple(bool(x) for x in pattern)
        else:
            n = pattern if pattern is not None else {"gemma2": 2, "gemma3": 6}.get(arch, 0)
            # llama.cpp's set_swa_pattern: layer il is sliding when il % n < n - 1 (n = 0: every layer)
            sliding = tuple(n == 0 or (i % n) < n - 1 for i in range(layers))
    else:
        sliding = (False,) * layers
    common = dict(num_attention_heads=heads, max_context=key("context_length"),
                  sliding_window=window if any(sliding) else None, sliding_layers=sliding, architecture=arch)
    if kv_lora:
        rope = key("rope.dimension_count")
        if rope is None:
            raise MissingConfigKeys(source, [f"{arch}.rope.dimension_count"])
        mla = MLAShape(kv_lora, rope, None, head_v)
        return KVGeometry(num_layers=layers, num_kv_heads=1, head_dim_k=kv_lora + rope, head_dim_v=0, mla=mla, **common)
    head_k = head_k or embd // heads
    return KVGeometry(num_layers=layers, num_kv_heads=kv_heads, head_dim_k=head_k, head_dim_v=head_v or head_k, **common)


def gguf_keys(path: str | Path) -> dict:
    """A GGUF file's metadata as {key: value} (arrays as lists), without the tokenizer's vocabulary."""
    from gguf import GGUFReader  # heavy import only when a GGUF is read

    out = {}
    for name, f in GGUFReader(str(path)).fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model",):
            continue
        out[name] = f.contents()
    return out


def geometry_from_gguf(path: str | Path) -> KVGeometry:
    return geometry_from_gguf_keys(gguf_keys(path), str(path))
