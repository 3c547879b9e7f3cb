"""Speculative decoding's memory: the drafter a deployment runs beside its model, and what an engine's rules say
of where the drafter's KV lives (:meth:`kvbench.kv.rules.KVRules.draft_kv`). Pure types and functions; imports
nothing above ``kvbench.kv``.

A drafter is one of:

- ``ngram``: n-gram lookup over the request's own tokens: no weights, no KV (a small host buffer);
- ``draft``: a draft model, with its own geometry and weights (``--draft-model``);
- ``eagle``: an EAGLE head: one decoder layer of the target's shape (or the head's own config where given);
- ``mtp``: the model's own multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``), each a
  decoder layer of the target's shape, their weights part of the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .geometry import KVGeometry

#: What ``kvbench plan --speculative`` takes ("none": no speculation).
METHODS = ("none", "ngram", "draft", "eagle", "mtp")
#: --speculative-tokens at most: far past any engine's default (vLLM, SGLang and llama.cpp draft 3 to 16).
MAX_SPECULATIVE_TOKENS = 1024


@dataclass(frozen=True)
class Speculation:
    """One deployment's drafter, as the plan resolved it."""

    method: str  # ngram, draft, eagle or mtp
    tokens: int | None = None  # tokens proposed a step (--speculative-tokens; None: the engine's default)
    draft: KVGeometry | None = None  # the drafter's layers as its files say (None for ngram)
    draft_name: str = ""  # the --draft-model as given ("": none given)
    weights_bytes: float | None = 0.0  # the drafter's weights, all GPUs, beyond the target's (None: unknown)
    weights_source: str = ""
    widths: object | None = None  # the drafter's ModelWidths (a compute buffer scales with them); None: unknown
    head: str = ""  # what the drafter's layers are where no --draft-model names them

    @property
    def label(self) -> str:
        return self.draft_name or self.head

    @property
    def layers(self) -> int:
        return self.draft.num_layers if self.draft is not None else 0


@dataclass(frozen=True)
class DraftKV:
    """Where an engine keeps a drafter's KV, and what it costs one GPU."""

    where: str  # in words: "the target's pool (another KV cache group)", "its own context", ...
    bytes_per_token: float  # per GPU: the drafter's KV per token as the engine holds it
    bytes_per_gpu: float  # per GPU: the drafter's KV for the deployment asked
    note: str  # how, with the engine file it was read in
    verified: bool  # checked against the engine here (kvbench validate), or only read from its source
    #: per GPU, what a pool sized from a budget prices the drafter's token at (bytes_per_token where the engine
    #: prices it as it holds it): the pool's tokens come from it
    priced_per_token: float | None = None
    terms: tuple = ()  # StartupTerm-like (name, bytes, source) the drafter adds on a GPU (its compute buffer)

    @property
    def pool_price(self) -> float:
        return self.bytes_per_token if self.priced_per_token is None else self.priced_per_token

    @property
    def unpriced_per_token(self) -> float:
        """Per GPU and token, what the engine holds of the drafter's KV beyond what its pool's size priced: memory
        taken from outside the budget (the launch OOMs of SGLang's and TensorRT-LLM's issues)."""
        return max(0.0, self.bytes_per_token - self.pool_price)


NO_DRAFT_KV = "no drafter weights or KV: n-gram lookup over the request's own tokens (a small host buffer)"


def ngram_kv(source: str) -> DraftKV:
    """An n-gram proposer's memory: none on the GPU."""
    return DraftKV("nowhere: no drafter", 0.0, 0.0, f"{NO_DRAFT_KV} ({source})", True)


def one_layer_head(target: KVGeometry) -> KVGeometry:
    """An EAGLE head's layers: one decoder layer of the target's shape (its first full-attention layer)."""
    layer = next((x for x in target.kv_layers if x.kind == "full"), target.kv_layers[0])
    return replace(target, layers=(layer,), notes=(), assumed=())


def mtp_head(target: KVGeometry, n: int) -> KVGeometry:
    """The model's ``n`` MTP layers: decoder layers of the target's shape (DeepSeek-V3's are MLA layers)."""
    layer = next((x for x in target.kv_layers if x.kind == "full"), target.kv_layers[0])
    return replace(target, layers=(layer,) * n, notes=(), assumed=())
