"""How an engine stores and rounds KV: the base every engine's rules extend (each adapter module holds its
engine's subclass, as ``kv_rules`` of its adapter class).

A :class:`KVQuestion` asks for ``batch`` sequences of ``context`` cached tokens on one GPU (one
tensor-parallel rank); :meth:`KVRules.answer` says how many bytes the engine holds for them and why.
The engine decides: which KV dtypes it accepts and what "auto" means, what it caches of each layer
(:meth:`KVRules.stored`: an MLA latent or decompressed heads, a window kept or the whole sequence, heads
broadcast or not), how a tensor-parallel split divides it, how it rounds (blocks, cells), what its pool
holds beside the sequences, and how many sequences a pool it reports holds. The planner, the runner's
summary, the reports and ``kvbench validate`` ask these methods and never switch on an engine's name.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

from kvbench.kv.geometry import (
    KVGeometry,
    LayerKV,
    UnknownKVDtype,
    check_split,
    dtype_bytes,
    layer_bytes_per_token,
    tokens_kept,
)
from kvbench.kv.option_ranges import (  # noqa: F401  (the engines' rules import the ranges from here)
    MAX_WHOLE_OPTION,
    Choice,
    KVRuleError,
    Number,
    OptionRange,
    Switch,
    Whole,
)
from kvbench.kv.weights import WEIGHT_DTYPE_BYTES


@dataclass(frozen=True)
class KVQuestion:
    geometry: KVGeometry
    dtype: str = "auto"  # as the user wrote it; "auto": the engine's default for this model
    context: int = 1  # cached tokens per sequence (prompt + output - 1 at the end of a request)
    batch: int = 1  # sequences held at once
    tp: int = 1  # GPUs the model is split over
    block_size: int | None = None  # None: the engine's default
    device: str = "gpu"  # "gpu" or "cpu": some engines size differently per device
    version: str | None = None  # None: the rules' own version
    options: dict = field(default_factory=dict)  # engine-specific switches, e.g. vLLM's hybrid_kv_cache
    capability: tuple[int, int] | None = None  # the GPU's CUDA compute capability (None: 8.0 or later)
    cpu_features: tuple[str, ...] = ()  # device cpu: the CPU's flags (vLLM's CPU MLA block depends on AMX)


@dataclass(frozen=True)
class KVAnswer:
    engine: str
    dtype: str  # the engine's KV dtype, "auto" resolved
    bytes_per_gpu: float  # the sequences' KV on one GPU, as the engine holds it
    tokens_full: int  # tokens (cells, slots) one full-attention layer holds, all sequences
    tokens_windowed: int  # the same for a sliding-window or chunked layer (0: none)
    bytes_per_token: float  # per GPU, every caching layer, as stored (windows not applied)
    note: str  # how the engine stores and rounds it
    pool_extra_bytes: float = 0.0  # what a pool holds beside the sequences (vLLM's null block)


def parse_version(version: str | None) -> tuple[int, ...]:
    out = []
    for part in (version or "").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


class KVRules:
    """The plain formula, and the hooks an engine overrides. ``dtypes`` maps the KV dtype names the engine
    accepts (kvbench's names) to its own; ``auto`` resolves through :meth:`auto_dtype`."""

    engine: ClassVar[str] = "exact"
    version: ClassVar[str] = ""
    dtypes: ClassVar[dict[str, str]] = {}  # {} accepts every dtype kvbench knows
    has_blocks: ClassVar[bool] = False
    mla_latent: ClassVar[bool] = True  # the plain formula counts an MLA model's latent
    #: True where :meth:`answer` for a load is what the engine's own in-use figure counts (blocks held, a
    #: cache's tensors), so the row sets the two side by side; False where the answer is a whole allocation.
    answer_is_in_use: ClassVar[bool] = False
    #: The engine-specific switches the rules read from ``KVQuestion.options`` (`kvbench plan --engine-option`),
    #: each with what the engine takes of it (:class:`OptionRange`).
    rule_options: ClassVar[dict[str, OptionRange]] = {}
    #: True where the engine sizes its pool from a byte budget in whole blocks (it then defines
    #: ``bytes_per_block`` and ``blocks_per_sequence``); False where it allocates for its limit and slots at start.
    pool_from_budget: ClassVar[bool] = False
    #: the engine option that is its share of the GPU (vLLM's gpu_memory_utilization): `kvbench plan --margin M` is
    #: that option at 1 - M; None where the engine takes no share (llama.cpp allocates what it needs)
    fraction_option: ClassVar[str | None] = None
    #: What a report says of the engine's KV pool where the engine reported none.
    no_pool_label: ClassVar[str] = "not reported"
    #: True where the engine allocates its KV pool (and its activation buffers) at start; False where its
    #: cache and activations grow with the batch it serves (static batching): a memory plan then counts
    #: activations per token in flight.
    pool_at_start: ClassVar[bool] = True
    #: The files the engine serves: "safetensors" (an HF model folder) or "gguf" (a GGUF file, as the embedded model).
    model_format: ClassVar[str] = "safetensors"
    #: True where sequences that start alike hold one copy of their common prefix's KV (vLLM's shared
    #: blocks); False where each sequence holds its own (llama.cpp's slots, transformers' batch).
    shares_prefix_kv: ClassVar[bool] = False

    # --- the questions an engine refuses -----------------------------------------------------------
    def resolve_dtype(self, q: KVQuestion) -> str:
        name = q.dtype.lower()
        if name == "auto":
            return self.auto_dtype(q)
        if self.dtypes:
            if name not in self.dtypes:
                allowed = ", ".join(["auto", *sorted(self.dtypes)])
                raise KVRuleError(f"{self.engine} has no KV dtype {q.dtype!r}; it takes: {allowed}")
            return self.dtypes[name]
        try:
            dtype_bytes(name)
        except UnknownKVDtype as exc:
            raise KVRuleError(str(exc)) from None
        return name

    def auto_dtype(self, q: KVQuestion) -> str:
        """The KV dtype an engine uses when not told: what a quantised checkpoint's config asks for where the
        engine reads it (:meth:`checkpoint_kv_dtype`), else the dtype the engine serves the model in
        (:meth:`serving_dtype`)."""
        return self.checkpoint_kv_dtype(q.geometry) or self.serving_dtype(q.geometry, q.capability)

    # --- the dtypes an engine serves a model in ------------------------------------------------------
    def serving_dtype(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        """The dtype of the weights and activations when the engine is not told one (``--dtype auto``), for a
        GPU of ``capability`` (None: 8.0 or later): the plain formula takes the config's own dtype, bf16
        when it names none. Engines override it with their own resolution."""
        return {"fp32": "fp32", "fp16": "fp16"}.get(geometry.dtype or "", "bf16")

    def serving_note(self, geometry: KVGeometry, capability: tuple[int, int] | None = None) -> str:
        """Why :meth:`serving_dtype` is what it is, in a few words (for the plan's ledger)."""
        named = geometry.dtype or "none"
        return f"the config's dtype ({named})"

    def checkpoint_kv_dtype(self, geometry: KVGeometry) -> str | None:
        """The KV dtype a quantised checkpoint's config makes the engine's ``auto`` pick (its
        ``quantization_config`` declaring an fp8 KV cache, read into the geometry's flags); None: the KV
        follows :meth:`serving_dtype`. The plain formula reads none."""
        return None

    # --- what a deployment holds -----------------------------------------------------------------------
    def deployment(self, q: KVQuestion, limit: int) -> KVAnswer:
        """The KV one GPU needs to serve ``q.batch`` requests of ``q.context`` tokens at once on a server
        started with a per-request limit of ``limit`` tokens: one whole request at the limit must fit (a
        server that accepts it must hold it; vLLM and TGI refuse to start otherwise) and the batch at its
        typical length, whichever is larger. Engines that allocate per slot override it (llama.cpp)."""
        typical = self.answer(q)
        if limit <= q.context:
            return typical
        one = self.answer(replace(q, context=limit, batch=1))
        if one.bytes_per_gpu > typical.bytes_per_gpu:
            return replace(one, note=f"{one.note}; one request at the {limit:,}-token limit (more than "
                                     f"{q.batch} x {q.context:,})")
        return typical

    def host_memory(self, q: KVQuestion) -> list[tuple[str, float, str]]:
        """Host memory the engine holds beyond its KV pool, that a plan against a CPU memory wall must count:
        (term, bytes, where the figure comes from) each, named as the engine's log names a buffer where it
        logs one (a run sets the logged one beside it); []: nothing beyond the pool."""
        return []

    def host_levers(self) -> list[tuple[str, dict]]:
        """(flag, rule options) that shrink :meth:`host_memory`, for a plan's levers."""
        return []

    # --- the levers a plan proposes, and how to pull them on this engine ------------------------------
    #: KV dtypes below 16 bits a plan proposes where the engine takes them (see :meth:`kv_levers`).
    kv_lever_dtypes: ClassVar[tuple[str, ...]] = ("fp8", "q8_0", "q4_0")
    #: Weight formats the engine serves, as {name: bytes per parameter} (a plan proposes the smaller ones).
    weight_formats: ClassVar[dict[str, float]] = {"fp8": WEIGHT_DTYPE_BYTES["fp8"], "int8": WEIGHT_DTYPE_BYTES["int8"],
                                                  "int4": WEIGHT_DTYPE_BYTES["int4"]}

    def kv_levers(self) -> list[str]:
        """The smaller KV dtypes this engine takes, from its :attr:`dtypes` (the plain formula: fp8)."""
        if not self.dtypes:
            return ["fp8"]
        return [d for d in self.kv_lever_dtypes if d in self.dtypes]

    # --- KV quantisation: what a `kv_quant` workload sweeps ---------------------------------------------
    def quantised_kv_dtypes(self) -> list[str]:
        """The KV dtypes below 16 bits this engine takes (its own names, each once, in :attr:`dtypes`' order):
        what a KV-quantisation run sweeps by default. The plain formula (no :attr:`dtypes`): none."""
        out: list[str] = []
        for own in self.dtypes.values():
            try:
                if dtype_bytes(own) < 2 and own not in out:
                    out.append(own)
            except UnknownKVDtype:
                continue
        return out

    def baseline_kv_dtype(self, q: KVQuestion) -> str:
        """The engine's own 16-bit KV dtype for the model, that quantised caches are compared with: its
        ``auto`` where that is 16 bits or more, else its first 16-bit dtype."""
        auto = self.resolve_dtype(replace(q, dtype="auto"))
        if dtype_bytes(auto) >= 2:
            return auto
        return next((own for own in self.dtypes.values() if dtype_bytes(own) == 2), "bf16")

    def kv_dtype_flag(self, dtype: str) -> str:
        """How a user sets the KV dtype on this engine."""
        return f"--kv-dtype {dtype}"

    def weights_flag(self, fmt: str) -> str:
        """What serving the weights in ``fmt`` takes on this engine."""
        return f"{fmt} weights (a quantised checkpoint)"

    def limit_flag(self, limit: int, batch: int) -> str:
        """How a user sets the per-request limit (and, where the engine sizes by it, the slots)."""
        return f"--max-model-len {limit}"

    def concurrency_flag(self, batch: int) -> str:
        """How a user caps the requests served at once."""
        return f"--batch {batch}"

    def tp_flag(self, tp: int) -> str:
        """How a user splits the model over ``tp`` GPUs."""
        return f"--tp {tp}"

    def pp_flag(self, pp: int) -> str | None:
        """How a user splits the model's layers over ``pp`` GPUs in a pipeline, each GPU holding its stage's
        layers and their KV (a pipeline may span nodes); None where the engine has no pipeline parallel."""
        return None

    def dp_attention_flag(self, gpus: int) -> str | None:
        """How a user runs an MLA model's attention data-parallel over ``gpus`` GPUs: each GPU holds the latent
        KV of its own share of the requests (not every request's, as tensor parallel replicates it), the
        routed experts split over all of them (expert parallel), the rest of the weights whole on each. None
        where the engine has none."""
        return None

    # --- speculative decoding: the drafter's memory (kvbench.kv.speculative) ----------------------------
    def speculative_flag(self, spec) -> str | None:
        """How a user starts the engine with the drafter ``spec`` (a :class:`kvbench.kv.speculative.Speculation`);
        None where the engine has no such speculative decoding (the default: it has none)."""
        return None

    def draft_kv(self, q: KVQuestion, spec, limit: int):
        """Where the engine keeps the drafter's KV for ``q`` on a server started with a limit of ``limit`` (a
        :class:`kvbench.kv.speculative.DraftKV`); None where it has no such speculative decoding."""
        return None

    def check(self, q: KVQuestion) -> None:
        if q.context < 1 or q.batch < 1:
            raise KVRuleError("the context and the batch must be >= 1")
        if q.block_size is not None:
            if not self.has_blocks:
                raise KVRuleError(f"{self.engine} has no KV block size to set")
            if q.block_size < 1:
                raise KVRuleError(f"the block size must be >= 1, not {q.block_size}")
        self.check_split(q)

    def check_split(self, q: KVQuestion) -> None:
        """Tensor parallelism divides each layer's heads: the split must be even (engines refuse others)."""
        try:
            check_split(self.stored(q), q.tp)
        except ValueError as exc:
            raise KVRuleError(str(exc)) from None

    # --- what the engine holds ---------------------------------------------------------------------
    def stored(self, q: KVQuestion) -> KVGeometry:
        """The model's layers as the engine caches them (the plain formula: as the files say)."""
        return q.geometry

    def replicated(self, stored: KVGeometry) -> bool:
        """Whether every rank holds all of a layer's KV (an MLA latent) rather than its share of the heads."""
        return stored.mla is not None

    def layer_bytes_per_token(self, stored: KVGeometry, layer: LayerKV, dtype: str, tp: int) -> float:
        return layer_bytes_per_token(layer, dtype, tp, self.replicated(stored))

    def bytes_per_token(self, q: KVQuestion) -> float:
        """Per GPU, every caching layer, as stored, windows not applied."""
        stored, dtype = self.stored(q), self.resolve_dtype(q)
        layers = self.gpu_layers(stored, q.tp)
        # each distinct layer once (a plan asks this hundreds of times): linear in distinct layers
        counts = stored.layer_counts if layers is stored.layers else Counter(layers)
        return sum(n * self.layer_bytes_per_token(stored, layer, dtype, q.tp) for layer, n in counts.items())

    def gpu_layers(self, stored: KVGeometry, tp: int) -> tuple[LayerKV, ...]:
        """The layers whose KV one GPU holds (tensor parallelism: every layer, a share of its heads)."""
        return stored.layers

    def tokens_kept(self, layer: LayerKV, tokens: int, q: KVQuestion) -> int:
        """Tokens of one sequence the engine holds for ``layer`` before any rounding."""
        return tokens_kept(layer, tokens)

    def answer(self, q: KVQuestion) -> KVAnswer:
        self.check(q)
        stored, dtype = self.stored(q), self.resolve_dtype(q)
        layers = self.gpu_layers(stored, q.tp)
        # each distinct layer asked once (an engine's tokens_kept may read the whole geometry): linear in layers
        total = q.batch * sum(n * self.layer_bytes_per_token(stored, layer, dtype, q.tp) * self.tokens_kept(layer, q.context, q)
                              for layer, n in (stored.layer_counts.items() if layers is stored.layers else Counter(layers).items()))
        full = [layer for layer in layers if layer.kind == "full"]
        windowed = [layer for layer in layers if layer.kind in ("sliding", "chunked")]
        return KVAnswer(self.engine, dtype, total,
                        q.batch * (self.tokens_kept(full[0], q.context, q) if full else q.context),
                        q.batch * self.tokens_kept(windowed[0], q.context, q) if windowed else 0,
                        self.bytes_per_token(q), self.note(q, stored))

    def note(self, q: KVQuestion, stored: KVGeometry) -> str:
        return "formula: tokens x bytes per token, windows and chunks applied"

    def prefix_reuse_unit(self, q: KVQuestion, details: dict | None = None) -> int | None:
        """Tokens a cached prompt prefix is reused in, whole units only (vLLM's block; llama.cpp's slot reuses
        any common prefix: 1); None: the engine keeps no prefix cache. ``details``: the pool the engine
        reported (its real block size)."""
        return None

    def shared_prefix_bytes(self, q: KVQuestion, shared_tokens: int) -> tuple[float, str]:
        """KV one GPU holds for ``q.batch`` sequences of ``q.context`` tokens whose first ``shared_tokens``
        are alike, and how: an engine that shares (:attr:`shares_prefix_kv`) holds the prefix's whole reuse
        units once, every other engine a copy per sequence. Refused (KVRuleError) where it cannot be vouched
        for: a prefix not shorter than the request, layers that keep a window (the prefix falls out of it)."""
        if not 0 < shared_tokens < q.context:
            raise KVRuleError(f"a shared prefix of {shared_tokens} tokens must be shorter than the request "
                              f"({q.context} tokens)")
        alone = self.answer(q).bytes_per_gpu
        if not self.shares_prefix_kv or q.batch == 1:
            return alone, (f"{self.engine}: every sequence holds its own copy of the prefix" if q.batch > 1
                           else "one sequence: nothing to share")
        if any(layer.kind in ("sliding", "chunked") for layer in self.stored(q).layers):
            raise KVRuleError("a shared prefix with sliding-window or chunked layers is not planned: those layers "
                              "drop the prefix's blocks as a sequence passes them")
        unit = self.prefix_reuse_unit(q) or 1
        shared = shared_tokens // unit * unit
        saved = (q.batch - 1) * shared * self.bytes_per_token(q)
        return alone - saved, (f"{self.engine}: the prefix's {shared:,} tokens in whole units of {unit} held once "
                               f"for {q.batch} sequences ({shared_tokens - shared} tokens of a partial unit each)")

    # --- the engine's memory on a GPU at startup ------------------------------------------------------
    def startup_memory(self, q):
        """What the engine gives itself on a GPU and spends before its KV pool (a
        :class:`kvbench.kv.startup.StartupMemory`), read from its source; None where the engine has no such rule
        (the planner then counts its shipped or assumed overhead against a margin)."""
        return None

    def startup_refusal(self, q, mem, available: float, one_request: float, longest: int):
        """The start the engine refuses with ``available`` KV bytes per GPU where one request at the limit needs
        ``one_request`` (``longest``: the longest request that fits): a :class:`kvbench.kv.startup.Refusal`
        in its own words, or None where it starts (or refuses nothing at start)."""
        return None

    # --- a pool the engine reports -----------------------------------------------------------------
    def sequences_in_pool(self, geometry: KVGeometry, pool_tokens: int, context: int, details: dict) -> int | None:
        """How many sequences of ``context`` tokens the engine's reported pool holds at once (None: the
        engine has no pool, or the rule is unknown)."""
        return None

    def pool_bytes_per_token(self, geometry: KVGeometry, dtype: str, details: dict) -> float:
        """Bytes per token of the pool the engine reports in tokens (to compare with a byte figure)."""
        return self.bytes_per_token(KVQuestion(geometry, dtype))


class PlainRules(KVRules):
    """The plain formula (no engine named): every split kvbench plans, written as ``kvbench plan``'s own flags."""

    def pp_flag(self, pp: int) -> str | None:
        return f"--pp {pp}"

    def dp_attention_flag(self, gpus: int) -> str | None:
        return f"--dp {gpus}"


def with_kinds(geom: KVGeometry, kinds: dict[str, str]) -> KVGeometry:
    """``geom`` with layers of one kind stored as another (e.g. {"sliding": "full"}: windows not kept). One
    object per geometry and mapping: an engine's rules ask it on every answer of a plan's search."""
    return _with_kinds(geom, tuple(sorted(kinds.items())))


@functools.lru_cache(maxsize=256)
def _with_kinds(geom: KVGeometry, mapping: tuple[tuple[str, str], ...]) -> KVGeometry:
    kinds = dict(mapping)
    if not any(layer.kind in kinds for layer in geom.layers):
        return geom
    return replace(geom, layers=tuple(replace(layer, kind=kinds.get(layer.kind, layer.kind),
                                              span=None if kinds.get(layer.kind) == "full" else layer.span)
                                      for layer in geom.layers))


@dataclass
class KVCheck:
    """One comparison of the rules with what an engine allocated: equal within the engine's own rounding,
    or not (and why)."""

    engine: str
    case: str
    quantity: str
    predicted: float | None
    engine_reported: float | None  # the engine's own figure (its log, its metrics)
    measured: float | None  # measured by kvbench (cache tensors, block counts)
    tolerance: float  # bytes: what the engine's rounding, or its log's precision, allows
    note: str = ""
    family: str = ""  # the validation family's name; "" for the embedded model
    formula: float | None = None  # the plain formula's answer to the same question, for contrast

    @property
    def observed(self) -> float | None:
        return self.measured if self.measured is not None else self.engine_reported

    @property
    def error_pct(self) -> float | None:
        if self.observed is None or not self.predicted:
            return None
        return (self.observed - self.predicted) / self.predicted * 100

    @property
    def ok(self) -> bool:
        return (self.observed is not None and self.predicted is not None
                and abs(self.observed - self.predicted) <= self.tolerance)

    def row(self) -> dict:
        return {**asdict(self), "error_pct": self.error_pct, "ok": self.ok}
