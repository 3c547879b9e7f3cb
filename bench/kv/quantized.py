"""What a quantised checkpoint's weights take, from its ``quantization_config`` (or ModelOpt's
``hf_quant_config.json``): each part of :func:`kvbench.kv.checkpoint.parameter_breakdown` at the width the
checkpoint stores it.

Quantised linear layers cost their bits plus the format's metadata; everything a format leaves alone
(embeddings, lm_head unless the format says otherwise, norms, biases, routers, the modules its ignore list
names) stays at the checkpoint dtype. The formats, as their checkpoints lay the tensors out
(rows = out_features N, cols = in_features K, G = ceil(K / group)):

- AWQ (AutoAWQ GEMM/GEMV): qweight int32 [K, N*b/32], qzeros int32 [G, N*b/32] (when zero_point), scales
  fp16 [G, N]; ``modules_to_not_convert`` (substring match, as transformers does).
- GPTQ (AutoGPTQ / optimum / GPTQModel): qweight int32 [K*b/32, N], qzeros int32 [G, N*b/32] (stored even
  when sym), scales fp16 [G, N], g_idx int32 [K] (stored whatever desc_act); ``lm_head`` true quantises the
  head; ``modules_in_block_to_quantize`` restricts what is quantised.
- bitsandbytes 4-bit (nf4 / fp4): uint8 [N*K/2], an absmax per 64 values (fp32, or uint8 with double
  quantisation plus an fp32 absmax per 256 blocks and a 256-entry map), a 16-entry quant map and the
  quant-state record; 8-bit: int8 [N, K] and an fp32 SCB per row; lm_head and ``llm_int8_skip_modules`` stay.
- FP8 (``quant_method: fp8``): e4m3 [N, K] plus, with ``weight_block_size`` [bn, bk] (DeepSeek), an fp32
  ``weight_scale_inv`` per block, else one fp32 scale per tensor (and an input scale when static);
  fbgemm_fp8: an fp32 scale per row.
- compressed-tensors: each ``config_groups`` entry's ``weights`` (num_bits, type, strategy tensor / channel /
  group / block / tensor_group, group_size, symmetric) in the checkpoint's ``format`` (float-, int-, naive-,
  pack-, nvfp4-pack-, mxfp4-pack-quantized), on the modules its ``targets`` name, less its ``ignore`` list.
- MXFP4 (gpt-oss): the experts' ``*_blocks`` (4-bit, uint8 [.., K/32, 16]) and ``*_scales`` (a uint8 E8M0
  scale per 32 values); the rest bf16.
- ModelOpt NVFP4: uint8 [N, K/2], an fp8 scale per 16 values, an fp32 global scale and an input scale;
  ModelOpt FP8: e4m3 plus fp32 per-tensor scales; ``exclude_modules`` stay.

A quant_method not listed here is "unknown" with the reason, never priced as 16-bit.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from kvbench.kv.checkpoint import Breakdown, Weights

KNOWN = ("awq", "gptq", "bitsandbytes", "fp8", "fbgemm_fp8", "compressed-tensors", "mxfp4", "modelopt")
GIB = 2**30


class Unknown(Exception):
    """A quantization config kvbench cannot price; the message says why."""


@dataclass(frozen=True)
class Scheme:
    method: str
    label: str  # the format in words: "awq, 4-bit, group 128, zero points"
    quant: object  # (name, kind, rows, cols) -> bytes of one quantised matrix, or None: not quantised
    lm_head: bool = False  # the format quantises lm_head (when its ignore list does not name it)
    notes: tuple[str, ...] = ()


def _groups(cols: int, group) -> int:
    return 1 if not group or group <= 0 else math.ceil(cols / group)


def _names(name: str) -> tuple[str, ...]:
    """The name and its expert-0 form (ignore lists name experts one by one: ``mlp.experts.0.up_proj``)."""
    return (name, name.replace(".experts.", ".experts.0.")) if ".experts." in name else (name,)


def _matches(name: str, pattern: str, substring: bool) -> bool:
    """Whether a module name matches one entry of an ignore / not-convert list: ``re:`` a regular expression
    (compressed-tensors), a glob (``model.layers.*.self_attn``) on the name or any dotted prefix of it, else a
    substring (transformers' AWQ / GPTQ / bitsandbytes) or a whole dotted component run (vLLM's FP8, ModelOpt)."""
    if not isinstance(pattern, str) or not pattern:
        return False
    for n in _names(name):
        if pattern.startswith("re:"):
            if re.match(pattern[3:], n):
                return True
        elif any(c in pattern for c in "*?["):
            pieces = n.split(".")
            if any(fnmatchcase(".".join(pieces[:k]), pattern) for k in range(1, len(pieces) + 1)):
                return True
        elif substring:
            if pattern in n:
                return True
        elif f".{pattern}." in f".{n}.":
            return True
    return False


def _skipped(name: str, patterns, substring: bool) -> bool:
    return _matcher(tuple(p if isinstance(p, str) else "" for p in (patterns or ())), substring)(name)


@functools.lru_cache(maxsize=32)
def _matcher(patterns: tuple[str, ...], substring: bool):
    """:func:`_matches` over every pattern of a list, as one function: the plain names (most of a ModelOpt or
    FP8 exclude list, one per layer) looked up in a set, the globs and regular expressions tried one by one
    (a checkpoint's list of hundreds against its thousands of module names is otherwise most of a plan)."""
    plain = frozenset(p for p in patterns if p and not p.startswith("re:") and not any(c in p for c in "*?["))
    others = [p for p in patterns if p and p not in plain]

    def skipped(name: str) -> bool:
        for n in _names(name):
            if substring:
                if any(p in n for p in plain):
                    return True
            elif plain:
                parts = n.split(".")
                if any(".".join(parts[i:j]) in plain for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)):
                    return True
        return any(_matches(name, p, substring) for p in others)
    return skipped


def _int(qc: dict, *keys, default=None):
    for key in keys:
        value = qc.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise Unknown(f"quantization_config {key} is {value!r}, not a number")
            return int(value)
    return default


# --- the formats -------------------------------------------------------------------------------------------

def _awq(qc: dict) -> Scheme:
    bits = _int(qc, "bits", "w_bit", default=4)
    group = _int(qc, "group_size", "q_group_size", default=128)
    zero = qc.get("zero_point", True) is not False
    skip = qc.get("modules_to_not_convert") or ()

    def quant(name, kind, rows, cols):
        if _skipped(name, skip, True):
            return None
        g = _groups(cols, group)
        return rows * cols * bits / 8 + g * rows * 2 + (g * rows * bits / 8 if zero else 0)
    label = f"awq, {bits}-bit, group {group if group and group > 0 else 'per channel'}" + (", zero points" if zero else "")
    return Scheme("awq", label, quant)


def _gptq(qc: dict) -> Scheme:
    bits = _int(qc, "bits", default=4)
    group = _int(qc, "group_size", default=128)
    skip = qc.get("modules_to_not_convert") or ()
    inside = qc.get("modules_in_block_to_quantize")
    inside = {n for block in inside for n in (block if isinstance(block, list) else [block])} if inside else None

    def quant(name, kind, rows, cols):
        if _skipped(name, skip, True):
            return None
        if inside is not None and name.startswith("model.layers."):
            relative = name.split(".", 3)[3]
            if not any(r in inside for r in _names(relative)):
                return None
        g = _groups(cols, group)
        return (rows * cols * bits / 8 + g * math.ceil(rows * bits / 32) * 4 + g * rows * 2 + cols * 4)
    flags = [f"group {group if group and group > 0 else 'per channel'}"]
    flags += ["desc_act"] if qc.get("desc_act") else []
    flags += ["sym"] if qc.get("sym", True) else ["asym"]
    fmt = qc.get("checkpoint_format") or qc.get("format")
    flags += [str(fmt)] if fmt and fmt != "gptq" else []
    return Scheme("gptq", f"gptq, {bits}-bit, {', '.join(flags)}", quant, lm_head=bool(qc.get("lm_head")))


def _bnb(qc: dict) -> Scheme:
    skip = list(qc.get("llm_int8_skip_modules") or ())
    four = qc.get("load_in_4bit") or qc.get("_load_in_4bit")
    eight = qc.get("load_in_8bit") or qc.get("_load_in_8bit")
    if four:
        kind4 = str(qc.get("bnb_4bit_quant_type") or "fp4")
        double = bool(qc.get("bnb_4bit_use_double_quant"))
        block = 64

        def quant(name, kind, rows, cols):
            if _skipped(name, skip, True):
                return None
            n = rows * cols
            blocks = math.ceil(n / block)
            meta = (blocks + math.ceil(blocks / 256) * 4 + 256 * 4) if double else blocks * 4
            return n / 2 + meta + 16 * 4 + 200  # + the quant map and the quant-state record
        return Scheme("bitsandbytes", f"bitsandbytes {kind4}, 4-bit, an absmax per {block}"
                                      + (", double quant" if double else ""), quant)
    if eight:
        def quant8(name, kind, rows, cols):
            return None if _skipped(name, skip, True) else rows * cols + rows * 4
        return Scheme("bitsandbytes", "bitsandbytes LLM.int8, an fp32 scale per row", quant8)
    raise Unknown("quantization_config bitsandbytes without load_in_4bit or load_in_8bit")


def _fp8(qc: dict) -> Scheme:
    block = qc.get("weight_block_size")
    skip = list(qc.get("modules_to_not_convert") or ()) + list(qc.get("ignored_layers") or ())
    fmt = qc.get("fmt") or "e4m3"
    if block:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise Unknown(f"quantization_config weight_block_size is {block!r}, not [rows, cols]")
        bn, bk = block

        def quant(name, kind, rows, cols):
            return None if _skipped(name, skip, False) else rows * cols + math.ceil(rows / bn) * math.ceil(cols / bk) * 4
        return Scheme("fp8", f"fp8 {fmt}, blocks {bn}x{bk}, an fp32 scale_inv per block", quant)
    static = qc.get("activation_scheme") == "static"

    def quant_t(name, kind, rows, cols):
        return None if _skipped(name, skip, False) else rows * cols + 4 + (4 if static else 0)
    return Scheme("fp8", f"fp8 {fmt}, an fp32 scale per tensor" + (" (+ static input scales)" if static else ""), quant_t)


def _fbgemm_fp8(qc: dict) -> Scheme:
    skip = qc.get("modules_to_not_convert") or ()

    def quant(name, kind, rows, cols):
        return None if _skipped(name, skip, True) else rows * cols + rows * 4
    return Scheme("fbgemm_fp8", "fbgemm fp8, an fp32 scale per row", quant)


def _mxfp4(qc: dict) -> Scheme:
    skip = qc.get("modules_to_not_convert") or ()

    def quant(name, kind, rows, cols):  # transformers / vLLM quantise the MoE experts only
        if kind not in ("experts", "mtp") or ".experts." not in name or _skipped(name, skip, False):
            return None
        return rows * cols / 2 + rows * cols / 32
    return Scheme("mxfp4", "mxfp4, the experts at 4 bits with a uint8 scale per 32", quant)


def _modelopt(q: dict) -> Scheme:
    algo = str(q.get("quant_algo") or "").upper()
    skip = list(q.get("exclude_modules") or ()) + list(q.get("ignore") or ())
    group = _int(q, "group_size")
    if algo == "NVFP4":
        g = group or 16

        def quant(name, kind, rows, cols):
            return None if _skipped(name, skip, False) else rows * cols / 2 + rows * cols / g + 8
        return Scheme("modelopt", f"modelopt NVFP4, 4-bit with an fp8 scale per {g} and an fp32 global scale",
                      quant, lm_head=True)
    if algo == "FP8":
        def quant8(name, kind, rows, cols):
            return None if _skipped(name, skip, False) else rows * cols + 8
        return Scheme("modelopt", "modelopt FP8, fp32 scales per tensor", quant8, lm_head=True)
    if algo in ("W4A16_AWQ", "W4A8_AWQ", "INT4_AWQ"):
        g = group or 128

        def quant4(name, kind, rows, cols):
            return None if _skipped(name, skip, False) else rows * cols / 2 + rows * _groups(cols, g) * 2
        return Scheme("modelopt", f"modelopt {algo}, 4-bit with an fp16 scale per {g}", quant4, lm_head=True)
    raise Unknown(f"modelopt quant_algo {algo or 'missing'!r} is not one kvbench can price "
                  "(known: NVFP4, FP8, W4A16_AWQ, W4A8_AWQ)")


CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized", "nvfp4-pack-quantized",
              "mxfp4-pack-quantized")


def _compressed_tensors(qc: dict, dtype_bytes: float) -> Scheme:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise Unknown("compressed-tensors quantization_config without config_groups")
    ignore = qc.get("ignore") or ()
    top_format = qc.get("format")
    specs = []
    for gname, g in groups.items():
        w = (g or {}).get("weights")
        if not w:
            continue  # an activation-only group: the weights stay
        fmt = g.get("format") or top_format
        if fmt not in CT_FORMATS:
            raise Unknown(f"compressed-tensors format {fmt!r} is not one kvbench can price (known: {', '.join(CT_FORMATS)})")
        bits = w.get("num_bits")
        if not isinstance(bits, int) or bits <= 0:
            raise Unknown(f"compressed-tensors {gname} weights num_bits is {bits!r}")
        specs.append((list(g.get("targets") or ["Linear"]), fmt, w))
    if not specs:
        raise Unknown("compressed-tensors config_groups quantise no weights")

    def target(name, targets):
        return any(t == "Linear" or _matches(name, t, False) for t in targets)

    def quant(name, kind, rows, cols):
        if _skipped(name, ignore, False):
            return None
        for targets, fmt, w in specs:
            if target(name, targets):
                return _ct_bytes(fmt, w, rows, cols, dtype_bytes)
        return None

    def word(fmt, w):
        strategy = w.get("strategy") or "tensor"
        size = f" {w.get('group_size')}" if strategy in ("group", "tensor_group") and w.get("group_size") else ""
        if strategy == "block" and w.get("block_structure"):
            size = f" {'x'.join(str(b) for b in w['block_structure'])}"
        return f"{fmt}: {w.get('type', 'int')}{w['num_bits']} {strategy}{size}" + \
            ("" if w.get("symmetric", True) else " asym")
    label = "compressed-tensors, " + "; ".join(word(fmt, w) for _, fmt, w in specs)
    return Scheme("compressed-tensors", label, quant, lm_head=True)


def _ct_bytes(fmt: str, w: dict, rows: int, cols: int, dtype_bytes: float) -> float:
    bits = w["num_bits"]
    n = rows * cols
    strategy = w.get("strategy") or "tensor"
    scale_bytes = dtype_bytes
    if fmt == "nvfp4-pack-quantized":
        values, scale_bytes, extra = n / 2, 1, 8  # fp8 scales per 16 + fp32 global weight / input scales
    elif fmt == "mxfp4-pack-quantized":
        values, scale_bytes, extra = n / 2, 1, 0
    elif fmt == "pack-quantized":
        values, extra = n * bits / 8, 16  # int32-packed values + weight_shape
    elif fmt == "float-quantized":
        values, extra = n * bits / 8, 0
    else:  # int- / naive-quantized: one int8 per value
        values, extra = n * math.ceil(bits / 8), 0
    if strategy == "tensor":
        scales = 1
    elif strategy == "channel":
        scales = rows
    elif strategy in ("group", "tensor_group"):
        scales = rows * _groups(cols, w.get("group_size") or (16 if fmt == "nvfp4-pack-quantized" else 128))
    elif strategy == "block":
        bn, bk = w.get("block_structure") or (128, 128)
        scales = math.ceil(rows / bn) * math.ceil(cols / bk)
    else:
        raise Unknown(f"compressed-tensors weights strategy {strategy!r} is not one kvbench can price")
    zeros = 0.0
    if w.get("symmetric", True) is False:
        zeros = scales * (bits / 8 if fmt == "pack-quantized" else 1)
    return values + scales * scale_bytes + zeros + extra


def scheme(qc: dict | None, hf_quant_config: dict | None = None, dtype_bytes: float = 2) -> Scheme:
    """The format of a quantization_config (and/or ModelOpt's hf_quant_config.json); Unknown when kvbench
    cannot price it."""
    if hf_quant_config and not qc:
        q = hf_quant_config.get("quantization", hf_quant_config)
        return _modelopt(q if isinstance(q, dict) else {})
    if not isinstance(qc, dict):
        raise Unknown(f"quantization_config is {type(qc).__name__}, not an object")
    method = str(qc.get("quant_method") or "").lower().replace("_", "-") if qc.get("quant_method") else ""
    method = {"fbgemm-fp8": "fbgemm_fp8", "compressed_tensors": "compressed-tensors"}.get(method, method)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "bitsandbytes":
        return _bnb(qc)
    if method == "fp8":
        return _fp8(qc)
    if method == "fbgemm_fp8":
        return _fbgemm_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, dtype_bytes)
    if method == "mxfp4":
        return _mxfp4(qc)
    if method == "modelopt":
        return _modelopt(qc)
    if not method:
        raise Unknown("the quantization_config names no quant_method")
    raise Unknown(f"quant_method {method!r} is not one kvbench can price (known: {', '.join(KNOWN)})")


# --- the estimate ----------------------------------------------------------------------------------------

def price(b: Breakdown, s: Scheme, dtype_bytes: float) -> tuple[float, dict[str, float], float, float]:
    """(total bytes, bytes by kind, parameters in quantised matrices, their bytes) of a breakdown."""
    kinds: dict[str, float] = {}
    q_params = q_bytes = 0.0
    for part in b.parts:
        for _, name in part.names():
            quantisable = part.role == "linear" or (part.role == "lm_head" and s.lm_head)
            q = s.quant(name, part.kind, part.rows, part.cols) if quantisable else None
            if q is None:
                cost = part.per_layer * dtype_bytes
            else:
                cost = q * part.copies
                q_params += part.per_layer
                q_bytes += cost
            kinds[part.kind] = kinds.get(part.kind, 0.0) + cost
    return sum(kinds.values()), kinds, q_params, q_bytes


def estimate(b: Breakdown, qc: dict | None, hf_quant_config: dict | None, dtype: tuple[str, float, bool]) -> Weights:
    """A quantised checkpoint's bytes from its config, or "unknown" (with the reason) for a format kvbench
    cannot price."""
    name, dtype_bytes, stated = dtype
    try:
        s = scheme(qc, hf_quant_config, dtype_bytes)
        total, kinds, q_params, q_bytes = price(b, s, dtype_bytes)
    except Unknown as exc:
        return Weights(None, f"unknown: {exc} (give a folder with its safetensors, its hub id, or the weights size)",
                       parameters=b.parameters, method="unknown")
    return Weights(total, _words(f"estimate from quantization_config ({s.label})", b, total, kinds, q_params,
                                 q_bytes, name, dtype_bytes, stated), parameters=b.parameters, breakdown=kinds,
                   method="quantization_config")


def _words(head: str, b: Breakdown, total, kinds, q_params, q_bytes, name, dtype_bytes, stated) -> str:
    params = b.parameters
    how = b.how.split("; the checkpoint also holds")[0]
    rest = sum(p.parameters for p in b.parts) - q_params
    per_q = q_bytes / q_params if q_params else 0
    dtype = f"{name} ({dtype_bytes:g} B)" + ("" if stated else ", assumed: the config names no dtype")
    out = (f"{head}: {total / GIB:.2f} GiB; {params / 1e9:.2f} B parameters ({how}); "
           f"{q_params / 1e9:.2f} B in quantised layers at {per_q:.3f} B each with their scales, "
           f"{rest / 1e9:.2f} B at {dtype}")
    if kinds.get("mtp"):
        out += f"; includes {kinds['mtp'] / GIB:.2f} GiB of MTP layers (loaded only to speculate)"
    if not q_params:
        out += "; the config quantises none of the layers counted"
    if b.vision:
        out += " (text model only: the vision tower is not counted)"
    return out


# the formats a 16-bit checkpoint can be loaded into (--weights-dtype): the linear layers at that width
OVERRIDES = {
    "fp8": ("fp8 e4m3, an fp32 scale per tensor (vLLM --quantization fp8)", lambda n, k: n * k + 4),
    "int8": ("int8, an fp16 scale per row", lambda n, k: n * k + n * 2),
    "int4": ("int4, group 128 with an fp16 scale and a 4-bit zero (AWQ / GPTQ layout)",
             lambda n, k: n * k / 2 + _groups(k, 128) * n * 2.5),
    "nf4": ("bitsandbytes nf4, an absmax per 64, double quant",
            lambda n, k: n * k / 2 + math.ceil(n * k / 64) * (1 + 4 / 256)),
    "mxfp4": ("mxfp4, a uint8 scale per 32", lambda n, k: n * k / 2 + n * k / 32),
    "nvfp4": ("nvfp4, an fp8 scale per 16 and an fp32 global scale", lambda n, k: n * k / 2 + n * k / 16 + 8),
}


def override(b: Breakdown, weights_dtype: str, dtype: tuple[str, float, bool]) -> Weights:
    """The weights when an engine loads the model's linear layers at ``weights_dtype`` (embeddings, lm_head,
    norms and routers at the checkpoint's 16-bit dtype)."""
    label, cost = OVERRIDES[weights_dtype]
    s = Scheme("override", label, lambda name, kind, rows, cols: cost(rows, cols))
    name, dtype_bytes, stated = dtype
    b = Breakdown(tuple(p for p in b.parts if p.kind != "mtp"), b.how, b.vision)  # engines skip the MTP layers
    total, kinds, q_params, q_bytes = price(b, s, dtype_bytes)
    return Weights(total, _words(f"--weights-dtype {weights_dtype} ({label})", b, total, kinds, q_params, q_bytes,
                                 name, dtype_bytes, stated), parameters=b.parameters, breakdown=kinds,
                   method="override")
