"""An engine's memory on a GPU as it reaches it at startup: the question an engine's rule is asked and the
ledger it answers with. Pure types; each engine's rule lives beside its adapter (``backends/<engine>/gpumem.py``)
behind :meth:`kvbench.kv.rules.KVRules.startup_memory`. Imports nothing above ``kvbench.kv``.

Every term is a named line with its source (an engine file and version, a public log, or "fitted on ...").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .geometry import KVGeometry
from .rules import KVQuestion


@dataclass(frozen=True)
class ModelWidths:
    """The widths an engine's activation peak and compute buffers scale with (from the model's config)."""

    hidden: int
    intermediate: int  # the dense MLP's width (0: none)
    vocab: int
    heads: int
    experts: int = 0  # routed experts (0: dense)
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @classmethod
    def from_config(cls, text) -> ModelWidths | None:
        """From a transformers text config (or anything with its attribute names); None without a hidden size."""
        get = lambda *names: next((int(v) for n in names if (v := getattr(text, n, None)) is not None  # noqa: E731
                                   and not isinstance(v, (list, dict))), 0)
        hidden = get("hidden_size", "n_embd", "d_model")
        if not hidden:
            return None
        experts = get("num_local_experts", "num_experts", "n_routed_experts")
        return cls(hidden, get("intermediate_size", "ffn_dim", "n_inner"), get("vocab_size"),
                   get("num_attention_heads", "n_head"), experts,
                   get("num_experts_per_tok", "moe_topk", "experts_per_token") if experts else 0,
                   get("moe_intermediate_size", "intermediate_size") if experts else 0)


@dataclass(frozen=True)
class StartupQuestion:
    """One deployment on one GPU kind, as an engine's startup rule needs it."""

    kv: KVQuestion  # the engine's KV question at one request of the limit (geometry, dtype, tp, version, options)
    limit: int  # the per-request limit the server is started with
    gpu: str  # the GPU kind's name
    gpu_bytes: float  # its memory as NVML reports it
    cuda_bytes: float  # its memory as CUDA reports it (torch.cuda.mem_get_info total)
    cuda_source: str
    weights_bytes: float  # per GPU, as kvbench sizes the checkpoint
    widths: ModelWidths | None = None
    batch: int = 1  # requests served at once (the plan's --batch)
    interconnect: str = "nvlink"  # between the tensor-parallel GPUs: "nvlink" or "pcie" (NCCL's buffers differ)

    @property
    def geometry(self) -> KVGeometry:
        return self.kv.geometry

    @property
    def options(self) -> dict:
        return self.kv.options

    @property
    def quant_method(self) -> str:
        return next((f.split("=", 1)[1] for f in self.geometry.flags if f.startswith("quant_method=")), "")


@dataclass(frozen=True)
class StartupTerm:
    """One line of the ledger: bytes per GPU and where the figure comes from."""

    name: str
    bytes: float
    source: str
    fitted: bool = False  # not derivable from the engine's source: fitted on public logs (the source says which)


@dataclass(frozen=True)
class StartupMemory:
    """What an engine gives itself on one GPU and what it spends before its KV pool."""

    engine: str
    label: str  # the engine's name as its users write it ("vLLM")
    fraction: float  # of the CUDA-reported memory (vLLM's gpu_memory_utilization, SGLang's mem_fraction_static)
    fraction_source: str
    cuda_bytes: float
    cuda_source: str
    terms: tuple[StartupTerm, ...]  # what the engine spends besides the KV pool and kvbench's weights figure
    klass: str  # the class of deployment the corpus checks this rule on ("vllm v1 dense", ...)
    verified: bool  # whether the corpus of public startup logs matches this class within its tolerance
    verified_note: str = ""
    notes: tuple[str, ...] = field(default=())
    #: True where the engine gives its KV blocks whatever its budget leaves after its warmup (TGI's
    #: max_batch_total_tokens), though its rules reserve each request's blocks by its limit (no pool_from_budget).
    pool_fills_budget: bool = False

    @property
    def budget_bytes(self) -> float:
        """The memory the engine budgets against: CUDA's total x its fraction."""
        return self.cuda_bytes * self.fraction

    @property
    def overhead_bytes(self) -> float:
        return sum(t.bytes for t in self.terms)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "fraction": self.fraction, "fraction_source": self.fraction_source,
                "cuda_bytes": self.cuda_bytes, "cuda_source": self.cuda_source, "budget_bytes": self.budget_bytes,
                "terms": [{"term": t.name, "bytes": t.bytes, "source": t.source, "fitted": t.fitted}
                          for t in self.terms],
                "overhead_bytes": self.overhead_bytes, "class": self.klass, "verified": self.verified,
                "verified_note": self.verified_note, "notes": list(self.notes),
                "pool_fills_budget": self.pool_fills_budget}


@dataclass(frozen=True)
class Refusal:
    """A start the engine refuses, in its own words, and the change that fixes it."""

    message: str
    fix: str


@dataclass(frozen=True)
class FittedConstant:
    """A constant no engine source states, and how a public startup log measures it: the [logged] figures of
    tests/data/startup_logs/ that measure the ledger term it sits in (``logged``), or, where a log shows no such
    figure, the KV budget's residual (``from_pool``). ``python -m kvbench.selfcheck.startup_fit`` fits each on the
    corpus (the median over its sources), states its range and counts its deployments."""

    key: str  # in the engine module's FITTED
    unit: str  # what the value is in ("GiB", "MiB", "B per request per vocab entry", "x")
    logged: tuple[str, ...] = ()  # [logged] keys that measure its term directly ("non_torch_gib")
    from_pool: bool = False  # also read from the logged KV budget ("kv_gib") where no direct figure is logged
    why: str = ""  # what it stands for, briefly


def read_fitted(path) -> dict[str, dict]:
    """The records of an engine's fitted.toml (kvbench.selfcheck.startup_fit --write): {key: {value, unit, low,
    high, sources, deployments}}."""
    import tomllib
    from pathlib import Path
    return tomllib.loads(Path(path).read_text())


#: A fitted constant held on fewer distinct deployments (source, GPU kind, model) than this is said to be a guess.
MIN_DEPLOYMENTS = 3


def fitted_range(record: dict) -> str:
    """Where a fitted constant comes from, for its ledger line: its sources, deployments and range."""
    sources, unit = record.get("sources", []), record.get("unit", "")
    if not sources:
        return "no public log measures it"
    span = (f"{record['low']:g}-{record['high']:g} {unit}" if record.get("high") != record.get("low")
            else f"{record['low']:g} {unit}")
    few = (f"; fewer than {MIN_DEPLOYMENTS} deployments: unverified beyond them"
           if record["deployments"] < MIN_DEPLOYMENTS else "")
    return (f"the median of {len(sources)} source{'s' * (len(sources) != 1)} ({record['deployments']} deployment"
            f"{'s' * (record['deployments'] != 1)}), range {span}{few}")
