"""KV-cache geometry and the plain formula: pure functions from a model's attention layout to bytes.

A :class:`KVGeometry` says, layer by layer, what a plain implementation of the model caches for each token:
how many KV heads, of which K and V widths, and whether the layer keeps every token (full attention), only
a sliding window, only the current chunk (chunked local attention), or nothing that grows with the context
(linear-attention and state-space layers, layers that reuse another layer's KV, cross-attention layers).
An MLA model's layers hold its latent (kv_lora_rank + qk_rope_head_dim, one "head", no V), and the
geometry keeps the decompressed shape beside it, since which of the two is cached is an engine's choice.

Reading a geometry from a model's files is :mod:`kvbench.kv.model_config`. How each engine stores and rounds it
(MLA latent or decompressed, windows kept or not, blocks, cells, pools) is that engine's own, in the
``kv_rules`` of its adapter (:mod:`kvbench.backends`). This module is the formula they share.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field, replace

# Bytes per element. llama.cpp's quantised types carry per-block scales (ggml block sizes / 32 values).
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "f32": 4, "float32": 4,
    "fp16": 2, "f16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_e4m3fn": 1, "int8": 1,
    "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32,
}
KINDS = ("full", "sliding", "chunked", "none")


class UnknownKVDtype(ValueError):
    def __init__(self, dtype: str, known=None):
        super().__init__(f"unknown KV dtype {dtype!r}; known: {', '.join(sorted(known or KV_DTYPE_BYTES))}")


class UnevenSplit(ValueError):
    """A tensor-parallel size that does not split the model's heads evenly (engines refuse it)."""


def dtype_bytes(dtype: str) -> float:
    try:
        return KV_DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise UnknownKVDtype(dtype) from None


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer caches per token."""

    kind: str  # one of KINDS
    kv_heads: int = 0
    head_dim_k: int = 0
    head_dim_v: int = 0
    span: int | None = None  # tokens a "sliding" layer keeps (its window) or a "chunked" layer's chunk
    why_none: str = ""  # for kind "none": why nothing grows with the context

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"layer kind {self.kind!r}; allowed: {', '.join(KINDS)}")

    @property
    def stores(self) -> bool:
        return self.kind != "none"

    @property
    def elements_per_token(self) -> int:
        return self.kv_heads * (self.head_dim_k + self.head_dim_v) if self.stores else 0


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek-V2/V3 and kin): per token a latent of kv_lora_rank plus the
    rope part of K; decompressed, every head has K of qk_nope + qk_rope and V of v_head_dim."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    num_heads: int | None = None

    @property
    def latent(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class KVGeometry:
    """A model's attention layout as its files describe it (see the module's docstring)."""

    layers: tuple[LayerKV, ...]
    num_attention_heads: int | None = None
    max_context: int | None = None
    mla: MLAShape | None = None
    model_type: str = ""
    dtype: str | None = None  # the weights' dtype the config names; engines' "auto" KV dtype follows it
    source: str = "hf"  # "hf": an HF config; "gguf": GGUF metadata, which already says what llama.cpp caches
    flags: tuple[str, ...] = ()  # config facts an engine's rules read (e.g. "new_decoder_architecture")
    notes: tuple[str, ...] = ()  # how the geometry was read: class defaults used, aliases, layers left out
    # fields the file leaves out that the geometry took from a config class (its default, or what it derives):
    # the answer is then not verified (kvbench.kv.model_config.class_filled)
    assumed: tuple[str, ...] = ()
    # the vocabulary, for an engine's buffers of a row of logits per sequence (None: the file does not say); not
    # part of the attention layout, so two geometries that differ only here are the same layout
    vocab_size: int | None = field(default=None, compare=False)

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim_k: int, head_dim_v: int | None = None,
                **kw) -> "KVGeometry":
        """Every layer full attention with the same heads: the common case (and the tests' shorthand)."""
        dv = head_dim_k if head_dim_v is None else head_dim_v
        return cls(tuple(LayerKV("full", num_kv_heads, head_dim_k, dv) for _ in range(num_layers)), **kw)

    # --- what the layers say -------------------------------------------------------------------------
    @functools.cached_property  # read on every answer: once per geometry (frozen: fields never change)
    def kv_layers(self) -> tuple[LayerKV, ...]:
        return tuple(layer for layer in self.layers if layer.stores)

    @functools.cached_property
    def layer_counts(self) -> dict[LayerKV, int]:
        """Each distinct layer and how many of it (sums over layers read this: linear in distinct layers)."""
        return dict(Counter(self.layers))

    @property
    def num_layers(self) -> int:
        """Layers that cache KV growing with the context."""
        return len(self.kv_layers)

    @property
    def num_kv_heads(self) -> int:
        return max((layer.kv_heads for layer in self.kv_layers), default=0)

    @property
    def head_dim_k(self) -> int:
        return max((layer.head_dim_k for layer in self.kv_layers), default=0)

    @property
    def head_dim_v(self) -> int:
        return max((layer.head_dim_v for layer in self.kv_layers), default=0)

    def count(self, kind: str) -> int:
        return sum(1 for layer in self.layers if layer.kind == kind)

    @property
    def num_sliding_layers(self) -> int:
        return self.count("sliding")

    @property
    def sliding_window(self) -> int | None:
        spans = {layer.span for layer in self.layers if layer.kind == "sliding"}
        return max(spans) if spans else None

    @property
    def chunk_size(self) -> int | None:
        spans = {layer.span for layer in self.layers if layer.kind == "chunked"}
        return max(spans) if spans else None

    @property
    def attention(self) -> str:
        if self.mla:
            return "MLA"
        heads = self.num_attention_heads
        kv = self.num_kv_heads
        if heads is None or kv >= heads:
            return "MHA"
        return "MQA" if kv == 1 else "GQA"

    def describe(self) -> str:
        """One line: ``GQA, 32 layers, 8 KV heads, head_dim K 128 / V 128, window 4096 on 16 layers``."""
        parts = [f"{self.attention}, {self.num_layers} KV layers"]
        if self.mla:
            parts.append(f"latent {self.mla.kv_lora_rank} + rope {self.mla.qk_rope_head_dim}")
        else:
            parts.append(f"{self.num_kv_heads} KV heads, head_dim K {self.head_dim_k} / V {self.head_dim_v}")
        if self.count("sliding"):
            parts.append(f"window {self.sliding_window} on {self.count('sliding')} layers")
        if self.count("chunked"):
            parts.append(f"chunks of {self.chunk_size} on {self.count('chunked')} layers")
        if self.count("none"):
            why = sorted({layer.why_none for layer in self.layers if not layer.stores})
            parts.append(f"{self.count('none')} layers without a growing KV ({'; '.join(why)})")
        return ", ".join(parts)


def decompressed(geom: KVGeometry, v_head_dim: int | None = None) -> KVGeometry:
    """An MLA model's layers as engines that do not keep the latent store them: every head with K of
    qk_nope + qk_rope and V of ``v_head_dim`` (default: the config's v_head_dim)."""
    m = geom.mla
    if m is None:
        return geom
    if m.qk_nope_head_dim is None or m.num_heads is None or (m.v_head_dim is None and v_head_dim is None):
        raise ValueError("this MLA config lacks qk_nope_head_dim, v_head_dim or num_attention_heads: "
                         "its decompressed size is unknown")
    dv = m.v_head_dim if v_head_dim is None else v_head_dim
    layers = tuple(replace(layer, kv_heads=m.num_heads, head_dim_k=m.qk_nope_head_dim + m.qk_rope_head_dim,
                           head_dim_v=dv) if layer.stores else layer for layer in geom.layers)
    return replace(geom, layers=layers, mla=None)


# --- the plain formula -------------------------------------------------------------------------------

def check_split(geom: KVGeometry, tp: int) -> None:
    """Tensor parallelism splits attention heads: ``tp`` must divide the query heads, and the KV heads
    (or be a multiple of them: a KV head is then replicated). An MLA latent is replicated on every rank."""
    if tp < 1:
        raise UnevenSplit("the tensor-parallel size must be >= 1")
    if tp == 1:
        return
    heads = geom.num_attention_heads
    if heads and heads % tp:
        raise UnevenSplit(f"{heads} attention heads cannot be split evenly over {tp} GPUs")
    if geom.mla:
        return
    for kv in sorted({layer.kv_heads for layer in geom.kv_layers}):
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise UnevenSplit(f"{kv} KV heads cannot be split evenly over {tp} GPUs (nor replicated evenly)")


def pipeline_partition(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as vLLM splits them (distributed/utils.py get_pp_indices): evenly, the
    remainder one each to the stages before the last, from the second-to-last back."""
    if pp < 1 or pp > num_layers:
        raise UnevenSplit(f"{num_layers} layers cannot be split over {pp} pipeline stages")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


@functools.lru_cache(maxsize=64)
def pipeline_stage(geom: KVGeometry, pp: int) -> KVGeometry:
    """The layers one GPU of a ``pp``-stage pipeline holds: the stage whose layers cache the most per token
    (every stage's layers are contiguous, :func:`pipeline_partition`). ``pp`` 1: the whole model."""
    if pp == 1:
        return geom
    stages, start = [], 0
    for n in pipeline_partition(len(geom.layers), pp):
        stages.append(geom.layers[start:start + n])
        start += n
    heaviest = max(stages, key=lambda layers: sum(layer.elements_per_token for layer in layers))
    return replace(geom, layers=heaviest)


def heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank holds: never below one (a head is replicated past that)."""
    return max(1, kv_heads // tp)


def layer_bytes_per_token(layer: LayerKV, dtype: str, tp: int = 1, replicated: bool = False) -> float:
    if not layer.stores:
        return 0.0
    heads = layer.kv_heads if replicated else heads_per_rank(layer.kv_heads, tp)
    return heads * (layer.head_dim_k + layer.head_dim_v) * dtype_bytes(dtype)


def kv_bytes_per_token(geom: KVGeometry, dtype: str, tp: int = 1) -> float:
    """Bytes one cached token takes on one rank over every layer that caches it (windows not applied):
    2 x layers x kv_heads x head_dim x dtype for MHA/GQA/MQA; layers x (kv_lora_rank + rope) x dtype for
    an MLA latent (replicated on every rank)."""
    return sum(n * layer_bytes_per_token(layer, dtype, tp, replicated=geom.mla is not None)
               for layer, n in geom.layer_counts.items())  # each distinct layer once: linear in layers


def tokens_kept(layer: LayerKV, tokens: int) -> int:
    """Tokens of one sequence a layer holds in the plain formula: all, or at most its window or chunk."""
    if not layer.stores:
        return 0
    if layer.kind in ("sliding", "chunked") and layer.span:
        return min(tokens, layer.span)
    return tokens


def kv_bytes_for_sequence(geom: KVGeometry, dtype: str, cached_tokens: int, tp: int = 1) -> float:
    """The plain formula for one sequence of ``cached_tokens``: windows and chunks applied."""
    replicated = geom.mla is not None
    return sum(n * layer_bytes_per_token(layer, dtype, tp, replicated) * tokens_kept(layer, cached_tokens)
               for layer, n in geom.layer_counts.items())


def round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EngineKV:
    """KV bytes B sequences of N tokens take on one rank, as an engine (or the plain formula) holds them."""

    engine: str
    bytes_per_rank: float
    tokens_full: int  # tokens (cells, slots) held per full-attention layer, all sequences
    tokens_windowed: int  # the same for sliding-window and chunked layers (0: none)
    note: str


def plain_kv(geom: KVGeometry, dtype: str, context: int, batch: int, tp: int = 1) -> EngineKV:
    """The plain formula for ``batch`` sequences of ``context`` tokens on one rank: no engine's rounding."""
    check_split(geom, tp)
    windowed = [layer for layer in geom.kv_layers if layer.kind in ("sliding", "chunked")]
    return EngineKV("exact", batch * kv_bytes_for_sequence(geom, dtype, context, tp), batch * context,
                    batch * tokens_kept(windowed[0], context) if windowed else 0,
                    "formula: tokens x bytes per token, windows and chunks applied")
