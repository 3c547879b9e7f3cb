"""What a model's weights take: exact where its files say it, an estimate from its config where they do not.

Exact: the tensor bytes of every ``*.safetensors`` file (their headers), the ``total_size`` of
``model.safetensors.index.json`` (a hub download of the config and the index is enough), a GGUF's tensors, or
a hub repository's safetensors headers read through ``huggingface_hub.get_safetensors_metadata`` (range
requests, no download). Estimate: parameters counted from the config, split by module kind (embeddings,
lm_head, attention, MLA projections, dense MLP, routed and shared experts, routers, norms, Mamba mixers), each
kind at the width the checkpoint stores it: a quantised checkpoint's ``quantization_config`` (AWQ, GPTQ,
bitsandbytes, FP8, compressed-tensors, MXFP4, ModelOpt NVFP4/FP8: :mod:`kvbench.kv.quantized`) gives its
linear layers' bits and their scales/zeros, the rest stays at the checkpoint dtype; a plain checkpoint is its
parameter count times the weights dtype. Every figure is labelled with where it comes from, and "unknown"
(with the reason) when the config lacks what the count needs or names a quantisation kvbench cannot price.
The text model only: a multimodal model's vision tower is not counted, and the label says so.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path

from kvbench.kv import bounded, quantized
from kvbench.kv.checkpoint import Breakdown, Weights, _first, _Unknown, parameter_breakdown
from kvbench.kv.model_config import gguf_tensors

WEIGHT_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
# what for_model(weights_dtype=...) accepts: "auto" (the checkpoint's own width), the plain widths above, and
# the quantised formats an engine can load a 16-bit checkpoint into (linear layers only, with their scales)
WEIGHT_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4", "nf4", "mxfp4", "nvfp4")
# bytes per element of each safetensors dtype (F4 / F6 packed formats are fractions)
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                           "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
                           "I8": 1, "U8": 1, "BOOL": 1, "F6_E2M3": 0.75, "F6_E3M2": 0.75, "F4": 0.5}
CONFIG_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8}


# --- exact: files, the index, the hub ------------------------------------------------------------------

#: The safetensors format's own bound on a header (the library refuses a larger one: "HeaderTooLarge")
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000


def safetensors_bytes(folder: Path) -> int:
    """Exact tensor bytes of every *.safetensors file, read from their headers: each a regular file
    (:mod:`kvbench.kv.bounded`), its header within the format's bound and the file, JSON of at most
    :data:`~kvbench.kv.bounded.MAX_DEPTH` levels, every tensor's ``data_offsets`` two integers within the
    file; else InputError naming the file."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        fd = bounded.open_regular(f, "safetensors file")
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fd).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise bounded.InputError(f"safetensors file {f} is {size} bytes: too short for a header")
            (length,) = struct.unpack("<Q", head)
            if length > min(SAFETENSORS_HEADER_MAX_BYTES, size - 8):
                raise bounded.InputError(f"safetensors file {f}: its header claims {length:,} bytes, more than the "
                                         f"file's {size - 8:,} after the length or the format's "
                                         f"{SAFETENSORS_HEADER_MAX_BYTES:,} (damaged or not a safetensors file)")
            data = fh.read(length)
        header = bounded.parse_json(data, f, "safetensors header")
        if not isinstance(header, dict):
            raise bounded.InputError(f"safetensors file {f}: its header is not a JSON object")
        for name, t in header.items():
            if name == "__metadata__":
                continue
            offsets = t.get("data_offsets") if isinstance(t, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1] <= size):
                raise bounded.InputError(f"safetensors file {f}: tensor {name[:80]!r} has no data_offsets of two "
                                         f"integers within the file (damaged or not a safetensors file)")
            total += offsets[1] - offsets[0]
    return total


def index_total_size(folder: Path) -> int | None:
    """``metadata.total_size`` of model.safetensors.index.json (a sharded checkpoint's exact tensor bytes);
    None where there is none, or it is not one kvbench reads (a FIFO, too large or deep, not JSON)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return None
    try:
        size = bounded.read_json(index, what="safetensors index").get("metadata", {}).get("total_size")
    except (bounded.InputError, OSError, AttributeError):
        return None
    return int(size) if isinstance(size, (int, float)) and not isinstance(size, bool) and 0 < size < 2**63 else None


def gguf_tensor_bytes(path: Path) -> int:
    return sum(nbytes for _, nbytes in gguf_tensors(path))


def gguf_parameters(path: Path) -> int:
    return sum(values for values, _ in gguf_tensors(path))


def _tensor_bytes(tensor) -> float:
    """One tensor's bytes from a TensorInfo (or its dict form): its data offsets, else dtype x shape."""
    get = tensor.get if isinstance(tensor, dict) else (lambda name: getattr(tensor, name, None))
    offsets = get("data_offsets")
    if offsets and len(offsets) == 2:
        return offsets[1] - offsets[0]
    dtype = str(get("dtype"))
    if dtype not in SAFETENSORS_DTYPE_BYTES:
        raise ValueError(f"unknown safetensors dtype {dtype!r}")
    return math.prod(get("shape") or ()) * SAFETENSORS_DTYPE_BYTES[dtype]


def metadata_tensor_bytes(metadata) -> int:
    """The tensor bytes of a ``SafetensorsRepoMetadata`` (huggingface_hub's answer): every file's tensors."""
    files = metadata.files_metadata if not isinstance(metadata, dict) else metadata["files_metadata"]
    total = 0.0
    for file in files.values():
        tensors = file.tensors if not isinstance(file, dict) else file["tensors"]
        total += sum(_tensor_bytes(t) for t in tensors.values())
    return int(total)


def hub_safetensors_bytes(repo_id: str, api=None, revision: str | None = None) -> Weights:
    """A hub repository's exact tensor bytes from its safetensors headers (``get_safetensors_metadata`` reads
    them with range requests: no weights are downloaded). ``api``: an ``HfApi``-like object (tests give a fake).
    Unknown, with the reason, when the hub cannot be asked or the repository has no safetensors."""
    try:
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        metadata = api.get_safetensors_metadata(repo_id, revision=revision)
        total = metadata_tensor_bytes(metadata)
    except Exception as exc:  # noqa: BLE001 - offline, gated, not a safetensors repo, an unknown dtype: say which
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Weights(None, f"unknown: the hub's safetensors metadata of {repo_id} could not be read "
                             f"({type(exc).__name__}{': ' + first[:160] if first else ''})", method="unknown")
    if total <= 0:
        return Weights(None, f"unknown: the hub's safetensors metadata of {repo_id} lists no tensors", method="unknown")
    files = metadata.files_metadata if not isinstance(metadata, dict) else metadata["files_metadata"]
    return Weights(total, f"hub safetensors metadata of {repo_id} ({len(files)} file{'s' * (len(files) != 1)}, "
                          "tensor bytes from their headers)", exact=True, method="hub")


def of_folder(folder: Path, config_estimate: Weights) -> Weights:
    """A model folder's weights: its safetensors, else its index's total_size, else the config estimate."""
    exact = _folder_exact(folder)
    return exact if exact is not None else config_estimate


def _folder_exact(folder: Path) -> Weights | None:
    if list(folder.glob("*.safetensors")):
        try:
            return Weights(safetensors_bytes(folder), "safetensors tensor bytes", exact=True, method="safetensors")
        except bounded.InputError as exc:  # said, never a figure made up in its place
            return Weights(None, f"unknown: {exc}; give --weights-bytes", method="unknown")
    total = index_total_size(folder)
    if total:
        return Weights(total, "model.safetensors.index.json total_size", exact=True, method="index")
    return None


# --- the parameter breakdown: one list of parts, shared by the plain and the quantised estimate -----------


# --- the estimate ----------------------------------------------------------------------------------------

def checkpoint_dtype(text, wrapper=None) -> tuple[str, float, bool]:
    """(name, bytes per value, stated) of the dtype the checkpoint keeps its unquantised tensors in: the
    config's torch_dtype / dtype; bf16 (stated False) when the config names none."""
    for c in (text, wrapper):
        value = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None) if c is not None else None
        if value is not None:
            name = str(value).replace("torch.", "")
            if name in CONFIG_DTYPE_BYTES:
                return name, CONFIG_DTYPE_BYTES[name], True
    return "bfloat16", 2, False


def quantization_config(text, wrapper=None) -> dict | None:
    """The checkpoint's quantization_config (a dict), from the text config or the multimodal wrapper."""
    for c in (text, wrapper):
        qc = getattr(c, "quantization_config", None) if c is not None else None
        if qc is not None:
            return qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else vars(qc))
    return None


def _vision(b: Breakdown) -> str:
    return " (text model only: the vision tower is not counted)" if b.vision else ""


def _breakdown(text, wrapper) -> Breakdown | Weights:
    """The config's parameters by module kind, or the "unknown" Weights that says what the count lacks."""
    unset = getattr(text, "kvbench_unset", ())  # required fields the file lacks (model_config.parse_hf_dict)
    if unset:
        defaults = ", ".join(f"{name} {getattr(text, name, None)!r}" for name in unset)
        return Weights(None, f"unknown: the config gives no {' or '.join(unset)} (the {type(text).__name__} class's "
                             f"{defaults} is another model's; give a folder with safetensors or --weights-bytes)",
                       method="unknown")
    try:
        b = parameter_breakdown(text, wrapper)
        b.parameters  # noqa: B018 - a size that does not add up fails here, with the others, not in the caller
        return b
    except _Unknown as exc:
        return Weights(None, f"unknown: the config has no {exc} (give a folder with safetensors or a GGUF file)",
                       method="unknown")
    except (TypeError, ValueError, KeyError) as exc:
        return Weights(None, f"unknown: the config's sizes could not be counted ({exc})", method="unknown")


def estimate(text, wrapper, weights_dtype: str, hf_quant_config: dict | None = None) -> Weights:
    """The config estimate, or "unknown" with what is missing. A quantised checkpoint (its config has a
    quantization_config, or ModelOpt's hf_quant_config.json is given) is priced at its stored widths and the
    weights dtype is not used; otherwise its parameters times ``weights_dtype``."""
    b = _breakdown(text, wrapper)
    if isinstance(b, Weights):
        return b
    qc = quantization_config(text, wrapper)
    hf_quant_config = hf_quant_config or getattr(wrapper, "kvbench_hf_quant_config", None) or \
        getattr(text, "kvbench_hf_quant_config", None)
    if qc is not None or hf_quant_config:
        return quantized.estimate(b, qc, hf_quant_config, checkpoint_dtype(text, wrapper))
    return _plain(b, weights_dtype)


def _plain(b: Breakdown, weights_dtype: str) -> Weights:
    params = b.parameters
    per = WEIGHT_DTYPE_BYTES[weights_dtype]
    how = b.how.split("; the checkpoint also holds")[0]
    kinds = {k: v * per for k, v in b.by_kind().items() if k != "mtp"}
    return Weights(params * per, f"estimate: {params / 1e9:.2f} B parameters from the config ({how}) x {per} B"
                                 f"{_vision(b)}", parameters=params, breakdown=kinds, method="estimate")


def for_model(source=None, config=None, text=None, *, raw: dict | None = None, weights_dtype: str | None = None,
              weights_bytes: float | None = None, hub_id: str | None = None, api=None,
              revision: str | None = None, hf_quant_config: dict | None = None) -> Weights:
    """The weights of one model, from the best source there is.

    ``source``: the model's folder, its config.json or a GGUF file (None: none on disk). ``config``/``text``:
    the transformers config objects of ``model_config.parse_hf_dict`` (the wrapper and its language model;
    ``text`` defaults to ``config``). ``raw``: the config.json's dict (a catalog entry's ``kvbench_total_size``,
    ``kvbench_num_parameters`` and ``kvbench_hf_quant_config`` are read from it). ``weights_dtype``: None or
    "auto" for the checkpoint's own widths; one of WEIGHT_DTYPES for the width an engine loads it at (it
    replaces an exact figure whose width differs). ``weights_bytes``: the user's own figure, which wins.
    ``hub_id``: ask the hub's safetensors headers when nothing on disk is exact (``api``: an HfApi-like object).

    Precedence: the user's bytes > local safetensors / GGUF > the index's total_size > a catalog's recorded
    total_size > the hub's safetensors metadata > the quantization_config estimate > the plain estimate."""
    if weights_bytes is not None:
        if weights_bytes <= 0:
            return Weights(None, f"unknown: a weights size must be positive, not {weights_bytes}", method="unknown")
        return Weights(float(weights_bytes), f"given: {weights_bytes / 2**30:.2f} GiB", method="user")
    if weights_dtype == "auto":
        weights_dtype = None
    if weights_dtype is not None and weights_dtype not in WEIGHT_DTYPES:
        return Weights(None, f"unknown: weights dtype {weights_dtype!r} (known: {', '.join(WEIGHT_DTYPES)})",
                       method="unknown")
    raw = raw or {}
    path = Path(source).expanduser() if source is not None else None
    if path is not None and path.suffix == ".gguf" and path.exists():
        return Weights(gguf_tensor_bytes(path), "GGUF tensor bytes", exact=True, method="gguf")
    folder = (path if path.is_dir() else path.parent) if path is not None else None
    if hf_quant_config is None and folder is not None and (folder / "hf_quant_config.json").exists():
        try:  # a regular file within bounds (kvbench.kv.bounded)
            hf_quant_config = bounded.read_json(folder / "hf_quant_config.json", what="hf_quant_config.json")
        except (OSError, bounded.InputError):
            hf_quant_config = None
        if not isinstance(hf_quant_config, dict):
            hf_quant_config = None
    hf_quant_config = hf_quant_config or raw.get("kvbench_hf_quant_config")
    text = text if text is not None else config

    if weights_dtype is not None and not _same_width(weights_dtype, text, config, hf_quant_config):
        exact = _exact(folder, raw, None, None, None)  # named beside the override; the hub is not asked
        over = _override(text, config, weights_dtype)
        if exact is not None and exact.bytes is not None and over.bytes is not None:
            over = Weights(over.bytes, f"{over.source}; the checkpoint itself: {exact.bytes / 2**30:.2f} GiB "
                                       f"({exact.source})", parameters=over.parameters, breakdown=over.breakdown,
                           method=over.method)
        return over
    exact = _exact(folder, raw, hub_id, api, revision)
    if exact is not None and exact.bytes is not None:
        return _with_mtp(exact, text, config, hf_quant_config)
    if config is None:
        return exact or Weights(None, "unknown: no config and no exact source", method="unknown")
    published = raw.get("kvbench_num_parameters")
    if published and quantization_config(text, config) is None and not hf_quant_config:
        per = WEIGHT_DTYPE_BYTES[weights_dtype or _dtype_name(text, config)]
        return Weights(published * per, f"{published / 1e9:.1f} B published parameters x {per} B",
                       parameters=published, method="published")
    found = estimate(text, config, weights_dtype or _dtype_name(text, config), hf_quant_config)
    if exact is not None and exact.method == "unknown" and found.bytes is not None:  # the hub could not be read
        found = Weights(found.bytes, f"{found.source} [{exact.source}]", parameters=found.parameters,
                        breakdown=found.breakdown, method=found.method)
    return found


def _with_mtp(exact: Weights, text, config, hf_quant_config) -> Weights:
    """An exact figure of a checkpoint that carries MTP layers says how much of it they are (estimated:
    engines load them only to speculate); its breakdown is then {"mtp": bytes}."""
    if config is None or not _first(text, "num_nextn_predict_layers"):
        return exact
    mtp = estimate(text, config, _dtype_name(text, config), hf_quant_config).breakdown.get("mtp")
    if not mtp:
        return exact
    return Weights(exact.bytes, f"{exact.source}; of which about {mtp / 2**30:.2f} GiB are MTP layers (loaded "
                                "only to speculate)", exact=True, parameters=exact.parameters,
                   breakdown={"mtp": mtp}, method=exact.method)


def _dtype_name(text, config) -> str:
    name = checkpoint_dtype(text, config)[0]
    return {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16"}.get(name, "bf16")


def _same_width(weights_dtype: str, text, config, hf_quant_config) -> bool:
    """Whether the dtype asked for is what the checkpoint stores (then its exact figure stands)."""
    if config is None:
        return False
    if quantization_config(text, config) is not None or hf_quant_config:
        return False
    return WEIGHT_DTYPE_BYTES.get(weights_dtype) == checkpoint_dtype(text, config)[1]


def _exact(folder: Path | None, raw: dict, hub_id: str | None, api, revision) -> Weights | None:
    if folder is not None and folder.exists():
        found = _folder_exact(folder)
        if found is not None:
            return found
    recorded = raw.get("kvbench_total_size")
    if isinstance(recorded, (int, float)) and recorded > 0:
        where = raw.get("kvbench_total_size_source") or "the catalog"
        return Weights(int(recorded), f"the checkpoint's published tensor bytes (recorded in the catalog from {where})",
                       exact=True, method="catalog")
    if hub_id:
        return hub_safetensors_bytes(hub_id, api, revision)
    return None


def _override(text, config, weights_dtype: str) -> Weights:
    """The weights at a width the user names: 16/32-bit is every parameter at it; a quantised width is the
    linear layers at it (with the format's scales), the rest at the checkpoint's 16-bit dtype."""
    b = _breakdown(text, config)
    if isinstance(b, Weights):
        return b
    if weights_dtype in ("fp32", "bf16", "fp16"):
        w = _plain(b, weights_dtype)
        return Weights(w.bytes, w.source.replace("estimate:", f"--weights-dtype {weights_dtype}:", 1),
                       parameters=w.parameters, breakdown=w.breakdown, method="override")
    name, per, _ = checkpoint_dtype(text, config)
    if per > 2:  # a 32-bit checkpoint an engine quantises keeps the rest at 16 bits
        name, per = "bfloat16", 2
    return quantized.override(b, weights_dtype, (name, per, True))
