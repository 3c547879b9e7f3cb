"""The checks of a config's values before any class or count reads them (:func:`check_values`), the required fields
a file leaves out (:func:`missing_required`), and the per-layer-looking keys the reader did not read
(:func:`unread_keys`, :func:`refuse_unread`)."""
from __future__ import annotations

import re

from kvbench.kv.config_core import ALIASES, KV_HEAD_FIELDS, ConfigError
from kvbench.kv.config_hf import builtin


# --- what the values mean: checked before any class or count reads them -------------------------------

MAX_LAYERS = 4_096  # 30 times any published model's (Llama 3.1 405B: 126): past it a config is not a model
MAX_WIDTH = 2**40  # a width, a count of heads or tokens past it overflows every memory there is
# Widths and counts kvbench reads, each a whole number (>= 1 where a zero makes no model)
STRUCTURAL = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers", "num_attention_heads",
              "n_head", "n_heads", "num_query_heads", "hidden_size", "n_embd", "d_model", "model_dim", "vocab_size",
              "padded_vocab_size", "num_key_value_heads", "num_kv_heads", "n_head_kv", "num_key_value_heads_per_layer")
COUNTS = (*STRUCTURAL, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
          "max_context_length",
          "head_dim", "kv_channels", "intermediate_size", "moe_intermediate_size", "ffn_dim", "n_inner",
          "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "sliding_window",
          "attention_chunk_size", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
          "n_shared_experts", "shared_expert_intermediate_size", "num_kv_shared_layers", "multi_query_group_num")
# the fields kvbench reads layer by layer where a config lists one value per layer (sliding_window: a window, or
# null / 0 for a layer of full attention)
PER_LAYER = ("num_attention_heads", "num_query_heads", "num_key_value_heads", "num_kv_heads",
             "num_key_value_heads_per_layer", "intermediate_size", "head_dim", "sliding_window")
REQUIRED = {"num_hidden_layers": "layers", "num_attention_heads": "attention heads", "hidden_size": "hidden size",
            "vocab_size": "vocabulary"}
VOCAB_ALIASES = ("vocab_size", "padded_vocab_size", "n_vocab")


def check_values(body: dict, source: str) -> None:
    """The fields the KV model and the weights count read, each a whole number in range (or, for
    :data:`PER_LAYER`, one per layer), ``quantization_config`` an object and the dtype a name kvbench
    knows: else one ConfigError naming the key. Runs before transformers' class so that no default, no
    coercion and no per-layer list reaches a count that assumes one number."""
    layers = next((body[k] for k in ALIASES["num_hidden_layers"] if body.get(k) is not None), None)
    for key in COUNTS:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, list) and key in PER_LAYER:
            if not isinstance(layers, int) or isinstance(layers, bool):
                continue  # the layer count's own check says what is wrong
            if len(value) != layers:
                raise ConfigError(f"{source}: {key} lists {len(value)} values for {layers} layers")
            for i, v in enumerate(value):
                if not (key == "sliding_window" and v is None):
                    _check_count(v, f"{key}[{i}]", source, minimum=0 if key in ("intermediate_size", "sliding_window")
                                 else 1)
            continue
        if isinstance(value, list):
            raise ConfigError(f"{source}: {key} is a list: kvbench reads one value for every layer "
                              f"(per layer it reads {', '.join(PER_LAYER)})")
        _check_count(value, key, source, minimum=1 if key in STRUCTURAL else 0)
        if key in ALIASES["num_hidden_layers"] and value > MAX_LAYERS:
            raise ConfigError(f"{source}: {key} {value:,}: more layers than any model (kvbench plans at most "
                              f"{MAX_LAYERS:,})")
    types = body.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ConfigError(f"{source}: layer_types must be a list of layer kinds (strings), not {types!r}"[:300])
    for key in ("rope_scaling", "rope_parameters"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise ConfigError(f"{source}: {key} is a {type(body[key]).__name__}, not an object (rope_type, factor)")
        if isinstance(body.get(key), dict):
            _check_rope(body[key], key, source)
    quant = body.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError(f"{source}: quantization_config is a {type(quant).__name__}, not an object "
                          "(quant_method and its settings)")
    for key in ("torch_dtype", "dtype"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or value.replace("torch.", "") not in CONFIG_DTYPES):
            raise ConfigError(f"{source}: {key} {value!r} is not a dtype kvbench knows; known: "
                              f"{', '.join(CONFIG_DTYPES)}")


# torch dtype names a config gives its weights (transformers writes torch.dtype's name)
CONFIG_DTYPES = ("bfloat16", "float16", "half", "float32", "float", "float64", "float8_e4m3fn", "float8_e5m2",
                 "int8", "uint8")


MAX_ROPE_FACTOR = 1_000  # RoPE scalings published stretch a context 4-64 times: 1e300 (or 1e400, inf) is no model


def _check_rope(params: dict, key: str, source: str) -> None:
    """A RoPE scaling's ``factor`` a finite number in (0, 1,000] and its ``original_max_position_embeddings`` a
    count, in it and in each per-layer-type entry: a factor of 1e300 planned a context of 4 x 10^303 tokens,
    one of 1e400 (JSON's infinity) an OverflowError traceback."""
    for name, entry in [(key, params), *((f"{key}.{k}", v) for k, v in params.items() if isinstance(v, dict))]:
        factor = entry.get("factor")
        if factor is not None:
            if isinstance(factor, bool) or not isinstance(factor, (int, float)):
                raise ConfigError(f"{source}: {name}.factor must be a number, not {factor!r}"[:300])
            if not (0 < factor <= MAX_ROPE_FACTOR):  # NaN fails this too
                raise ConfigError(f"{source}: {name}.factor {factor:g} is not a RoPE scaling of any model "
                                  f"(above 0, at most {MAX_ROPE_FACTOR:,})")
        if entry.get("original_max_position_embeddings") is not None:
            _check_count(entry["original_max_position_embeddings"], f"{name}.original_max_position_embeddings",
                         source, minimum=1)


def _check_count(value, key: str, source: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: {key} must be a whole number, not {value!r}"[:300])
    if value < minimum:
        raise ConfigError(f"{source}: {key} must be >= {minimum}, not {value}")
    if value > MAX_WIDTH:
        raise ConfigError(f"{source}: {key} {value:,} is past any model's size (at most {MAX_WIDTH:,})")


def missing_required(text, raw_text: dict, nested: bool) -> list[str]:
    """The required fields (layers, attention heads, hidden size, vocabulary) the file does not give for a
    transformers class, under any of their names: a class default there is another model's value."""
    mapped = getattr(type(text), "attribute_map", {}) or {}
    missing = []
    for name in REQUIRED:
        names = {*ALIASES.get(name, (name,)), *(VOCAB_ALIASES if name == "vocab_size" else ()),
                 *(k for k, v in mapped.items() if v == name)}
        if not any(raw_text.get(n) is not None for n in names):
            missing.append(name)
    return missing


# --- what the reader did not read ---------------------------------------------------------------------

# The keys the KV reader reads (for a config transformers has no class for), and words of keys that do
# not concern the KV (MLP, experts, norms)
READ_KEYS = {*[k for names in ALIASES.values() for k in names], *KV_HEAD_FIELDS, "head_dim", "kv_channels",
             "hidden_size_per_head", "v_head_dim", "layer_types", "sliding_window", "use_sliding_window",
             "attention_chunk_size", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "q_lora_rank",
             "num_kv_shared_layers", "cross_attention_layers", "attn_config", "new_decoder_architecture",
             "multi_query", "text_config", "torch_dtype", "dtype", "rope_scaling", "rope_parameters", "rope_theta",
             "model_type", "architectures", "auto_map", "quantization_config", "original_max_position_embeddings",
             "is_encoder_decoder", "is_decoder", "attn_type_list", "layers_block_type", "attn_layer_period",
             "attn_layer_offset", "block_configs", "num_nextn_predict_layers", "dense_attention_every_n_layers"}
NOT_KV_WORDS = ("mlp", "moe", "expert", "ffn", "intermediate", "dropout", "norm", "router", "vocab", "token_id",
                "init", "vision", "audio", "image")
LAYER_KEY = re.compile(r"(layer|block|attn|attention|window|swa|global|local|kv|head)", re.IGNORECASE)
PATTERN_KEY = re.compile(r"(pattern|period|offset|interval|every|freq|ratio|idx|indices|ids|list|types?|layers|map)$",
                         re.IGNORECASE)
KIND_WORDS = ("attention", "attn", "sliding", "full", "global", "local", "linear", "mamba", "window", "swa")
# words of a key that holds one whole number, a period of layers (every n-th layer is of a kind), not a list
PERIOD_WORDS = ("every_n", "period", "interval")


class PeriodKey(str):
    """An unread key that holds one whole number and is named like a period of layers (``global_every_n_layers``):
    refused as a period kvbench does not know (:func:`refuse_unread`), not as a per-layer list."""


def unread_keys(raw: dict, text) -> list[str]:
    """Keys of a config transformers has no class for (or a remote-code class) that the KV reader did not
    read and that look per-layer: a list as long as the layers, a list of layer kinds, or a layer pattern
    under a model-specific name (``attn_type_list``, ``sliding_window_pattern``, ``global_attn_layers``); or a
    period of layers it does not know (one whole number named every_n / period / interval: a :class:`PeriodKey`).
    Which layers cache what is then unknown: a plan refuses it (:func:`refuse_unread`). [] for transformers' own
    classes, and for a remote-code class that derives layer_types from them (the reader reads that)."""
    if builtin(text):
        return []
    body = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    n = next((body[k] for k in ALIASES["num_hidden_layers"] if isinstance(body.get(k), int)), None)
    derived = getattr(text, "layer_types", None)
    if "layer_types" not in body and isinstance(derived, (list, tuple)) and n is not None and len(derived) == n:
        return []
    out = []
    for key, value in body.items():
        low = key.lower()
        if key in READ_KEYS or key.startswith("_") or isinstance(value, bool) or any(w in low for w in NOT_KV_WORDS):
            continue
        listed = isinstance(value, (list, tuple))
        per_layer = listed and n is not None and len(value) == n
        kinds = listed and any(isinstance(v, str) and any(w in v.lower() for w in KIND_WORDS) for v in value)
        period = isinstance(value, int) and LAYER_KEY.search(key) and any(w in low for w in PERIOD_WORDS)
        pattern = LAYER_KEY.search(key) and PATTERN_KEY.search(key) and isinstance(value, (int, list, tuple, str, dict))
        if period:
            out.append(PeriodKey(key))
        elif per_layer or kinds or pattern:
            out.append(key)
    return sorted(out)


def refuse_unread(keys, source: str) -> None:
    """One ConfigError naming the per-layer-looking keys the reader did not read, and the periods of layers it
    does not know (:class:`PeriodKey`): the layout they describe is not known, and a plan of every layer as full
    attention would be several times off, as confident as any."""
    if not keys:
        return
    listed = [k for k in keys if not isinstance(k, PeriodKey)]
    periods = [k for k in keys if isinstance(k, PeriodKey)]
    why = []
    if listed:
        why.append(f"{', '.join(listed)} look{'s' * (len(listed) == 1)} per-layer and kvbench does not read it")
    if periods:
        why.append(f"{', '.join(periods)} {'is a period' if len(periods) == 1 else 'are periods'} of layers "
                   "(every n-th layer) that kvbench does not know")
    raise ConfigError(f"{source}: {'; '.join(why)}: which layers cache what is unknown, so no KV is planned "
                      "(kvbench reads layer_types, attn_type_list, layers_block_type, attn_layer_period/offset, "
                      "dense_attention_every_n_layers, block_configs, and per-layer head counts, head_dim and "
                      "sliding_window; --trust-remote-code reads a class that derives layer_types)")
