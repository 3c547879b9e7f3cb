"""What every reader of a model's files shares: the one error they raise, the layer kinds kvbench knows, the field
names for the same thing, and the checks of a count or a per-layer list (:mod:`kvbench.kv.model_config` is the
public entry)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config kvbench cannot read, or a model whose KV question has no answer: one line, naming the file."""


# layer_types strings (transformers' ALLOWED_LAYER_TYPES and the legacy names it remaps) -> kvbench's kinds
LAYER_TYPES = {
    "full_attention": "full", "attention": "full", "hybrid": "full", "indexed_attention": "full",
    "sliding_attention": "sliding", "hybrid_sliding": "sliding", "reference_sliding_attention": "sliding",
    "window_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "none", "mamba": "none", "conv": "none", "recurrent": "none", "mlp": "none", "moe": "none",
}
WHY_NONE = {"linear_attention": "linear attention / state space: a state of constant size",
            "mamba": "linear attention / state space: a state of constant size",
            "conv": "convolution: a state of constant size", "recurrent": "recurrent: a state of constant size",
            "mlp": "no attention", "moe": "no attention"}
MLP_LAYER_TYPES = {"dense", "sparse"}  # some configs describe their MLPs in layer_types: not attention
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16", "float": "fp32"}

# Field names for the same thing, for model types transformers does not know (its classes map their own).
ALIASES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim", "model_dim"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                                "n_ctx", "model_max_length", "max_context_length"),
}
# (OpenELM: num_transformer_layers, num_query_heads, model_dim, max_context_length; apple/OpenELM's
# configuration_openelm.py)
KV_HEAD_FIELDS = ("num_key_value_heads_per_layer", "num_key_value_heads", "num_kv_heads", "n_head_kv",
                  "multi_query_group_num", "num_attention_groups")  # (DeciLM-7B: num_key_value_heads_per_layer)


def positive_int(value, field: str, source: str, allow_list: bool = False) -> int | list[int]:
    if allow_list and isinstance(value, (list, tuple)):
        return [positive_int(v, field, source) for v in value]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source}: {field} must be a non-negative integer, not {value!r}")
    return value


def per_layer(value, n: int, field: str, source: str) -> list[int]:
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise ConfigError(f"{source}: {field} lists {len(values)} values for {n} layers")
    return values
