"""A config of a model type transformers knows, read without importing transformers (:class:`PlainConfig`), where
reading it as written is what transformers' class reads."""
from __future__ import annotations

from types import SimpleNamespace

from kvbench.kv.config_core import LAYER_TYPES


class PlainConfig(SimpleNamespace):
    """A config of a model type transformers knows, read without importing transformers (1.5 s of a 2 s plan):
    only where the file states every field whose class default or post-init would differ from reading it as
    written (:func:`plain_config`), so that both readings agree (tests/kv/test_plain_configs.py checks every
    such config of the corpus and the catalog against transformers' class)."""


# model_type -> the fields the file must state for it to be read plainly (beyond PLAIN_FIELDS), and the
# values those fields must have (a Qwen2 with use_sliding_window windows from max_window_layers on: the class's)
_MLA = {"kv_lora_rank": None, "q_lora_rank": None, "qk_rope_head_dim": None, "qk_nope_head_dim": None,
        "v_head_dim": None, "moe_intermediate_size": None, "n_routed_experts": None, "n_shared_experts": None,
        "num_experts_per_tok": None, "first_k_dense_replace": None, "moe_layer_freq": None}
PLAIN_TYPES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {"use_sliding_window": False},
               "qwen3": {"head_dim": None, "use_sliding_window": False},
               "qwen3_moe": {"head_dim": None, "use_sliding_window": False, "num_experts": None,
                             "num_experts_per_tok": None, "moe_intermediate_size": None, "decoder_sparse_step": None,
                             "mlp_only_layers": None},
               "mixtral": {"sliding_window": None, "num_local_experts": None, "num_experts_per_tok": None},
               "gemma2": {"head_dim": None, "sliding_window": None},
               "gemma3_text": {"head_dim": None, "sliding_window": None},
               "gpt_oss": {"head_dim": None, "sliding_window": None, "num_local_experts": None,
                           "num_experts_per_tok": None, "rope_scaling": None},
               "deepseek_v2": _MLA, "deepseek_v3": {**_MLA, "num_nextn_predict_layers": None}}


def _alternate(raw: dict) -> list[str]:
    """Gemma 2's and gpt-oss's layer_types without the key (their __post_init__): sliding on even layers."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(raw["num_hidden_layers"])]


def _gemma3_pattern(raw: dict) -> list[str] | None:
    """Gemma 3's layer_types without the key (Gemma3TextConfig.__post_init__): full attention every
    sliding_window_pattern-th layer. None where the file states no pattern (the class's default 6 would)."""
    pattern = raw.get("sliding_window_pattern")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        return None
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(raw["num_hidden_layers"])]


# model_type -> its class's __post_init__ for layer_types where the file has none (None: it cannot be read plainly)
PLAIN_LAYER_TYPES = {"gemma2": _alternate, "gpt_oss": _alternate, "gemma3_text": _gemma3_pattern}
# the multimodal wrappers whose text_config is read plainly (the vision tower is not counted), and its model_type
PLAIN_WRAPPERS = {"gemma3": "gemma3_text"}
PLAIN_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
# keys a class reads and derives from (RoPE per layer kind, nesting): the class reads those configs
NOT_PLAIN_KEYS = ("text_config", "attribute_map", "sub_configs", "use_bidirectional_attention")
# RoPE scalings read plainly: as transformers' standardize_rope_params reads a single (not nested) dict
PLAIN_ROPE = ("default", "llama3", "yarn", "linear", "dynamic")


def plain_config(raw: dict) -> PlainConfig | None:
    """``raw`` as a :class:`PlainConfig` where reading it as written is what transformers' class reads, else None:
    every field its class would fill is in the file, and what its __post_init__ derives (layer_types, a RoPE
    scaling's original length) is derived here as it does. auto_map is ignored, as for every model type
    transformers knows (:func:`hf_config` reads it through its own class)."""
    model_type = raw.get("model_type")
    if model_type in PLAIN_WRAPPERS:
        inner = raw.get("text_config")
        if not isinstance(inner, dict) or inner.get("model_type", PLAIN_WRAPPERS[model_type]) != PLAIN_WRAPPERS[model_type]:
            return None
        text = plain_config({**inner, "model_type": PLAIN_WRAPPERS[model_type]})
        if text is None or any(k in raw for k in NOT_PLAIN_KEYS if k != "text_config"):
            return None
        return PlainConfig(**{**raw, "text_config": text})
    fields = PLAIN_TYPES.get(model_type)
    if fields is None or any(k in raw for k in NOT_PLAIN_KEYS) or any(k not in raw for k in (*PLAIN_FIELDS, *fields)):
        return None
    if any(value is not None and raw[key] != value for key, value in fields.items()):
        return None
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return None
    types = raw.get("layer_types")
    if types is not None:
        if model_type not in PLAIN_LAYER_TYPES or not isinstance(types, list) or len(types) != layers \
                or not all(t in LAYER_TYPES for t in types):
            return None
    elif model_type in PLAIN_LAYER_TYPES:
        types = PLAIN_LAYER_TYPES[model_type](raw)
        if types is None:
            return None
    if raw.get("rope_parameters") is not None and raw.get("rope_scaling") is not None:
        return None  # both: transformers' own precedence decides
    rope = raw.get("rope_parameters") if raw.get("rope_parameters") is not None else raw.get("rope_scaling")
    if rope is not None:
        if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type") or "default") not in PLAIN_ROPE:
            return None  # a scaling transformers' rope utilities read otherwise (longrope, per layer kind)
        if any(isinstance(v, dict) for v in rope.values()):
            return None  # nested per layer kind (transformers 5's rope_parameters per layer type)
    config = PlainConfig(**raw)
    if types is not None:
        config.layer_types = list(types)
    return config


def plain_rope_parameters(config: PlainConfig) -> list[dict]:
    """A plain config's RoPE scaling as transformers' standardize_rope_params leaves a single dict: rope_type
    from ``type``, and for llama3 / yarn / longrope the pretraining length, original_max_position_embeddings
    (the config's top-level field first, else the dict's own, else max_position_embeddings)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict) or not rope:
        return []
    params = dict(rope)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        top = getattr(config, "original_max_position_embeddings", None)
        if top is not None:
            params["original_max_position_embeddings"] = top
        else:
            params.setdefault("original_max_position_embeddings", getattr(config, "max_position_embeddings", None))
    return [params]
