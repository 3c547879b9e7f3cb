"""The table's columns, in the articles' order: each a class that owns its settings and registers itself.

A column is a pydantic model of its own settings (``--set KEY.SETTING=VALUE`` on the command line) with
``configs``: the engine configurations it runs (:class:`Config`: an engine, a KV dtype, engine options, and
how room for a batch is asked of it), built from the columns before it (the optimisations stack). Its
``kind`` says what it measures:

- ``capacity``: a ladder of batches against the wall (the most requests of N tokens held at once, what the
  largest batch's start accepted as one request, its throughput, TTFT and ITL);
- ``arrivals``: one set of arrivals (mixed output lengths) on a configuration and its ``baseline`` (the same
  engine scheduling statically);
- ``speculation``: a drafter against none on the same prompts (a copied passage a drafter can guess).

Adding a column = one class here (its ``key``, ``title``, settings and ``configs``); defining it registers it
after the others, and the run, the table and the plot ask the registry. What differs between engines is
data (:data:`ENGINE_BASE`, :data:`STATIC_CONFIG`, :data:`POOL_CONFIG`, :data:`STATIC_SCHEDULING`) or a
question to the engine's KV rules and capabilities (its 8- and 4-bit KV dtypes, whether it shares a prefix's
KV, which drafters it has): nothing here branches on an engine's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvbench.backends import REGISTRY, kv_rules
from kvbench.kv.geometry import UnknownKVDtype, dtype_bytes

_REGISTERED: dict[str, type[Column]] = {}


def registered() -> dict[str, type[Column]]:
    """Every column, in the order the articles add them (the order their classes are defined)."""
    return dict(_REGISTERED)


def merge_options(*parts: dict) -> dict:
    """Engine options together; ``extra_args`` (free-form server flags) joined rather than replaced."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = f"{out[key]} {value}".strip() if key == "extra_args" and key in out else value
    return out


@dataclass(frozen=True)
class Config:
    """One engine configuration: what ``kvbench run -b ENGINE:OPTIONS --kv-dtype D`` would start, and how room
    for a batch of B requests of N tokens is asked of it (a :class:`kvbench.backends.types.ServerSpec`)."""

    engine: str
    label: str  # what a reader is told it is, e.g. "llama.cpp: one unified cache the slots share"
    kv_dtype: str = "auto"
    options: dict = field(default_factory=dict, hash=False, compare=False)  # engine options (-b ENGINE:KEY=VALUE)
    plan_options: dict = field(default_factory=dict, hash=False, compare=False)  # the KV rules' (plan --engine-option)
    #: one pool a request may take whole (paged blocks): room for B requests is one sequence of B x N tokens,
    #: the per-request limit the pool (capped at the model's); False: B slots of ``reserve`` (or N) tokens each
    pool: bool = False
    reserve: int | None = None  # tokens each slot is started with (the per-request limit); None: the request's N
    prefix_tokens: int = 0  # tokens every request of a batch starts with alike (0: none)
    prefix_caching: bool = False
    key: str = ""  # a short id, unique in a run (file names, trials.jsonl)

    def with_(self, **changes) -> Config:
        return replace(self, **changes)

    @property
    def all_options(self) -> dict:
        """The engine options with what every configuration of this engine runs with (:data:`ENGINE_BASE`)."""
        return merge_options(ENGINE_BASE.get(self.engine, ({}, {}))[0], self.options)

    @property
    def all_plan_options(self) -> dict:
        return {**ENGINE_BASE.get(self.engine, ({}, {}))[1], **self.plan_options}


#: What every configuration of an engine runs with: (engine options, the KV rules' options for the planner).
#:
#: - llama.cpp: its prompt cache (8 GiB of host memory by default) would grow with the traffic inside the wall:
#:   off, as in the memory-wall runs. Its weights are read into its own memory, not repacked (--load-mode none
#:   --no-repack), as transformers' and vLLM's are: mapped (its default), they are file pages the kernel takes
#:   back at the wall and reads again on the next touch, so a batch over the budget thrashed rather than
#:   failed (two 2,048-token slots, 90 MiB of KV, "ran" in a 48 MiB budget); read and repacked, the repacking's
#:   copy peaks at start beside them. Without repacking its prefill ran about 25 % slower here.
#: - transformers: the worker waits up to 10 s to fill a batch (a full batch starts at once), so that a batch
#:   sent together is one batch on a loaded machine.
#: - vLLM on a CPU reserves nothing for its activations at start (no profile run sizes them) and allocates them
#:   per step, for up to --max-num-batched-tokens tokens (by default the limit): a prefill step of a whole batch
#:   then needs more than a small budget beside the pool (a batch of 7 x 224 tokens was killed in a 48 MiB
#:   budget whose pool held it). Steps of 256 tokens bound them near what its calibration used, as llama.cpp's
#:   compute buffer is bounded by its n_ubatch (512) and allocated at start.
ENGINE_BASE: dict[str, tuple[dict, dict]] = {
    "llamacpp": ({"extra_args": "--cache-ram 0 --load-mode none --no-repack"}, {"cache_ram_mib": 0}),
    "hf": ({"batch_wait_ms": 10_000}, {}),
    "vllm": ({"extra_args": "--max-num-batched-tokens 256"}, {}),
}

#: "No optimisation": static batching with a contiguous cache, per engine that has one to start.
#: ``reserve=None`` is filled with the scale's limit where the configuration reserves it per slot.
STATIC_CONFIG: dict[str, Config] = {
    "hf": Config("hf", "transformers: one static batch, its cache grown to the batch's tokens", key="hf-static"),
    "llamacpp": Config("llamacpp", "llama.cpp: a slot per request, each reserving the per-request limit "
                                   "(-np B, no unified cache)", key="llamacpp-slots", reserve=-1),
}

#: "+ paged KV": a pool the requests draw from as they grow, per engine that has one.
POOL_CONFIG: dict[str, Config] = {
    "vllm": Config("vllm", "vLLM: paged blocks, a request takes the blocks it fills", pool=True, key="vllm-paged"),
    "llamacpp": Config("llamacpp", "llama.cpp: one unified cache the slots share (--kv-unified)",
                       options={"extra_args": "--kv-unified"}, plan_options={"unified": True}, key="llamacpp-unified"),
}

#: The engine options that make an engine schedule statically: a new batch only once every request of the
#: running one has ended (llama-server's --no-cont-batching: a prompt is batched only when nothing is decoding).
STATIC_SCHEDULING: dict[str, dict] = {
    "llamacpp": {"extra_args": "--no-cont-batching"},
}


def kv_dtype_of_width(engine: str, low: float, high: float) -> str | None:
    """The engine's first quantised KV dtype whose bytes per value lie in [low, high) (its rules' order:
    llama.cpp q8_0 before q4_0, vLLM fp8), or None where it takes none."""
    rules = kv_rules(engine)
    for own in (rules.quantised_kv_dtypes() if rules else []):
        try:
            if low <= dtype_bytes(own) < high:
                return own
        except UnknownKVDtype:  # a format of the engine's own (transformers' quanto): no plain width
            continue
    return None


class Column(BaseModel):
    """One column of the table. Subclasses set ``key`` (``--columns``, ``--set KEY.X=...``), ``title`` (the
    table's heading), ``adds`` (one line: what it adds to the column before) and ``kind``; their fields are
    their settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: ClassVar[str] = ""
    title: ClassVar[str] = ""
    adds: ClassVar[str] = ""
    kind: ClassVar[str] = "capacity"  # "capacity", "arrivals" or "speculation"

    engines: list[str] | None = None  # None: every engine of the run it has a configuration for

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.key:
            _REGISTERED[cls.key] = cls

    def configs(self, scale: Scale, before: dict[str, list[Config]]) -> list[Config]:
        """The configurations this column runs, given the scale and the configurations of every column before
        it (by key), each with a unique ``key``."""
        raise NotImplementedError

    def baseline(self, config: Config) -> Config | None:
        """An ``arrivals`` or ``speculation`` column: the configuration ``config`` is measured against."""
        return None

    def skipped(self, scale: Scale, before: dict[str, list[Config]]) -> dict[str, str]:
        """Engines of the run this column has no configuration for, and why (a cell's text)."""
        configs = self.configs(scale, before)
        have = {c.engine for c in configs} | {b.engine for b in map(self.baseline, configs) if b}
        return {e: self.why_not(e) for e in scale.engines if e not in have and self._wanted(e)}

    def why_not(self, engine: str) -> str:
        return "no such configuration"

    def _wanted(self, engine: str) -> bool:
        return self.engines is None or engine in self.engines

    def _take(self, configs, scale: Scale) -> list[Config]:
        return [c for c in configs if c.engine in scale.engines and self._wanted(c.engine)]


@dataclass(frozen=True)
class Scale:
    """What every column shares: the model, the budget, the requests' length and the per-request limit."""

    model: str  # as `kvbench run --model` takes it ("smollm2": the embedded model)
    engines: tuple[str, ...]
    budget_bytes: int  # memory for requests above each engine's idle footprint (its wall: idle + budget)
    request_tokens: int  # N: prompt + output of the capacity columns' requests
    output_tokens: int
    limit: int  # the per-request limit a contiguous configuration reserves for every slot
    model_limit: int  # the model's own context limit (a pool's per-request limit is capped at it)

    @property
    def prompt_tokens(self) -> int:
        return self.request_tokens - self.output_tokens


class Static(Column):
    key: ClassVar[str] = "static"
    title: ClassVar[str] = "static batching, contiguous cache"
    adds: ClassVar[str] = "no optimisation: a batch served together, each request's cache its own contiguous room"

    def configs(self, scale, before):
        out = []
        for c in self._take(STATIC_CONFIG.values(), scale):
            out.append(c.with_(reserve=scale.limit) if c.reserve == -1 else c)
        return out

    def why_not(self, engine):
        return "no contiguous per-request cache to start (its pool is paged)"


class Paged(Column):
    key: ClassVar[str] = "paged"
    title: ClassVar[str] = "+ paged KV"
    adds: ClassVar[str] = "a pool the requests take from as they grow, not a room per request at the limit"

    def configs(self, scale, before):
        return self._take(POOL_CONFIG.values(), scale)

    def why_not(self, engine):
        return "no paged or shared pool (static batching)"


class _QuantisedKV(Column):
    """The paged configurations with a smaller KV dtype, where the engine's rules take one of this width."""

    low: ClassVar[float] = 0.0
    high: ClassVar[float] = 0.0
    bits: ClassVar[str] = ""

    def configs(self, scale, before):
        out = []
        for c in self._take(before.get("paged", []), scale):
            dtype = kv_dtype_of_width(c.engine, self.low, self.high)
            if dtype:
                out.append(c.with_(kv_dtype=dtype, key=f"{c.key}-{dtype}", label=f"{c.label}, KV {dtype}"))
        return out

    def why_not(self, engine):
        rules = kv_rules(engine)
        takes = ", ".join(rules.quantised_kv_dtypes()) if rules else ""
        return f"no {self.bits} KV dtype" + (f" (it takes {takes})" if takes else "")


class KV8(_QuantisedKV):
    key: ClassVar[str] = "kv8"
    title: ClassVar[str] = "+ 8-bit KV"
    adds: ClassVar[str] = "the paged pool's KV stored in 8 bits (vLLM fp8, llama.cpp q8_0)"
    low, high, bits = 1.0, 2.0, "8-bit"


class KV4(_QuantisedKV):
    key: ClassVar[str] = "kv4"
    title: ClassVar[str] = "+ 4-bit KV"
    adds: ClassVar[str] = "the paged pool's KV in 4 bits, where the engine has it (llama.cpp q4_0)"
    low, high, bits = 0.5, 1.0, "4-bit"


def smallest_kv(engine: str, before: dict[str, list[Config]]) -> Config | None:
    """An engine's configuration with its smallest KV so far: the 4-bit column's, else the 8-bit, else paged."""
    for key in ("kv4", "kv8", "paged"):
        for c in before.get(key, []):
            if c.engine == engine:
                return c
    return None


class ContinuousBatching(Column):
    key: ClassVar[str] = "continuous"
    title: ClassVar[str] = "+ continuous batching"
    adds: ClassVar[str] = ("a request joins the running batch when another ends, against a static schedule "
                           "of the same engine under the same arrivals")
    kind: ClassVar[str] = "arrivals"

    concurrency: int = Field(default=8, gt=0)  # slots (requests served at once)
    requests: int = Field(default=24, gt=0)  # sent together: the engine queues what its slots cannot take
    output_mix: list[int] = Field(default_factory=lambda: [8, 64, 16, 32])  # output tokens, request i takes i mod len

    def configs(self, scale, before):
        out = []
        for engine in scale.engines:
            c = smallest_kv(engine, before)
            if c is not None and engine in STATIC_SCHEDULING and self._wanted(engine):
                out.append(c.with_(key=f"{c.key}-cb", label=f"{c.label}; continuous batching"))
        return out

    def baseline(self, config):
        static = merge_options(config.options, STATIC_SCHEDULING[config.engine])
        return config.with_(options=static, key=config.key.removesuffix("-cb") + "-static",
                            label=config.label.replace("continuous batching", "static batching"))

    def why_not(self, engine):
        return "no static schedule to set beside its continuous one" if engine in POOL_CONFIG else \
            "static batching only"


class PrefixSharing(Column):
    key: ClassVar[str] = "prefix"
    title: ClassVar[str] = "+ prefix sharing"
    adds: ClassVar[str] = "requests that start alike hold one copy of their common prefix's KV"

    prefix_tokens: int = Field(default=128, gt=0)  # of each request's prompt

    def configs(self, scale, before):
        out = []
        for engine in scale.engines:
            rules = kv_rules(engine)
            c = smallest_kv(engine, before)
            if c is not None and rules is not None and rules.shares_prefix_kv and self._wanted(engine):
                out.append(c.with_(prefix_tokens=self.prefix_tokens, prefix_caching=True, key=f"{c.key}-prefix",
                                   label=f"{c.label}; the first {self.prefix_tokens} tokens shared, prefix caching on"))
        return out

    def why_not(self, engine):
        return "every request holds its own copy of a prefix (its KV rules: no shared prefix KV)"


class Speculation(Column):
    key: ClassVar[str] = "speculation"
    title: ClassVar[str] = "+ speculation"
    adds: ClassVar[str] = ("a drafter proposes tokens the model checks in one pass (no weights or KV of its own "
                           "for ngram)")
    kind: ClassVar[str] = "speculation"

    method: str = "ngram"
    concurrency: int = Field(default=1, gt=0)
    requests: int = Field(default=3, gt=0)
    output_tokens: int = Field(default=64, gt=0)

    def configs(self, scale, before):
        out = []
        for engine in scale.engines:
            c = smallest_kv(engine, before)
            drafters = REGISTRY[engine].capabilities.speculation.methods
            if c is not None and self.method in drafters and self._wanted(engine):
                spec = merge_options(c.options, {"speculative": self.method})
                out.append(c.with_(options=spec, key=f"{c.key}-{self.method}",
                                   label=f"{c.label}; {self.method} drafts"))
        return out

    def baseline(self, config):
        options = {k: v for k, v in config.options.items() if k != "speculative"}
        return config.with_(options=options, key=config.key.removesuffix(f"-{self.method}") + "-nodraft",
                            label=config.label.replace(f"; {self.method} drafts", "; no drafter"))

    def why_not(self, engine):
        return f"no {self.method} drafter"
