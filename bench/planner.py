"""Capacity planning: weights + KV + runtime overhead + safety margin against a GPU's memory.

Pure functions over a :class:`kvbench.kvmodel.KVGeometry`; ``resolve_model`` turns the user's MODEL
argument (a config.json, a model folder, a GGUF file, or a catalog name) into geometry and weight bytes.
"""
from __future__ import annotations

import json
import re
import struct
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvbench.kvmodel import (
    KVGeometry,
    engine_kv,
    geometry_from_gguf_keys,
    geometry_from_hf_config,
    gguf_keys,
    kv_bytes_per_token,
    load_hf_config,
)

CATALOG_DIR = Path(__file__).with_name("catalog")
GPUS_FILE = Path(__file__).with_name("gpus.toml")
GIB = 2**30
WEIGHT_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


class PlanError(ValueError):
    pass


def catalog_names() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob("*.json"))


def gpu_catalog() -> dict[str, int]:
    """{name: bytes}."""
    return {name: spec["memory_mib"] * 2**20 for name, spec in tomllib.loads(GPUS_FILE.read_text()).items()}


def gpu_memory(name_or_size: str) -> tuple[str, int]:
    """A GPU by catalog name (case-insensitive) or by size: '48GiB', '24GB', '80G'."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(gib|gb|g)\s*", name_or_size, re.IGNORECASE)
    if m:
        value, unit = float(m[1]), m[2].lower()
        return name_or_size.strip(), int(value * (1e9 if unit == "gb" else GIB))
    for name, size in gpu_catalog().items():
        if name.lower() == name_or_size.strip().lower().replace(" ", "-"):
            return name, size
    raise PlanError(f"unknown GPU {name_or_size!r}; known: {', '.join(gpu_catalog())} (or a size such as 48GiB)")


# --- weights ---------------------------------------------------------------------------------------

def safetensors_bytes(folder: Path) -> int:
    """Exact tensor bytes of every *.safetensors file, read from their headers."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    return total


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return int(sum(t.n_bytes for t in GGUFReader(str(path)).tensors))


def dense_parameter_count(config: dict) -> int:
    """Parameters of a dense decoder (Llama/Qwen2/Mistral/Gemma shape) computed from its config."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    vocab, inter = config["vocab_size"], config["intermediate_size"]
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o and k, v projections
    if config.get("attention_bias"):
        attn += heads * hd + 2 * kv * hd
    mlp = 3 * h * inter  # gate, up, down
    norms = (4 if str(config.get("model_type", "")).startswith("gemma") else 2) * h
    tied = config.get("tie_word_embeddings", False)
    return vocab * h * (1 if tied else 2) + layers * (attn + mlp + norms) + h


@dataclass(frozen=True)
class ModelForPlan:
    name: str
    geometry: KVGeometry
    weights_bytes: float
    weights_source: str


def resolve_model(model: str, weights_dtype: str = "bf16") -> ModelForPlan:
    """MODEL as a catalog name, a config.json, an HF model folder, or a GGUF file."""
    if weights_dtype not in WEIGHT_DTYPE_BYTES:
        raise PlanError(f"unknown weights dtype {weights_dtype!r}; known: {', '.join(WEIGHT_DTYPE_BYTES)}")
    path = Path(model).expanduser()
    if not path.exists():
        if (CATALOG_DIR / f"{model}.json").exists():
            path = CATALOG_DIR / f"{model}.json"
        else:
            raise PlanError(f"{model!r} is neither a file/folder nor a catalog model; catalog: {', '.join(catalog_names())}")
    if path.suffix == ".gguf":
        keys = gguf_keys(path)
        return ModelForPlan(path.stem, geometry_from_gguf_keys(keys, str(path)), gguf_tensor_bytes(path),
                            "GGUF tensor bytes")
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.exists():
        raise PlanError(f"{path} has no config.json")
    raw = json.loads(config_path.read_text())
    config = load_hf_config(config_path)
    geom = geometry_from_hf_config(config, str(config_path))
    name = path.name if path.is_dir() else path.stem
    if path.is_dir() and list(path.glob("*.safetensors")):
        return ModelForPlan(name, geom, safetensors_bytes(path), "safetensors tensor bytes")
    bytes_per = WEIGHT_DTYPE_BYTES[weights_dtype]
    if raw.get("kvbench_num_parameters"):
        params = raw["kvbench_num_parameters"]
        return ModelForPlan(name, geom, params * bytes_per, f"{params / 1e9:.1f} B published parameters x {bytes_per} B")
    try:
        params = dense_parameter_count(config)
    except KeyError as exc:
        raise PlanError(f"{config_path}: cannot count parameters without {exc.args[0]}; "
                        "give a folder with safetensors or a GGUF file") from None
    return ModelForPlan(name, geom, params * bytes_per,
                        f"{params / 1e9:.2f} B parameters (dense formula from the config) x {bytes_per} B")


# --- the plan --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanInput:
    model: ModelForPlan
    context: int
    batch: int
    kv_dtype: str = "bf16"
    tp: int = 1
    engine: str | None = None
    gpu: str | None = None
    overhead_gib: float = 1.5  # CUDA context, activations, graphs: an assumption, per GPU
    margin: float = 0.10  # fraction of the GPU kept free
    block_size: int | None = None


def _per_gpu_need(p: PlanInput, context: int, batch: int) -> tuple[float, float]:
    """(bytes one GPU needs, of which KV) for ``batch`` sequences of ``context`` tokens."""
    kv = engine_kv(p.model.geometry, p.kv_dtype, context, batch, p.engine, p.tp, p.block_size).bytes_per_rank
    if p.engine == "vllm":  # the null block
        bs = p.block_size or 16
        kv += bs * kv_bytes_per_token(p.model.geometry, p.kv_dtype, p.tp)
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
    if p.context < 1 or p.batch < 1:
        raise PlanError("--context and --batch must be >= 1")
    geom = p.model.geometry
    result = engine_kv(geom, p.kv_dtype, p.context, p.batch, p.engine, p.tp, p.block_size)
    kv_total = result.bytes_per_rank * p.tp
    out = {
        "model": p.model.name, "attention": geom.attention, "layers": geom.num_layers,
        "kv_heads": geom.num_kv_heads, "kv_heads_per_gpu": 1 if geom.mla else max(1, geom.num_kv_heads // p.tp),
        "head_dim_k": geom.head_dim_k, "head_dim_v": geom.head_dim_v,
        "sliding_window": geom.sliding_window, "sliding_layers": geom.num_sliding_layers,
        "max_context": geom.max_context, "context": p.context, "batch": p.batch, "kv_dtype": p.kv_dtype, "tp": p.tp,
        "engine": p.engine or "exact", "engine_rule": result.note,
        "kv_bytes": kv_total, "kv_bytes_per_gpu": result.bytes_per_rank,
        "kv_bytes_per_token": kv_total / (p.batch * p.context),
        "kv_bytes_per_token_formula": kv_bytes_per_token(geom, p.kv_dtype, p.tp) * p.tp,
        "weights_bytes": p.model.weights_bytes, "weights_source": p.model.weights_source,
    }
    if p.gpu:
        gpu_name, gpu_bytes = gpu_memory(p.gpu)
        usable = gpu_bytes * (1 - p.margin)
        need, _ = _per_gpu_need(p, p.context, p.batch)
        def fits_batch(b):
            return _per_gpu_need(p, p.context, b)[0] <= usable
        limit = geom.max_context or 10**7
        def fits_context(n):
            return _per_gpu_need(p, n, p.batch)[0] <= usable
        out.update({
            "gpu": gpu_name, "gpu_memory_bytes": gpu_bytes, "margin": p.margin, "usable_bytes": usable,
            "overhead_bytes": p.overhead_gib * GIB, "weights_bytes_per_gpu": p.model.weights_bytes / p.tp,
            "needed_bytes_per_gpu": need, "fits": need <= usable,
            "max_batch": max(0, _largest(fits_batch, 1, 1 << 20)),
            "max_context_at_batch": max(0, _largest(fits_context, 1, limit)),
        })
    return out
