"""What a model's weights take: exact where its files say it, an estimate from its config where they do not.

Exact: the tensor bytes of every ``*.safetensors`` file (their headers), the ``total_size`` of
``model.safetensors.index.json`` (a hub download of the config and the index is enough), or a GGUF's
tensors. Estimate: parameters counted from the config, experts included (routed and shared, with the dense
layers an MoE keeps before or between its MoE layers), times the weights dtype; labelled an estimate, and
"unknown" (with the reason) when the config lacks what the count needs. The text model only: a
multimodal model's vision tower is not counted, and the label says so.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

WEIGHT_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
# architectures whose MLP has two matrices (up, down) rather than three (gate, up, down)
UNGATED_MLP = {"gpt2", "opt", "falcon", "RefinedWeb", "RefinedWebModel", "gpt_neox", "gptj", "bloom", "gpt_bigcode",
               "mpt", "phi", "starcoder2", "stablelm_epoch"}
FALCON = ("falcon", "RefinedWeb", "RefinedWebModel")


@dataclass(frozen=True)
class Weights:
    bytes: float | None  # None: unknown
    source: str  # where the figure comes from, or why it is unknown
    exact: bool = False
    parameters: float | None = None


def safetensors_bytes(folder: Path) -> int:
    """Exact tensor bytes of every *.safetensors file, read from their headers."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    return total


def index_total_size(folder: Path) -> int | None:
    """``metadata.total_size`` of model.safetensors.index.json (a sharded checkpoint's exact tensor bytes)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return None
    try:
        size = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    except (json.JSONDecodeError, AttributeError):
        return None
    return int(size) if isinstance(size, (int, float)) and size > 0 else None


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return int(sum(t.n_bytes for t in GGUFReader(str(path)).tensors))


def of_folder(folder: Path, config_estimate: "Weights") -> Weights:
    """A model folder's weights: its safetensors, else its index's total_size, else the config estimate."""
    if list(folder.glob("*.safetensors")):
        return Weights(safetensors_bytes(folder), "safetensors tensor bytes", exact=True)
    total = index_total_size(folder)
    if total:
        return Weights(total, "model.safetensors.index.json total_size", exact=True)
    return config_estimate


# --- the estimate -----------------------------------------------------------------------------------

def _first(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


class _Unknown(Exception):
    pass


def _need(config, *names):
    value = _first(config, *names)
    if value is None:
        raise _Unknown(" or ".join(names))
    return value


def estimate_parameters(text, wrapper=None) -> tuple[float, str]:
    """(parameters, how counted) of the text model a transformers config object describes."""
    model_type = str(getattr(text, "model_type", ""))
    h = _need(text, "hidden_size", "n_embd", "d_model")
    layers = _need(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _need(text, "num_attention_heads", "n_head")
    vocab = _need(text, "vocab_size", "padded_vocab_size")
    heads = max(heads) if isinstance(heads, list) else heads
    hd = _first(text, "head_dim") if isinstance(_first(text, "head_dim"), int) else None
    hd = hd or h // heads
    kv = _first(text, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num") or heads
    kv = max(kv) if isinstance(kv, list) else kv
    if model_type in FALCON and getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv = 1

    # attention
    if getattr(text, "kv_lora_rank", None):
        rank, rope = text.kv_lora_rank, text.qk_rope_head_dim
        nope, v = _need(text, "qk_nope_head_dim"), _need(text, "v_head_dim")
        q_rank = getattr(text, "q_lora_rank", None)
        q = (h * q_rank + q_rank + q_rank * heads * (nope + rope)) if q_rank else h * heads * (nope + rope)
        attn = q + h * (rank + rope) + rank + rank * heads * (nope + v) + heads * v * h
    else:
        attn = h * heads * hd * 2 + h * kv * hd * 2
        if getattr(text, "attention_bias", False) or model_type.startswith("qwen2"):
            attn += heads * hd + 2 * kv * hd

    # MLP: dense or experts
    gated = model_type not in UNGATED_MLP
    mats = 3 if gated else 2
    dense_inter = _first(text, "intermediate_size_mlp", "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")
    if dense_inter is None and not gated:
        dense_inter = 4 * h  # GPT-2, Falcon, BLOOM: the MLP is 4 x hidden
    experts = _first(text, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
    if experts:
        expert_inter = _need(text, "moe_intermediate_size", "intermediate_size")
        shared = (_first(text, "n_shared_experts") or 0) * expert_inter
        shared = shared or _first(text, "shared_expert_intermediate_size") or 0
        if model_type.startswith("llama4"):
            shared = _need(text, "intermediate_size")  # one shared expert beside the routed ones
        moe_mlp = mats * h * (experts * expert_inter + shared) + h * experts  # + the router
        moe_layers = _moe_layers(text, layers, model_type)
        dense_layers = layers - moe_layers
        if dense_layers and dense_inter is None:
            raise _Unknown("intermediate_size")
        mlp_total = moe_layers * moe_mlp + dense_layers * mats * h * (dense_inter or 0)
        how = (f"{experts} routed experts of {expert_inter}" + (f" + shared {shared}" if shared else "")
               + f" on {moe_layers} of {layers} layers")
    else:
        if dense_inter is None:
            raise _Unknown("intermediate_size")
        mlp_total = layers * mats * h * dense_inter
        how = "dense"
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(wrapper, "tie_word_embeddings", False))
    mamba = _mamba_layers(text, layers)
    if mamba:  # Jamba, Bamba ...: those layers hold a Mamba mixer instead of attention
        attn_total = (layers - mamba) * attn + mamba * _mamba_mixer(text, h)
        how += f"; {mamba} Mamba layers"
    else:
        attn_total = layers * attn
    total = vocab * h * (1 if tied else 2) + attn_total + layers * 2 * h + mlp_total + h
    return float(total), how


def _moe_layers(text, layers: int, model_type: str) -> int:
    """How many layers have experts: DeepSeek's first_k_dense_replace and moe_layer_freq, Qwen's
    mlp_only_layers and decoder_sparse_step, Llama 4's interleave_moe_layer_step / moe_layers."""
    listed = getattr(text, "moe_layers", None)
    if isinstance(listed, (list, tuple)):
        return len(listed)
    first_dense = getattr(text, "first_k_dense_replace", None) or 0
    freq = getattr(text, "moe_layer_freq", None) or 1
    if getattr(text, "first_k_dense_replace", None) is not None:
        return sum(1 for i in range(layers) if i >= first_dense and (i - first_dense) % freq == 0)
    step = getattr(text, "interleave_moe_layer_step", None)
    if step:
        return sum(1 for i in range(layers) if (i + 1) % step == 0)
    period = getattr(text, "expert_layer_period", None)  # Jamba: experts every period-th layer from the offset
    if period:
        offset = getattr(text, "expert_layer_offset", None) or 0
        return sum(1 for i in range(layers) if i % period == offset)
    mlp_only = set(getattr(text, "mlp_only_layers", None) or ())
    sparse_step = getattr(text, "decoder_sparse_step", None) or 1
    return sum(1 for i in range(layers) if i not in mlp_only and (i + 1) % sparse_step == 0)


def _mamba_layers(text, layers: int) -> int:
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    return sum(1 for t in types if t in ("linear_attention", "mamba")) if len(types) == layers else 0


def _mamba_mixer(text, h: int) -> int:
    """A Mamba mixer's parameters (in/out projections, conv, x/dt projections, A, D)."""
    d_state = _first(text, "mamba_d_state", "state_size", "ssm_state_size") or 16
    d_conv = _first(text, "mamba_d_conv", "conv_kernel") or 4
    d_inner = (_first(text, "mamba_expand", "expand") or 2) * h
    dt_rank = _first(text, "mamba_dt_rank", "time_step_rank")
    dt_rank = dt_rank if isinstance(dt_rank, int) else -(-h // 16)
    return (h * 2 * d_inner + d_inner * d_conv + d_inner * (dt_rank + 2 * d_state) + dt_rank * d_inner
            + d_inner * d_state + d_inner + d_inner * h)


def estimate(text, wrapper, weights_dtype: str) -> Weights:
    """The config estimate, or "unknown" with what is missing."""
    try:
        params, how = estimate_parameters(text, wrapper)
    except _Unknown as exc:
        return Weights(None, f"unknown: the config has no {exc} (give a folder with safetensors or a GGUF file)")
    except (TypeError, ValueError) as exc:
        return Weights(None, f"unknown: the config's sizes could not be counted ({exc})")
    per = WEIGHT_DTYPE_BYTES[weights_dtype]
    vision = " (text model only: the vision tower is not counted)" if wrapper is not None and wrapper is not text else ""
    return Weights(params * per, f"estimate: {params / 1e9:.2f} B parameters from the config ({how}) x {per} B{vision}",
                   parameters=params)
