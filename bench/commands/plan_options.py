"""The options of ``kvbench plan``, each declared once (as ``kvbench run``'s are, bench/run/option_fields.py):
its flag with help, metavar and default, and how its text is read and checked. bench/commands/plan.py makes
the command's parameters from these fields and the :class:`~kvbench.planner.PlanInput` from the options read.

Every value is checked here, before any model is read: a refusal is one :class:`PlanError` line (exit 2).
Counts and sizes are bounded (:data:`MAX_BATCH` and the others; the line says the maximum); an engine option
is read by the range its engine declares next to it (``KVRules.rule_options``, :class:`kvbench.kv.rules.OptionRange`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from kvbench.common.suggest import hint, with_hint
from kvbench.kv.geometry import KV_DTYPE_BYTES
from kvbench.kv.rules import KVQuestion, KVRuleError
from kvbench.kv.speculative import MAX_SPECULATIVE_TOKENS, METHODS
from kvbench.kv.units import GIB
from kvbench.planner.decode import read_bandwidth, read_decode_efficiency
from kvbench.planner import (
    NODE_GPUS,
    WEIGHT_DTYPES,
    ModelForPlan,
    PlanError,
    PlanInput,
    catalog_names,
    engine_rules,
    engines,
    gpu,
    gpu_catalog,
    measured_overhead,
    parse_bytes,
    parse_float,
    parse_int,
    parse_tokens,
)
from kvbench.run.option_fields import Flag, flags, option, read_flags

EXIT_UNVERIFIED = 3  # --strict and a config with per-layer keys the reader did not read
MAX_BATCH = 1 << 20  # requests at once: the most the planner's searches consider (Setup.max_concurrency)
MAX_GPUS = 1024  # --tp, --pp, --dp and --node-gpus each: far past any deployment planned
MAX_TOKENS = 1 << 30  # a request's tokens (--context, --max-model-len, --shared-prefix): 1,073,741,824
MAX_BLOCK = 1 << 16  # tokens in a KV block
MAX_BYTES = 2**50  # a size (--memory, --weights-bytes, --overhead-gib): 1 PiB
VERSION = re.compile(r"v?\d{1,6}(\.\d{1,6}){0,3}[0-9A-Za-z.+-]{0,24}")  # 0.10.1, 0.6.4.post1, 1.0rc2
#: The parameters given by position (the rest are --flags).
ARGUMENTS = ("model",)


# --- reading one flag's text ---------------------------------------------------------------------------

def shown(text) -> str:
    """A value as a refusal quotes it: at most 40 characters of it."""
    return repr(text) if len(str(text)) <= 40 else f"{str(text)[:40]!r}..."


def at_most(value, flag: str, most: float, what: str):
    if value is not None and value > most:
        raise PlanError(f"{flag} takes at most {most:,} {what}, not {value:,}")
    return value


def count(flag: str, most: int, what: str, least: int = 1):
    """A whole number from ``least`` to ``most`` (of ``what``)."""
    def read(flags: dict, earlier: dict) -> int | None:
        (text,) = flags.values()
        return at_most(parse_int(text, flag, least), flag, most, what)
    return read


def tokens(flag: str, most: int = MAX_TOKENS):
    """Tokens as vLLM's --max-model-len reads them (32k, 128K), from 1 to ``most``."""
    def read(flags: dict, earlier: dict) -> int | None:
        (text,) = flags.values()
        try:
            value = parse_tokens(text, flag)
        except OverflowError:  # more digits than a float holds
            raise PlanError(f"{flag} takes at most {most:,} tokens, not {shown(text)}") from None
        return at_most(value, flag, most, "tokens")
    return read


def size(flag: str):
    """A size in bytes (61GiB, 65.5GB, 688586727753), above 0 and at most :data:`MAX_BYTES`."""
    def read(flags: dict, earlier: dict) -> float | None:
        (text,) = flags.values()
        value = parse_bytes(text, flag)
        if value is not None and value > MAX_BYTES:
            raise PlanError(f"{flag} takes at most {MAX_BYTES / 2**50:g} PiB, not {shown(text)}")
        return value
    return read


def finite(text: str | None, flag: str) -> float | None:
    """A number option that is a number: nan and inf parse as floats but compare false with every bound."""
    value = parse_float(text, flag)
    if value is not None and not math.isfinite(value):
        raise PlanError(f"{flag} takes a finite number, not {text}")
    return value


def read_model(flags: dict, earlier: dict) -> str:
    """A model argument that is neither a path nor a valid hub id, refused before any hub request."""
    from kvbench.common.models import ModelError, check_model_name

    try:
        check_model_name(flags["model"])
    except ModelError as exc:
        raise PlanError(str(exc)) from None
    return flags["model"]


def read_engine(flags: dict, earlier: dict) -> str | None:
    """An engine's name as the planner knows it, whatever its case (vLLM: vllm)."""
    text = flags["engine"]
    if text is None:
        return None
    if text.strip().lower() not in engines():
        raise PlanError(with_hint(f"no KV rules for engine {text!r}; known: {', '.join(engines())}", text, engines()))
    return text.strip().lower()


def read_gpu(flags: dict, earlier: dict) -> str | None:
    """A GPU of the catalog or a size, looked up now so that a bad one is refused before the model is read."""
    text = flags["gpu"]
    if text is not None:
        try:
            gpu(text)
        except PlanError:
            raise
        except (ValueError, OverflowError):  # a size that is not a number (1.2.3GiB), or past a float's range
            raise PlanError(f"--gpu {shown(text)} is not a GPU or a size such as 48GiB; known: "
                            f"{', '.join(gpu_catalog())}") from None
    return text


def read_interconnect(flags: dict, earlier: dict) -> str | None:
    link = flags["interconnect"]
    if link is not None and link.strip().lower() not in ("nvlink", "pcie"):
        raise PlanError(f"--interconnect is nvlink or pcie, not {shown(link)}")
    return link.strip().lower() if link is not None else None


def read_device(flags: dict, earlier: dict) -> str:
    device = flags["device"] or ("cpu" if earlier["memory"] is not None else "gpu")
    if device not in ("gpu", "cpu"):
        raise PlanError(f"--device is gpu or cpu, not {device!r}")
    return device


def read_weights_dtype(flags: dict, earlier: dict) -> str:
    if flags["weights_dtype"] not in WEIGHT_DTYPES:
        raise PlanError(f"unknown --weights-dtype {flags['weights_dtype']!r}; known: {', '.join(WEIGHT_DTYPES)}")
    return flags["weights_dtype"]


def read_engine_version(flags: dict, earlier: dict) -> str | None:
    """A version as engines number theirs (0.10.1, 0.6.4.post1, v3.3.5): the rules compare its numbers."""
    text = flags["engine_version"]
    if text is not None and not VERSION.fullmatch(text):
        raise PlanError(f"--engine-version takes a version such as 0.10.1, not {shown(text)}")
    return text


def read_overhead(flags: dict, earlier: dict) -> tuple[float | None, str]:
    """(GiB per GPU, where it came from): --overhead-gib, or what the run --overhead-from measured."""
    overhead = finite(flags["overhead_gib"], "--overhead-gib")
    at_most(overhead, "--overhead-gib", MAX_BYTES // GIB, "GiB")
    if flags["overhead_from"] is None:
        return overhead, "given: --overhead-gib"
    if overhead is not None:
        raise PlanError("--overhead-gib and --overhead-from: give one")
    try:
        found = measured_overhead(flags["overhead_from"], earlier["engine"])
    except OSError as exc:  # a name too long, a folder not readable
        raise PlanError(f"--overhead-from {shown(flags['overhead_from'])}: {exc.strerror or exc}") from None
    return found.fixed_bytes / GIB, found.source


def read_margin(flags: dict, earlier: dict) -> float | None:
    margin = finite(flags["margin"], "--margin")
    return margin if margin is not None else (0.0 if earlier["memory"] is not None else None)


def read_speculative(flags: dict, earlier: dict) -> str | None:
    """A drafter's method kvbench plans (none: no speculation); whether the engine has it is its rules' to say."""
    text = flags["speculative"]
    if text is None or text.strip().lower() == "none":
        return None
    if text.strip().lower() not in METHODS:
        raise PlanError(with_hint(f"--speculative is one of {', '.join(METHODS)}, not {shown(text)}", text, METHODS))
    return text.strip().lower()


def read_draft_model(flags: dict, earlier: dict) -> str | None:
    """A draft model (or an EAGLE head's config) named as MODEL is: checked now, read with the model."""
    text = flags["draft_model"]
    if text is None:
        return None
    if earlier["speculative"] not in ("draft", "eagle"):
        raise PlanError("--draft-model is the drafter of --speculative draft (or an EAGLE head's config with "
                        f"--speculative eagle), not of {earlier['speculative'] or 'no speculation'}")
    return read_model({"model": text}, earlier)


def read_speculative_tokens(flags: dict, earlier: dict) -> int | None:
    text = flags["speculative_tokens"]
    if text is not None and earlier["speculative"] is None:
        raise PlanError("--speculative-tokens needs --speculative (ngram, draft, eagle or mtp)")
    return count("--speculative-tokens", MAX_SPECULATIVE_TOKENS, "tokens")(flags, earlier)


def read_compare(flags: dict, earlier: dict) -> bool:
    if flags["compare_engines"] and earlier["engine"]:
        raise PlanError("--compare-engines sets every engine side by side: not with --engine")
    return flags["compare_engines"]


# --- --engine-option ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineOption:
    """One --engine-option pair as given: ``[ENGINE:]KEY=VALUE``."""

    engine: str | None  # the engine it is addressed to (ENGINE:), None: unaddressed
    key: str
    text: str

    def __str__(self) -> str:
        return f"{self.engine + ':' if self.engine else ''}{self.key}={self.text}"


def read_engine_option_pairs(flags: dict, earlier: dict) -> tuple[EngineOption, ...]:
    """Each ``[ENGINE:]KEY=VALUE`` of --engine-option (repeated, or several in one, comma-separated), as given;
    :func:`engine_options` checks them against the engines' rules once every flag is read."""
    out = []
    for item in (part for given in flags["engine_option"] for part in given.split(",") if part):
        key, eq, text = item.partition("=")
        engine, colon, key = key.strip().rpartition(":")
        if not eq or not key.strip():
            raise PlanError(f"option {item!r} in --engine-option must be KEY=VALUE (or ENGINE:KEY=VALUE)")
        if colon and engine.strip().lower() not in engines():
            raise PlanError(with_hint(f"--engine-option {item!r}: no KV rules for engine {engine!r}; known: "
                                      f"{', '.join(engines())}", engine, engines()))
        out.append(EngineOption(engine.strip().lower() if colon else None, key.strip(), text.strip()))
    return tuple(out)


def engine_options(pairs: tuple[EngineOption, ...], engine: str | None, compare: bool) -> dict[str, dict]:
    """{engine: its options, each read by the range its rules declare}: the --engine's, or with
    --compare-engines each engine's (an unaddressed key goes to the one engine that takes it)."""
    if not pairs:
        return {}
    if engine is None and not compare:
        raise PlanError(f"--engine-option {', '.join(p.key for p in pairs)} needs --engine (the plain formula "
                        "takes none)")
    asked = engines() if compare else [engine]
    out: dict[str, dict] = {}
    for p in pairs:
        if p.engine is not None and p.engine not in asked:
            raise PlanError(f"--engine-option {p}: addressed to {p.engine}, but the plan is of --engine {engine}")
        targets = [p.engine] if p.engine else [e for e in asked if p.key in engine_rules(e).rule_options]
        if not targets:  # a key no engine asked takes: the --engine's own list (or every engine's)
            allowed = list(dict.fromkeys(k for e in asked for k in engine_rules(e).rule_options))
            where = f"for {engine}" if not compare else "for any engine"
            raise PlanError(f"unknown --engine-option {p.key!r} {where}; {hint(p.key, allowed)}"
                            f"allowed: {', '.join(allowed) or 'none'}")
        if len(targets) > 1:
            raise PlanError(f"--engine-option {p}: {', '.join(targets)} all take {p.key}; with --compare-engines "
                            f"address one: --engine-option {targets[0]}:{p}")
        target = targets[0]
        allowed = engine_rules(target).rule_options
        if p.key not in allowed:
            raise PlanError(f"unknown --engine-option {p.key!r} for {target}; {hint(p.key, allowed)}"
                            f"allowed: {', '.join(allowed) or 'none'}")
        try:
            value = allowed[p.key].read(p.key, p.text)
        except KVRuleError as exc:
            raise PlanError(f"--engine-option {target + ':' if compare or p.engine else ''}{exc}") from None
        out.setdefault(target, {})[p.key] = value
    return out


def takes_kv_dtype(engine: str, dtype: str) -> bool:
    try:
        engine_rules(engine).resolve_dtype(KVQuestion(None, dtype))
    except KVRuleError:
        return False
    return True


# --- the help texts that list what each engine takes ---------------------------------------------------------

def _kv_dtypes_help() -> str:
    per = [f"{e}: auto, {', '.join(sorted(engine_rules(e).dtypes))}" for e in engines()]
    return ("KV cache dtype. auto (default) is each engine's own: the model dtype as the engine serves it (vLLM "
            "serves a float32 config in bf16), f16 for llama.cpp, fp8 where a quantised checkpoint's config asks "
            f"for it. Without --engine: auto, {', '.join(sorted(KV_DTYPE_BYTES))}. Per engine: {'; '.join(per)}. "
            "With --compare-engines: each engine that takes it.")


def _engine_options_help() -> str:
    per = [f"{e}: {', '.join(engine_rules(e).rule_options)}" for e in engines() if engine_rules(e).rule_options]
    return (f"KEY=VALUE for the engine's rules (repeat for several), each in the range the engine takes; with "
            "--compare-engines ENGINE:KEY=VALUE (an unaddressed KEY goes to the one engine that takes it); keys: "
            f"{'; '.join(per)}.")


# --- the options ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class PlanOptions:
    """What one ``kvbench plan`` asks; the fields in the order of its ``--help``."""

    model: str = option(
        Flag("model", str, ..., "A config.json, a model folder, a GGUF file, a hub id (org/name), the embedded "
             f"model (smollm2) or a catalog name: {', '.join(catalog_names())}."),
        read=read_model)
    context: int | None = option(
        Flag("context", str, None, "The typical request's tokens (prompt + output), e.g. 10000 or 10k (default: the "
             "limit). Suffixes as vLLM's: k = 1,000, K = 1,024, m, M.", names=("--context", "-n"), metavar="TOKENS"),
        read=tokens("--context"), default=None)
    max_model_len: int | None = option(
        Flag("max_model_len", str, None, "The per-request limit the server is started with (vLLM --max-model-len, "
             "llama.cpp -c / -np, TGI --max-total-tokens); default: the model's, RoPE scaling included (Qwen2.5 "
             "with YaRN factor 4: 131,072).", metavar="TOKENS"),
        read=tokens("--max-model-len"), default=None)
    # no -b: that is --backend in run, setup and validate
    batch: int = option(Flag("batch", str, "1", "Requests served at once.", metavar="N"),
                        read=count("--batch", MAX_BATCH, "requests at once"), default=1)
    kv_dtype: str = option(Flag("kv_dtype", str, "auto", _kv_dtypes_help()))
    tp: int = option(Flag("tp", str, "1", "GPUs the model is split over (tensor parallel; llama.cpp splits layers).",
                          metavar="N"), read=count("--tp", MAX_GPUS, "GPUs"), default=1)
    pp: int = option(
        Flag("pp", str, "1", "Pipeline stages, each on its own --tp GPUs holding its layers and their KV (vLLM "
             "--pipeline-parallel-size, SGLang --pp-size); may span nodes.", metavar="N"),
        read=count("--pp", MAX_GPUS, "stages"), default=1)
    dp: int = option(
        Flag("dp", str, "1", "Data-parallel attention over N GPUs for an MLA model (vLLM --data-parallel-size N "
             "--enable-expert-parallel, SGLang --enable-dp-attention): each GPU holds the KV of its share of the "
             "batch, the routed experts split over all.", metavar="N"),
        read=count("--dp", MAX_GPUS, "GPUs"), default=1)
    interconnect: str | None = option(
        Flag("interconnect", str, None, "nvlink or pcie: how the tensor-parallel GPUs talk (NCCL's buffers and the "
             "engines' all-reduce differ). Default: the card's (SXM boards NVLink, the others PCIe; a size given "
             "is planned as NVLink, the larger buffers)."),
        read=read_interconnect, default=None)
    engine: str | None = option(
        Flag("engine", str, None, f"Apply this engine's rules: {', '.join(engines())} (default: the plain formula)."),
        read=read_engine, default=None)
    gpu: str | None = option(
        Flag("gpu", str, None, f"A GPU: {', '.join(gpu_catalog())}; or a size such as 48GiB."),
        read=read_gpu, default=None)
    memory: float | None = option(
        Flag("memory", str, None, "Instead of a GPU, a CPU memory wall of SIZE (1G, 1.5GiB): the engine's whole "
             "process tree in a memory cgroup, as `kvbench run --memory-limit SIZE` starts it. Implies --device cpu "
             "and --margin 0; the engine's host caches count.", metavar="SIZE"),
        read=size("--memory"), default=None)
    block_size: int | None = option(
        Flag("block_size", str, None, "The engine's KV block size (default: its own; vLLM 16 on a GPU, 128 on a CPU; "
             "TGI 1). Engines with blocks: vllm, tgi.", metavar="N"),
        read=count("--block-size", MAX_BLOCK, "tokens", least=0), default=None)  # below 1: the rules' refusal
    device: str = option(
        Flag("device", str, None, "gpu or cpu: the device the engine runs on (vLLM sizes blocks per device; the "
             "overhead is measured per device); default gpu, cpu with --memory."),
        read=read_device, default="gpu")
    engine_version: str | None = option(
        Flag("engine_version", str, None, "The engine's version, where its rules changed (default: the version "
             "kvbench runs)."),
        read=read_engine_version, default=None)
    engine_option_pairs: tuple[EngineOption, ...] = option(
        Flag("engine_option", list[str], [], _engine_options_help(), names=("--engine-option",)),
        read=read_engine_option_pairs, default=())
    weights_dtype: str = option(
        Flag("weights_dtype", str, "auto", f"The weights' width: {', '.join(WEIGHT_DTYPES)}. auto (default): the "
             "checkpoint's own, an unquantised one at the engine's serving dtype."),
        read=read_weights_dtype, default="auto")
    weights_bytes: float | None = option(
        Flag("weights_bytes", str, None, "The weights' size, all GPUs, overriding every other source: 61GiB, 65.5GB, "
             "688586727753 (bytes).", metavar="SIZE"),
        read=size("--weights-bytes"), default=None)
    overhead: tuple[float | None, str] = option(
        Flag("overhead_gib", str, None, "Runtime overhead per GPU (CUDA context, activations, graphs); default: the "
             "engine's measured on the device (the table kvbench ships from its published runs), else 1.5, an "
             "assumption.", metavar="GIB"),
        Flag("overhead_from", str, None, "Take the overhead per GPU a GPU run measured (its largest over the cells "
             "of --engine, if given) instead of the shipped table's.", metavar="RUN"),
        read=read_overhead, default=(None, "given: --overhead-gib"))
    margin: float | None = option(
        Flag("margin", str, None, "Fraction of the memory kept free, from 0 to below 1: on a GPU, the engine's "
             "own share at 1 - FRACTION (vLLM's gpu_memory_utilization, SGLang's mem_fraction_static, TGI's "
             "cuda_memory_fraction), kept free beside an engine with none (llama.cpp). Default: the engine's own "
             "share; 0.10 with no engine; 0 of a --memory wall, which is exact.", metavar="FRACTION"),
        read=read_margin, default=None)
    node_gpus: int = option(
        Flag("node_gpus", str, str(NODE_GPUS), "GPUs in a node: the most the tensor-parallel lever proposes.",
             metavar="N"),
        read=count("--node-gpus", MAX_GPUS, "GPUs"), default=NODE_GPUS)
    allow_long_context: bool = option(
        Flag("allow_long_context", bool, False, "Plan a limit beyond the model's own.", names=("--allow-long-context",)))
    trust_remote_code: bool = option(
        Flag("trust_remote_code", bool, False, "Read a remote-code model's configuration_*.py (shipped in its folder) "
             "through transformers' AutoConfig: runs that file.", names=("--trust-remote-code",)))
    strict: bool = option(
        Flag("strict", bool, False, f"Exit {EXIT_UNVERIFIED} when the config has per-layer keys the reader did not "
             "read (not verified).", names=("--strict",)))
    shared_prefix: int | None = option(
        Flag("shared_prefix", str, None, "Every request of the batch starts with the same TOKENS (a system prompt, a "
             "document): the KV the batch holds in use with the prefix shared at the engine's granularity (vLLM's "
             "blocks; engines that do not share hold a copy each). The pool and verdict are unchanged.",
             metavar="TOKENS"),
        read=tokens("--shared-prefix"), default=None)
    speculative: str | None = option(
        Flag("speculative", str, None, f"Speculative decoding: {', '.join(METHODS)} (where the engine has it). The "
             "drafter's weights and KV are counted where the engine keeps them (vLLM: its layers in the target's "
             "pool; llama.cpp: a second context of the same cells; SGLang: a pool of its own); ngram needs none.",
             metavar="METHOD"),
        read=read_speculative, default=None)
    draft_model: str | None = option(
        Flag("draft_model", str, None, "The draft model of --speculative draft (or an EAGLE head's config): a "
             "catalog name, config folder or file, as MODEL. Without it --speculative eagle plans one decoder layer "
             "of the target's shape.", metavar="MODEL"),
        read=read_draft_model, default=None)
    speculative_tokens: int | None = option(
        Flag("speculative_tokens", str, None, "Tokens the drafter proposes a step (vLLM num_speculative_tokens, "
             f"llama.cpp --spec-draft-n-max), 1 to {MAX_SPECULATIVE_TOKENS:,}; default: the engine's.",
             metavar="N"),
        read=read_speculative_tokens, default=None)
    bandwidth: float | None = option(
        Flag("bandwidth", str, None, "The GPU's (or CPU's) memory read bandwidth per GPU, e.g. 3.35TB/s, 900GB/s, or spec (the "
             "--gpu card's specification, bench/planner/gpus.toml): "
             "prints the fastest ITL the batch allows (a decode step reads the weights once and every request's "
             "KV; docs/metrics.md, \"Decode bound\").", metavar="RATE"),
        read=read_bandwidth, default=None)
    decode_efficiency: float | None = option(
        Flag("decode_efficiency", str, None, "With --bandwidth: the share of the bound an engine reaches (a run's "
             "efficiency, from `kvbench report`), above 0 and at most 1: prints the ITL to expect.",
             metavar="FRACTION"),
        read=read_decode_efficiency, default=None)
    as_json: bool = option(Flag("as_json", bool, False, "Print one JSON object.", names=("--json",)))
    compare_engines: bool = option(
        Flag("compare_engines", bool, False, "Every engine's KV pool side by side for this model and GPU (or wall), "
             "at the limit: the tokens and requests each engine's rules make of the memory the weights and its "
             "overhead leave (each engine's auto KV dtype, or --kv-dtype where it takes it). Not with --engine.", names=("--compare-engines",)),
        read=read_compare, default=False)
    # set once every flag is read: {engine: its --engine-option values, checked}
    engine_options: dict[str, dict] = field(default_factory=dict)

    def plan_input(self, model: ModelForPlan, draft: ModelForPlan | None = None) -> PlanInput:
        """The plan these options ask of ``model`` (--compare-engines: the deployment each engine is set on);
        ``draft``: --draft-model, resolved."""
        overhead, source = self.overhead
        return PlanInput(
            model=model, context=self.context, batch=self.batch, kv_dtype=self.kv_dtype, tp=self.tp, pp=self.pp,
            dp=self.dp, interconnect=self.interconnect, engine=self.engine, gpu=self.gpu, overhead_gib=overhead, overhead_source=source,
            memory=self.memory, margin=self.margin, block_size=self.block_size, device=self.device,
            engine_version=self.engine_version, engine_options=self.engine_options.get(self.engine or "", {}),
            allow_long_context=self.allow_long_context, max_model_len=self.max_model_len, node_gpus=self.node_gpus,
            shared_prefix=self.shared_prefix, speculative=self.speculative, draft_model=draft,
            speculative_tokens=self.speculative_tokens, draft_label=self.draft_model or "")

    def compared_engines(self) -> tuple[list[str], list[str]]:
        """(the engines --compare-engines sets side by side, those left out for lacking --kv-dtype)."""
        if self.kv_dtype.lower() == "auto":
            return engines(), []
        takes = [e for e in engines() if takes_kv_dtype(e, self.kv_dtype)]
        if not takes:
            raise PlanError(f"--compare-engines --kv-dtype {self.kv_dtype!r}: no engine takes it (--help lists each "
                            "engine's KV dtypes)")
        return takes, [e for e in engines() if e not in takes]


def read_plan_options(values: dict) -> PlanOptions:
    """The options from the command's values (by parameter name), every one checked (PlanError, one line)."""
    options = read_flags(PlanOptions, values)
    if options.engine is not None and options.kv_dtype.lower() != "auto":  # a KV dtype the engine's rules take
        try:
            engine_rules(options.engine).resolve_dtype(KVQuestion(None, options.kv_dtype))
        except KVRuleError as exc:
            raise PlanError(str(exc)) from None
    return replace(options, engine_options=engine_options(options.engine_option_pairs, options.engine,
                                                          options.compare_engines))


def plan_flags() -> list[Flag]:
    """Every parameter of ``kvbench plan``, in the order of its ``--help``."""
    return flags(PlanOptions)
