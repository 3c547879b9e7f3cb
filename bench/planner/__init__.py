"""Capacity planning: weights + KV + runtime overhead + a safety margin against a GPU's memory.

``resolve_model`` turns the user's MODEL argument (a config.json, a model folder, a GGUF file, a catalog
name or a hub id) into a geometry (:mod:`kvbench.kv.model_config`) and the weights (:mod:`kvbench.kv.weights`);
:func:`plan` asks the engine's KV rules (its adapter's ``kv_rules``, or the plain formula) for the KV
bytes and sets them against the GPU. Pure functions over those; refusals are :class:`PlanError` lines.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.backends import ENGINES, engines_with_rules, kv_rules
from kvbench.kv import hub, weights
from kvbench.kv.geometry import KVGeometry, heads_per_rank, kv_bytes_per_token
from kvbench.kv.model_config import (
    ConfigError,
    config_file,
    geometry_from_gguf_keys,
    gguf_keys,
    parse_hf_dict,
    read_json,
)
from kvbench.kv.rules import KVQuestion, KVRuleError, KVRules
from kvbench.kv.units import GIB
from kvbench.kv.weights import WEIGHT_DTYPE_BYTES, Weights

CATALOG_DIR = Path(__file__).with_name("catalog")
GPUS_FILE = Path(__file__).with_name("gpus.toml")
PLAIN = KVRules()  # the plain formula, when no engine is named


class PlanError(ValueError):
    pass


def catalog_names() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob("*.json"))


def engines() -> list[str]:
    """The engines whose KV rules the planner knows (every adapter that has them)."""
    return engines_with_rules()


def engine_rules(engine: str | None) -> KVRules:
    if engine is None:
        return PLAIN
    rules = kv_rules(engine.lower()) if engine.lower() in ENGINES else None
    if rules is None:
        raise PlanError(f"no KV rules for engine {engine!r}; known: {', '.join(engines())}")
    return rules


def gpu_catalog() -> dict[str, int]:
    """{name: bytes}."""
    return {name: spec["memory_mib"] * 2**20 for name, spec in tomllib.loads(GPUS_FILE.read_text()).items()}


def gpu_memory(name_or_size: str) -> tuple[str, int]:
    """A GPU by catalog name (case-insensitive) or by size: '48GiB', '24GB', '80G'."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(gib|gb|g)\s*", name_or_size, re.IGNORECASE)
    if m:
        value, unit = float(m[1]), m[2].lower()
        if value <= 0:
            raise PlanError(f"a GPU size must be positive, not {name_or_size!r}")
        return name_or_size.strip(), int(value * (1e9 if unit == "gb" else GIB))
    for name, size in gpu_catalog().items():
        if name.lower() == name_or_size.strip().lower().replace(" ", "-"):
            return name, size
    raise PlanError(f"unknown GPU {name_or_size!r}; known: {', '.join(gpu_catalog())} (or a size such as 48GiB)")


# --- the model --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelForPlan:
    name: str
    geometry: KVGeometry
    weights: Weights
    source: str = ""  # where the model was read from (a path, the catalog, the hub)

    @property
    def weights_bytes(self) -> float | None:
        return self.weights.bytes

    @property
    def weights_source(self) -> str:
        return self.weights.source


def resolve_model(model: str, weights_dtype: str = "bf16") -> ModelForPlan:
    """MODEL as a config.json, an HF model folder, a GGUF file, a catalog name or a hub id (org/name)."""
    if weights_dtype not in WEIGHT_DTYPE_BYTES:
        raise PlanError(f"unknown weights dtype {weights_dtype!r}; known: {', '.join(WEIGHT_DTYPE_BYTES)}")
    path = Path(model).expanduser()
    source = str(path)
    if not path.exists():
        if (CATALOG_DIR / f"{model}.json").exists():
            path, source = CATALOG_DIR / f"{model}.json", f"catalog {model}"
        elif hub.looks_like_hub_id(model):
            try:
                path, source = hub.config_folder(model), f"hub {model}"
            except hub.HubError as exc:
                raise PlanError(str(exc)) from None
        else:
            raise PlanError(f"{model!r} is not a file or folder, a hub id (org/name) or a catalog model; "
                            f"catalog: {', '.join(catalog_names())}")
    try:
        if path.suffix == ".gguf":
            return ModelForPlan(path.stem, geometry_from_gguf_keys(gguf_keys(path), str(path)),
                                Weights(weights.gguf_tensor_bytes(path), "GGUF tensor bytes", exact=True), source)
        file = config_file(path)
        if not file.exists():
            raise PlanError(f"{path} has no config.json")
        raw = read_json(file)
        config, text, geometry = parse_hf_dict(raw, str(file))
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    name = model if source.startswith("hub") else (path.name if path.is_dir() else path.stem)
    per = WEIGHT_DTYPE_BYTES[weights_dtype]
    if raw.get("kvbench_num_parameters"):  # the catalog's published count (a few configs are excerpts)
        params = raw["kvbench_num_parameters"]
        return ModelForPlan(name, geometry, Weights(params * per, f"{params / 1e9:.1f} B published parameters x {per} B",
                                                    parameters=params), source)
    estimate = weights.estimate(text, config, weights_dtype)
    found = weights.of_folder(path if path.is_dir() else path.parent, estimate)
    return ModelForPlan(name, geometry, found, source)


# --- the plan --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanInput:
    model: ModelForPlan
    context: int  # tokens per sequence (prompt + output)
    batch: int = 1
    kv_dtype: str = "auto"  # "auto": the engine's default for the model (the weights' dtype, f16 for llama.cpp)
    tp: int = 1
    engine: str | None = None  # None: the plain formula
    gpu: str | None = None
    overhead_gib: float = 1.5  # CUDA context, activations, graphs: an assumption, per GPU (see measured_overhead)
    overhead_source: str = "assumed"  # where overhead_gib came from
    margin: float = 0.10  # fraction of the GPU kept free
    block_size: int | None = None
    device: str = "gpu"  # engines size some things per device (vLLM's block size)
    engine_version: str | None = None
    engine_options: dict = field(default_factory=dict)
    allow_long_context: bool = False  # plan past the model's max_position_embeddings


def _question(p: PlanInput, context: int, batch: int) -> KVQuestion:
    return KVQuestion(p.model.geometry, p.kv_dtype, context, batch, p.tp, p.block_size, p.device, p.engine_version,
                      dict(p.engine_options))


def _check(p: PlanInput) -> None:
    if p.context < 1 or p.batch < 1:
        raise PlanError("--context and --batch must be >= 1")
    if not 0 <= p.margin < 1:
        raise PlanError(f"--margin is the fraction of the GPU kept free: from 0 to below 1, not {p.margin}")
    if p.overhead_gib < 0:
        raise PlanError(f"--overhead-gib must be >= 0, not {p.overhead_gib}")
    if p.tp < 1:
        raise PlanError(f"--tp must be >= 1, not {p.tp}")
    if p.device not in ("gpu", "cpu"):
        raise PlanError(f"--device is gpu or cpu, not {p.device!r}")
    limit = p.model.geometry.max_context
    if limit and p.context > limit and not p.allow_long_context:
        raise PlanError(f"a context of {p.context:,} tokens exceeds the model's limit of {limit:,} "
                        "(max_position_embeddings); --allow-long-context plans it anyway")


def _per_gpu_need(p: PlanInput, rules: KVRules, context: int, batch: int) -> tuple[float, float]:
    """(bytes one GPU needs, of which KV) for ``batch`` sequences of ``context`` tokens."""
    answer = rules.answer(_question(p, context, batch))
    kv = answer.bytes_per_gpu + answer.pool_extra_bytes
    return p.model.weights_bytes / p.tp + kv + p.overhead_gib * GIB, kv


def _largest(fits, low: int, high: int) -> int:
    """Largest n in [low, high] with fits(n) true (fits monotone decreasing), low - 1 if none."""
    if not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def plan(p: PlanInput) -> dict:
    _check(p)
    rules = engine_rules(p.engine)
    geom = p.model.geometry
    question = _question(p, p.context, p.batch)
    try:
        result = rules.answer(question)
    except KVRuleError as exc:
        raise PlanError(str(exc)) from None
    stored = rules.stored(question)
    kv_total = result.bytes_per_gpu * p.tp
    out = {
        "model": p.model.name, "attention": geom.attention, "geometry": geom.describe(), "layers": geom.num_layers,
        "kv_heads": geom.num_kv_heads, "kv_heads_per_gpu": (stored.num_kv_heads if rules.replicated(stored)
                                                         else heads_per_rank(stored.num_kv_heads, p.tp)),
        "head_dim_k": geom.head_dim_k, "head_dim_v": geom.head_dim_v,
        "sliding_window": geom.sliding_window, "sliding_layers": geom.num_sliding_layers,
        "chunk_size": geom.chunk_size, "chunked_layers": geom.count("chunked"),
        "max_context": geom.max_context, "context": p.context, "batch": p.batch, "kv_dtype": result.dtype, "tp": p.tp,
        "engine": p.engine or "exact", "engine_rule": result.note, "notes": list(geom.notes),
        "kv_bytes": kv_total, "kv_bytes_per_gpu": result.bytes_per_gpu, "kv_pool_extra_bytes": result.pool_extra_bytes,
        "kv_bytes_per_token": kv_total / (p.batch * p.context),
        "kv_bytes_per_token_formula": kv_bytes_per_token(geom, result.dtype, p.tp) * p.tp,
        "kv_bytes_per_token_stored": result.bytes_per_token * p.tp,
        "weights_bytes": p.model.weights_bytes, "weights_source": p.model.weights_source,
        "weights_exact": p.model.weights.exact,
    }
    if not p.gpu:
        return out
    gpu_name, gpu_bytes = gpu_memory(p.gpu)
    usable = gpu_bytes * (1 - p.margin)
    out.update({"gpu": gpu_name, "gpu_memory_bytes": gpu_bytes, "margin": p.margin, "usable_bytes": usable,
                "overhead_bytes": p.overhead_gib * GIB, "overhead_source": p.overhead_source})
    if p.model.weights_bytes is None:  # the KV answer stands; whether it fits cannot be said
        out.update({"weights_bytes_per_gpu": None, "needed_bytes_per_gpu": None, "fits": None, "max_batch": None,
                    "max_context_at_batch": None})
        return out
    need, _ = _per_gpu_need(p, rules, p.context, p.batch)

    def fits_batch(b):
        return _per_gpu_need(p, rules, p.context, b)[0] <= usable

    def fits_context(n):
        return _per_gpu_need(p, rules, n, p.batch)[0] <= usable
    out.update({
        "weights_bytes_per_gpu": p.model.weights_bytes / p.tp, "needed_bytes_per_gpu": need, "fits": need <= usable,
        "max_batch": max(0, _largest(fits_batch, 1, 1 << 20)),
        "max_context_at_batch": max(0, _largest(fits_context, 1, geom.max_context or 10**7)),
    })
    return out


def model_names() -> list[str]:
    """The model names kvbench knows without a path or hub id (for "did you mean"): the embedded models and
    the catalog's."""
    from kvbench.common.models import EMBEDDED
    return [*EMBEDDED, *catalog_names()]


# --- the overhead measured in a run ------------------------------------------------------------------

@dataclass(frozen=True)
class MeasuredOverhead:
    bytes: float  # per GPU
    source: str  # which run, engine, model and cell it came from
    cells: int  # cells that measured it


def measured_overhead(run_dir: str | Path, engine: str | None = None, model: str | None = None) -> MeasuredOverhead:
    """The largest runtime overhead per GPU a run measured (``gpu_overhead_bytes_per_gpu``: NVML's device use
    over the idle baseline on the fullest GPU, minus the weights and the KV pool the engine reported), over
    its ok cells of ``engine`` (and ``model``) where given: the largest, since a plan must hold at every load
    the run measured. A run with no such cell is a PlanError saying why."""
    from kvbench.store.readers import load_cells
    from kvbench.store.schema import OK_STATUSES

    path = Path(run_dir).expanduser()
    if not (path / "cells.jsonl").exists():
        raise PlanError(f"--overhead-from {run_dir}: not a run folder (no cells.jsonl)")
    cells = load_cells(path)
    if cells.empty or "gpu_overhead_bytes_per_gpu" not in cells:
        raise PlanError(f"--overhead-from {run_dir}: the run has no cells")
    measured = cells[cells.status.isin(OK_STATUSES) & cells.gpu_overhead_bytes_per_gpu.notna()]
    if engine:
        measured = measured[measured.engine == engine.lower()]
    if model:
        same = measured[measured.model == model]
        measured = same if not same.empty else measured  # the run's model may be named differently
    if measured.empty:
        raise PlanError(f"--overhead-from {run_dir}: no ok cell{' of ' + engine if engine else ''} measured the "
                        "overhead (a GPU run whose engine reported its weights; CPU runs have none)")
    top = measured.loc[measured.gpu_overhead_bytes_per_gpu.idxmax()]
    mode = f", {top.engine_mode}" if top.get("engine_mode") else ""
    return MeasuredOverhead(float(top.gpu_overhead_bytes_per_gpu),
                            f"measured: {path.name}, {top.backend}{mode}, {top.model}, cell {top.cell_id} "
                            f"(largest of {len(measured)} cells)", len(measured))
