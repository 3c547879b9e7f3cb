"""One deployment, resolved: the engine's rules, the KV dtype, the split, the per-request limit the server
is started with and the typical request of the traffic, the weights as the engine holds them, and the GPU.
:class:`Setup` answers what a deployment needs per GPU and what it can serve; the levers vary it."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from kvbench.kv.geometry import KVGeometry, UnevenSplit, cdiv, dtype_bytes, pipeline_stage
from kvbench.kv.rules import KVAnswer, KVQuestion, KVRuleError, KVRules
from kvbench.kv.units import GIB, fmt_gib
from kvbench.kv.weights import Weights

from .overhead import default_overhead
from .drafter import Drafter
from .resolve import ModelForPlan, served_weights
from kvbench.kv.startup import StartupMemory, StartupQuestion, StartupTerm

from .shared import GPU, NODE_GPUS, PlanError, engine_rules, gpu

MARGIN = 0.10  # of the GPU kept free where neither --margin nor an engine's startup rule says


@dataclass(frozen=True)
class PlanInput:
    model: ModelForPlan
    context: int | None = None  # the typical request's tokens (prompt + output); None: the limit
    batch: int = 1  # requests served at once
    kv_dtype: str = "auto"  # "auto": the engine's default for the model (see KVRules.auto_dtype)
    tp: int = 1
    pp: int = 1  # pipeline stages, each on its own GPUs (its layers' weights and KV)
    dp: int = 1  # data-parallel attention ranks of an MLA model (each holds its own requests' KV)
    engine: str | None = None  # None: the plain formula
    gpu: str | None = None
    overhead_gib: float | None = None  # per GPU; None: the shipped measurement for the engine and device, else 1.5
    overhead_source: str = "given"  # where overhead_gib came from
    overhead_per_token_bytes: float = 0.0  # with overhead_gib: activations per token in flight (batch x tokens)
    margin: float | None = None  # fraction of the GPU kept free; None: the engine's own startup rule on a GPU
    # (its fraction of what CUDA reports, KVRules.startup_memory), else MARGIN
    block_size: int | None = None
    device: str = "gpu"  # engines size some things per device (vLLM's block size)
    engine_version: str | None = None
    engine_options: dict = field(default_factory=dict)
    allow_long_context: bool = False  # plan a limit past the model's own
    max_model_len: int | None = None  # the per-request limit the server is started with; None: the model's
    node_gpus: int = NODE_GPUS  # the most GPUs the tensor-parallel lever proposes
    memory: float | None = None  # bytes of a CPU memory wall (the engine's process tree in a cgroup), not a GPU
    shared_prefix: int | None = None  # tokens every request of the batch starts with alike (--shared-prefix)
    cpu_features: tuple[str, ...] | None = None  # device cpu: the CPU's flags; None: this machine's
    interconnect: str | None = None  # between the GPUs, "nvlink" or "pcie"; None: the GPU kind's (gpus.toml)
    speculative: str | None = None  # the drafter's method (kvbench.kv.speculative.METHODS); None: no speculation
    draft_model: ModelForPlan | None = None  # --draft-model, resolved
    speculative_tokens: int | None = None
    draft_label: str = ""  # --draft-model as given


@dataclass(frozen=True)
class Outcome:
    """What a deployment gives on its GPU (None throughout where the weights are unknown)."""

    fits: bool | None
    needed: float | None  # bytes per GPU: weights + KV + overhead
    kv: float  # the deployment's KV per GPU (pool extras included)
    headroom: float | None  # usable - needed, per GPU (negative: short by)
    headroom_pct: float | None  # of the usable memory
    max_concurrency: int | None  # requests of the typical length at once
    longest_request: int | None  # tokens per request at the asked concurrency, server limit set to it
    weights_exceed: bool = False  # the weights (and overhead) alone exceed the usable memory

    def result(self) -> dict:
        return {"fits": self.fits, "needed_bytes_per_gpu": self.needed, "kv_bytes_per_gpu": self.kv,
                "headroom_bytes": self.headroom, "headroom_pct": self.headroom_pct,
                "max_concurrency": self.max_concurrency, "longest_request": self.longest_request,
                "weights_exceed": self.weights_exceed}


def _largest(fits, low: int, high: int) -> int:
    """Largest n in [low, high] with fits(n) true (fits monotone decreasing), low - 1 if none."""
    if high < low or not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class Setup(Drafter):
    model: ModelForPlan
    rules: KVRules
    engine: str | None
    kv_dtype: str
    tp: int
    context: int  # the typical request
    batch: int
    limit: int  # the per-request limit the server is started with
    limit_source: str  # "the model's (...)", "--max-model-len", "past the model's ..."
    weights: Weights  # as the engine holds them, all GPUs
    overhead_fixed: float  # bytes per GPU
    overhead_per_token: float  # bytes per token in flight (an engine whose activations grow with the batch)
    overhead_source: str
    margin: float
    gpu: GPU | None
    block_size: int | None = None
    device: str = "gpu"
    version: str | None = None
    options: dict = field(default_factory=dict)
    node_gpus: int = NODE_GPUS
    overhead_default: bool = False  # the overhead is the engine's shipped measurement (or the assumption)
    startup_rule: bool = False  # the engine's own memory at startup (KVRules.startup_memory) replaces margin + overhead
    margin_default: bool = False  # no --margin given
    cpu_features: tuple[str, ...] = ()
    pp: int = 1  # pipeline stages (PlanInput.pp)
    dp: int = 1  # data-parallel attention ranks (PlanInput.dp)
    interconnect: str | None = None  # PlanInput.interconnect
    spec_method: str | None = None  # PlanInput.speculative
    draft_model: ModelForPlan | None = None
    spec_tokens: int | None = None
    draft_label: str = ""

    @property
    def geometry(self) -> KVGeometry:
        return self.model.geometry

    @property
    def gpus(self) -> int:
        """The GPUs the deployment takes: tensor parallel x pipeline stages x data-parallel attention ranks."""
        return self.tp * self.pp * self.dp

    @property
    def per_rank_batch(self) -> int:
        """Requests one GPU holds the KV of: the batch, or its share on each data-parallel attention rank."""
        return cdiv(self.batch, self.dp)

    @property
    def capability(self) -> tuple[int, int] | None:
        return self.gpu.capability if self.gpu else None

    @property
    def usable(self) -> float | None:
        if self.gpu is None:
            return None
        mem = self.startup
        return mem.budget_bytes if mem is not None else self.gpu.bytes * (1 - self.margin)

    @property
    def kept_free(self) -> float:
        """Bytes per GPU the deployment leaves free: the margin, or what the engine's fraction leaves."""
        return self.gpu.bytes - self.usable if self.gpu is not None else 0.0

    def startup_question(self) -> StartupQuestion | None:
        if self.gpu is None or self.gpu.wall or self.weights_per_gpu is None:
            return None
        cuda, source = self.gpu.cuda_memory()
        link = self.interconnect or self.gpu.interconnect
        return StartupQuestion(self.question(context=self.limit, batch=1), self.limit, self.gpu.name, self.gpu.bytes,
                               cuda, source, self.weights_per_gpu, self.model.widths, self.per_rank_batch,
                               "pcie" if link == "pcie" else "nvlink")

    @functools.cached_property  # read by every need() of a search: once per deployment (frozen: fields never change)
    def startup(self) -> StartupMemory | None:
        """The engine's memory at startup on this GPU (its rule, read from its source), where it applies. An overhead
        given (--overhead-gib) or measured by a run (--overhead-from) stands for the rule's own terms beside the
        weights and the KV (what it measures: all the engine holds besides them); the engine's share stays."""
        if not self.startup_rule:
            return None
        q = self.startup_question()
        mem = self.rules.startup_memory(q) if q is not None else None
        if mem is not None and not self.margin_default and self.rules.fraction_option is None:
            # an engine with no share of the GPU (it allocates what it needs): --margin is kept free beside it
            mem = replace(mem, fraction=1 - self.margin,
                          fraction_source=f"--margin {self.margin:g}: kept free beside what {mem.label} allocates")
        if mem is None or self.overhead_default:
            return mem
        given = StartupTerm("overhead given", self.overhead_fixed, self.overhead_source)
        return replace(mem, terms=(*(t for t in mem.terms if t.name == "weights as loaded"), given))

    @property
    def fixed_overhead(self) -> float:
        mem = self.startup
        return (mem.overhead_bytes if mem is not None else self.overhead_fixed) + self.spec_fixed

    def question(self, context: int | None = None, batch: int | None = None) -> KVQuestion:
        """One GPU's KV question: its pipeline stage's layers, its data-parallel rank's share of the batch."""
        return KVQuestion(pipeline_stage(self.geometry, self.pp), self.kv_dtype, context or self.context,
                          cdiv(batch or self.batch, self.dp), self.tp, self.block_size, self.device, self.version,
                          dict(self.options), self.capability, self.cpu_features)

    def typical(self) -> KVAnswer:
        """The KV of the batch at its typical length alone (no limit reserved): the plain KV answer."""
        try:
            return self.rules.answer(self.question())
        except KVRuleError as exc:
            raise PlanError(str(exc)) from None

    def kv(self, context: int | None = None, batch: int | None = None, limit: int | None = None) -> KVAnswer:
        """The KV one GPU holds for the deployment (the engine's :meth:`KVRules.deployment`)."""
        try:
            return self.rules.deployment(self.question(context, batch), limit or self.limit)
        except KVRuleError as exc:
            raise PlanError(str(exc)) from None

    def kv_bytes(self, context: int | None = None, batch: int | None = None, limit: int | None = None) -> float:
        """The deployment's KV per GPU, the drafter's included."""
        a = self.kv(context, batch, limit)
        d = self.draft(context, batch, limit)
        return a.bytes_per_gpu + a.pool_extra_bytes + (d.bytes_per_gpu if d is not None else 0.0)

    def overhead_at(self, context: int | None = None, batch: int | None = None) -> float:
        mem = self.startup
        if mem is not None:
            return mem.overhead_bytes + self.spec_fixed
        return (self.overhead_fixed + self.overhead_per_token * (context or self.context) * (batch or self.batch)
                + self.spec_fixed)

    @property
    def overhead(self) -> float:
        """The overhead at the asked deployment (the fixed part alone where none grows with the batch)."""
        return self.overhead_at()

    def host(self, context: int | None = None, batch: int | None = None) -> list[tuple[str, float, str]]:
        """Host memory the engine holds beyond its pool (its rules' ``host_memory``: (term, bytes, source) each),
        counted against a CPU's memory only."""
        if self.device != "cpu":
            return []
        try:
            return self.rules.host_memory(self.question(context, batch))
        except KVRuleError as exc:
            raise PlanError(str(exc)) from None

    def host_bytes(self, context: int | None = None, batch: int | None = None) -> float:
        return sum(b for _, b, _ in self.host(context, batch))

    @property
    def per(self) -> str:
        """Where the figures are: per GPU, or in a CPU memory wall."""
        return "in the wall" if self.gpu is not None and self.gpu.wall else "per GPU"

    @property
    def weights_per_gpu(self) -> float | None:
        """The weights on one GPU: split over the tensor-parallel ranks and the pipeline's stages (evenly: the
        first and last stages' embeddings and LM head not set apart); with data-parallel attention, the routed
        experts split over every GPU and the rest whole on each (an upper bound where the engine splits more)."""
        if self.weights.bytes is None:
            return None
        split = self.tp * self.pp
        if self.dp == 1:
            return self.weights.bytes / split
        share = self.expert_share
        return self.weights.bytes * ((1 - share) / split + share / (split * self.dp))

    @property
    def expert_share(self) -> float:
        share = self.model.expert_share() if self.model.expert_share is not None else None
        if share is None:
            raise PlanError("--dp: the routed experts' share of the weights is unknown for this model (its config "
                            "count failed): data-parallel attention cannot be sized")
        return share

    def need(self, context: int | None = None, batch: int | None = None, limit: int | None = None) -> float:
        return (self.weights_per_gpu + self.kv_bytes(context, batch, limit) + self.overhead_at(context, batch)
                + self.host_bytes(context, batch))

    def fits(self, context: int | None = None, batch: int | None = None, limit: int | None = None) -> bool:
        return self.need(context, batch, limit) <= self.usable

    def max_concurrency(self) -> int:
        """Requests of the typical length served at once, on a server started with the limit."""
        return max(0, _largest(lambda b: self.fits(batch=b), 1, 1 << 20))

    def longest_request(self) -> int:
        """The longest request the asked concurrency can run at once: the largest L (up to the limit) such
        that a server started with a limit of L holds ``batch`` requests of L."""
        return max(0, _largest(lambda n: self.fits(context=n, limit=n), 1, self.limit))

    def outcome(self) -> Outcome:
        kv = self.kv_bytes()
        if self.gpu is None or self.weights.bytes is None:
            return Outcome(None, None, kv, None, None, None, None)
        usable = self.usable
        need = self.need()
        exceed = self.weights_per_gpu + self.fixed_overhead + self.host_bytes() >= usable
        if exceed:
            return Outcome(False, need, kv, usable - need, (usable - need) / usable, 0, 0, True)
        return Outcome(need <= usable, need, kv, usable - need, (usable - need) / usable, self.max_concurrency(),
                       self.longest_request())

    def resolved_kv_dtype(self) -> str:
        try:
            return self.rules.resolve_dtype(self.question())
        except KVRuleError as exc:
            raise PlanError(str(exc)) from None

    def kv_dtype_bytes(self) -> float:
        return dtype_bytes(self.resolved_kv_dtype())

    def kv_dtype_note(self) -> str:
        """Where the KV dtype came from."""
        if self.kv_dtype.lower() != "auto":
            return f"--kv-dtype {self.kv_dtype}"
        if self.rules.checkpoint_kv_dtype(self.geometry):
            return "auto: the checkpoint's quantization_config declares an fp8 KV cache"
        dtype = self.resolved_kv_dtype()
        if dtype == self.rules.serving_dtype(self.geometry, self.capability):
            return f"auto, the model dtype: {self.rules.serving_note(self.geometry, self.capability)}"
        return f"auto: {self.rules.engine}'s default KV dtype"


def setup(p: PlanInput) -> Setup:
    """The deployment ``p`` describes, checked (one-line PlanErrors)."""
    if p.batch < 1 or (p.context is not None and p.context < 1):
        raise PlanError("--context and --batch must be >= 1")
    if p.max_model_len is not None and p.max_model_len < 1:
        raise PlanError(f"--max-model-len must be >= 1, not {p.max_model_len}")
    if p.margin is not None and not 0 <= p.margin < 1:
        raise PlanError(f"--margin is the fraction of the GPU kept free: from 0 to below 1, not {p.margin}")
    if p.overhead_gib is not None and p.overhead_gib < 0:
        raise PlanError(f"--overhead-gib must be >= 0, not {p.overhead_gib}")
    if p.gpu and p.memory is not None:
        raise PlanError("--gpu and --memory: give one (a GPU, or a CPU memory wall)")
    if p.memory is not None and p.device != "cpu":
        raise PlanError("--memory is a CPU memory wall (the engine's process tree in a cgroup): not with --device gpu")
    if p.tp < 1:
        raise PlanError(f"--tp must be >= 1, not {p.tp}")
    if p.pp < 1 or p.dp < 1:
        raise PlanError(f"--pp and --dp must be >= 1, not {p.pp if p.pp < 1 else p.dp}")
    if p.device not in ("gpu", "cpu"):
        raise PlanError(f"--device is gpu or cpu, not {p.device!r}")
    if p.interconnect not in (None, "nvlink", "pcie"):
        raise PlanError(f"--interconnect is nvlink or pcie, not {p.interconnect!r}")
    rules = engine_rules(p.engine)
    geom = p.model.geometry
    model_limit = geom.max_context
    why = next((n for n in geom.notes if n.startswith("the model's limit")), None)
    field_name = "context_length (GGUF)" if geom.source == "gguf" else "max_position_embeddings"
    model_label = f"the model's: {why.split(': ', 1)[1]}" if why else f"the model's: {field_name}"
    if p.max_model_len is not None:
        limit, source = p.max_model_len, "--max-model-len"
        if model_limit and limit > model_limit and not p.allow_long_context:
            raise PlanError(f"--max-model-len {limit:,} exceeds the model's limit of {model_limit:,} "
                            f"({model_label.split(': ', 1)[1]}); --allow-long-context plans it anyway")
        if p.context is not None and p.context > limit:
            raise PlanError(f"a typical request (--context) of {p.context:,} tokens is longer than the "
                            f"--max-model-len {limit:,} the server accepts")
    elif model_limit:
        limit, source = model_limit, model_label
        if p.context is not None and p.context > model_limit:
            if not p.allow_long_context:
                raise PlanError(f"a context of {p.context:,} tokens exceeds the model's limit of {model_limit:,} "
                                f"({model_label.split(': ', 1)[1]}); --allow-long-context plans it anyway")
            limit, source = p.context, f"the --context, past the model's {model_limit:,} (--allow-long-context)"
    elif p.context is not None:
        limit, source = p.context, "the --context (the config names no limit)"
    else:
        raise PlanError("the config names no context limit (max_position_embeddings): give --context or "
                        "--max-model-len")
    if model_limit and limit > model_limit and source == "--max-model-len":
        source = f"--max-model-len, past the model's {model_limit:,} (--allow-long-context)"
    g = gpu(p.gpu) if p.gpu else None
    if p.memory is not None:
        if p.memory <= 0:
            raise PlanError(f"--memory must be positive, not {p.memory}")
        g = GPU(f"a {fmt_gib(p.memory)} memory wall", int(p.memory), None, wall=True)
    if max(p.tp, p.pp, p.dp) > 1 and g is not None and g.wall:
        raise PlanError("--tp, --pp and --dp split a model over GPUs: a CPU memory wall has none")
    check_layout(rules, p.model, p.pp, p.dp)
    # one planner: an engine with a startup rule on a GPU is planned by it, whatever else is given (--margin is
    # said in its own terms below, an overhead given is one more of its terms)
    rules_startup = p.device == "gpu" and g is not None and not g.wall and p.engine is not None
    if p.overhead_gib is None:
        o = default_overhead(p.engine, p.device)
        fixed, per_token, why = o.fixed_bytes, o.per_token_bytes, o.for_model(p.model.name)
    else:
        fixed, per_token, why = p.overhead_gib * GIB, p.overhead_per_token_bytes, p.overhead_source
    margin = p.margin if p.margin is not None else (0.0 if g is not None and g.wall else MARGIN)
    if p.device == "cpu" and p.cpu_features is None:
        from kvbench.common.hardware import cpu_flags  # psutil: only a CPU plan reads this machine's flags
        p = replace(p, cpu_features=tuple(cpu_flags()))
    s = Setup(p.model, rules, p.engine, p.kv_dtype, p.tp, p.context or limit, p.batch, limit, source,
              served_weights(p.model, rules, g.capability if g else None), fixed, per_token, why, margin, g,
              p.block_size, p.device, p.engine_version, dict(p.engine_options), p.node_gpus, p.overhead_gib is None,
              startup_rule=rules_startup, margin_default=p.margin is None,
              cpu_features=p.cpu_features if p.device == "cpu" else (), pp=p.pp, dp=p.dp, interconnect=p.interconnect,
              spec_method=p.speculative, draft_model=p.draft_model, spec_tokens=p.speculative_tokens,
              draft_label=p.draft_label)
    if s.speculation is not None and max(p.pp, p.dp) > 1:
        raise PlanError("--speculative with --pp or --dp is not planned (where a drafter's layers sit across "
                        "pipeline stages or data-parallel ranks is each engine's own)")
    # the engine's own rule where it has one (KVRules.startup_memory), else the margin and the overhead
    if s.startup is None:
        return replace(s, startup_rule=False)
    if p.margin is not None:
        s = replace(s, options=margin_as_option(rules, s.startup.label, p.margin, s.options))
    return s


def margin_as_option(rules: KVRules, label: str, margin: float, options: dict) -> dict:
    """--margin said in the engine's own terms: its share of the GPU (KVRules.fraction_option) at 1 - margin; the
    same share given both ways is one answer, two different ones are refused. An engine with no share keeps its
    options."""
    key = rules.fraction_option
    if key is None:  # no share to set: the margin is kept free beside what the engine allocates (Setup.startup)
        return options
    share = round(1 - margin, 6)
    if key in options and abs(float(options[key]) - share) > 1e-9:
        raise PlanError(f"--margin {margin:g} is --engine-option {key}={share:g}, not the {options[key]} also given: "
                        "give one")
    return {**options, key: share}


def check_layout(rules: KVRules, model: ModelForPlan, pp: int, dp: int) -> None:
    """A pipeline or data-parallel attention the engine has, for a model it applies to (one-line PlanErrors)."""
    name = rules.engine if rules.engine != "exact" else "the plain formula"
    if pp > 1:
        if rules.pp_flag(pp) is None:
            raise PlanError(f"--pp: {name} has no pipeline parallel kvbench plans")
        try:
            pipeline_stage(model.geometry, pp)
        except UnevenSplit as exc:
            raise PlanError(f"--pp: {exc}") from None
    if dp > 1:
        if rules.dp_attention_flag(dp) is None:
            raise PlanError(f"--dp: {name} has no data-parallel attention kvbench plans")
        if model.geometry.mla is None:
            raise PlanError("--dp: data-parallel attention is planned for MLA models (their latent KV is replicated on "
                            "every tensor-parallel rank); this model has none")


def with_engine(s: Setup, engine: str, engine_options: dict | None = None) -> Setup:
    """The same deployment under another engine's rules (its own auto dtypes and served weights), with
    ``engine_options`` its own (--engine-option ENGINE:KEY=VALUE)."""
    rules = engine_rules(engine)
    check_layout(rules, s.model, s.pp, s.dp)
    # the margin asked, in this engine's own terms where it takes a share of the GPU
    options = {rules.fraction_option: round(1 - s.margin, 6)} if not s.margin_default and rules.fraction_option else {}
    if engine_options:  # a share of the GPU given both ways must agree
        options = margin_as_option(rules, engine, s.margin, engine_options) if options else dict(engine_options)
    t = replace(s, rules=rules, engine=engine, kv_dtype="auto", block_size=None, options=options, version=None,
                weights=served_weights(s.model, rules, s.capability),
                startup_rule=s.gpu is not None and not s.gpu.wall and s.device == "gpu")
    if t.startup_rule and t.startup is None:
        t = replace(t, startup_rule=False)
    if s.overhead_default:  # the other engine's own measured overhead
        o = default_overhead(engine, s.device)
        t = replace(t, overhead_fixed=o.fixed_bytes, overhead_per_token=o.per_token_bytes,
                    overhead_source=o.for_model(s.model.name))
    return t
