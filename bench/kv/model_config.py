"""A model's KV geometry from its files: an HF ``config.json`` read through transformers' own config classes,
or GGUF metadata (a GGUF file's keys, or Ollama's ``/api/show`` ``model_info``).

transformers is the source of truth for an HF config: its class for the ``model_type`` fills the fields a
file leaves to class defaults (Gemma 3's ``head_dim`` 256, ``num_key_value_heads``), maps other names for the
same thing (GPT-2's ``n_layer``/``n_head``/``n_embd``), resolves a multimodal wrapper's ``text_config`` the way
the model class does, derives per-layer attention types (``layer_types``: sliding, chunked, linear), and
validates types. A ``model_type`` transformers does not know is read as written, with the usual aliases, and
the geometry says so. Quirks no class attribute states are handled here, each with its source:

- Falcon: ``multi_query`` without ``new_decoder_architecture`` is one KV head (``num_kv_heads`` reads 71);
- MLA (``kv_lora_rank``): the layers hold the latent; the decompressed shape is kept beside it (engines
  differ in which they cache);
- Gemma 3n's last ``num_kv_shared_layers`` reuse earlier layers' KV; Mllama's ``cross_attention_layers`` cache
  the image, not the text; linear-attention / state-space layers cache a state of constant size.

The model's limit is max_position_embeddings scaled by the RoPE scaling the config declares, read through
transformers' own rope utilities (:func:`rope_limit`: Qwen2.5's YaRN factor 4 on 32,768 is 131,072). A
checkpoint's quantization_config becomes geometry flags the engines' ``auto`` dtypes read
(:func:`quantisation_flags`). A remote-code model is read through its own configuration module with
``trust_remote_code`` (transformers' AutoConfig), and the per-layer-looking keys the reader did not read are
listed (:func:`unread_keys`): its geometry is then not verified.

Long because one reader covers every layout the KV depends on (transformers' classes, remote code, GGUF keys,
RoPE limits, the keys left unread), and they must agree on one list of field names (READ_KEYS, ALIASES).
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from kvbench.kv import bounded
from kvbench.kv.geometry import KVGeometry, LayerKV, MLAShape


READ_PLAIN = True  # read plain configs without transformers (PlainConfig); False: every config through its class


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


# --- what a config class fills where the file is silent ------------------------------------------------

# Beyond REQUIRED, the fields an answer reads. transformers writes every field of its class at a config's top level
# (only a nested text_config leaves out what equals its class's defaults), so a top-level file without one was
# written otherwise, and the class fills it: with its default (another model's value) or with what its post-init
# derives. Each is named, and what it touches is marked NOT VERIFIED (the KV), left unknown (the weights) or left
# to the user (the limit), never taken as this model's.
KV_FILLED = ("num_key_value_heads", "head_dim", "sliding_window", "sliding_window_pattern", "attention_chunk_size",
             "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_kv_shared_layers")
WEIGHT_FILLED = ("intermediate_size", "moe_intermediate_size", "num_local_experts", "num_experts", "n_routed_experts",
                 "n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
                 "q_lora_rank", "decoder_sparse_step", "expert_layer_period", "expert_layer_offset")
LIMIT_FILLED = "max_position_embeddings"


def _class_defaults(cls) -> dict[str, object]:
    """{field: default} a config class declares: its dataclass fields (transformers 5) and its __init__'s
    keyword defaults (a remote-code class of the older kind writes its own __init__ over the dataclass's). A
    field without a plain default maps to None."""
    import dataclasses
    import inspect

    out = {}
    if dataclasses.is_dataclass(cls):
        out = {f.name: (None if f.default is dataclasses.MISSING else f.default) for f in dataclasses.fields(cls)}
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return out
    out.update({p.name: (None if p.default is inspect.Parameter.empty else p.default) for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)})
    return out


def class_filled(text, raw: dict, names) -> dict[str, tuple[object, bool]]:
    """{name: (value, constant)} for each of ``names`` that ``text``'s class declares and ``raw`` does not give
    (under the name, the field its class maps it to, or another name for that field): the value came from the
    class, ``constant`` True where it is the class's default, False where its post-init derived it."""
    cls = type(text)
    defaults = _class_defaults(cls)
    mapped = getattr(cls, "attribute_map", {}) or {}
    out = {}
    for name in names:
        attr = mapped.get(name, name)
        if attr not in defaults:
            continue
        given = {name, attr, *(k for k, v in mapped.items() if v == attr), *ALIASES.get(name, ())}
        if any(k in raw for k in given):
            continue  # stated (null included: the file says there is none)
        value = getattr(text, attr, None)
        if value is None:
            continue
        out[name] = (value, defaults[attr] is not None)
    return out


def _mark_class_filled(text, raw: dict, geometry: KVGeometry) -> KVGeometry:
    """``geometry`` with what a top-level config's class filled named (see KV_FILLED): the KV fields it rests
    on marked assumed, the weights' fields set aside for the count (``kvbench_unset``: unknown, named), a
    limit from the class's default dropped (the user's --context or --max-model-len sets it)."""
    cls = type(text).__name__
    filled = class_filled(text, raw, (*KV_FILLED, *WEIGHT_FILLED, LIMIT_FILLED))
    if not filled:
        return geometry
    g = geometry
    relevant = {"num_key_value_heads": g.mla is None and g.model_type not in ("falcon", "RefinedWeb", "RefinedWebModel"),
                "head_dim": g.mla is None, "sliding_window": g.count("sliding") > 0,
                "sliding_window_pattern": g.count("sliding") > 0 and "layer_types" not in raw,
                "attention_chunk_size": g.count("chunked") > 0, "kv_lora_rank": g.mla is not None,
                "qk_rope_head_dim": g.mla is not None, "qk_nope_head_dim": g.mla is not None,
                "v_head_dim": g.mla is not None, "num_kv_shared_layers": bool(filled.get("num_kv_shared_layers", (0,))[0])}
    notes, assumed = [], []
    for name in KV_FILLED:
        if name not in filled or not relevant.get(name):
            continue
        value, constant = filled[name]
        if name == "head_dim" and not constant:
            continue  # hidden_size / num_attention_heads: the architecture's own definition (noted as such)
        if constant:
            how = "its default, another model's value"
        elif name == "num_key_value_heads":
            how = "num_attention_heads: one KV head per attention head (MHA)"
        else:
            how = "derived from the other fields"
        notes.append(f"{name} is not in the file: {cls} gives {value!r}, {how}; the KV rests on it (NOT VERIFIED)")
        assumed.append(name)
    weights = [name for name in WEIGHT_FILLED if name in filled]
    if weights:
        text.kvbench_unset = (*getattr(text, "kvbench_unset", ()), *weights)
    kept = [n for n in g.notes if not (any(n.startswith(f"{a} ") for a in assumed) and "class default" in n)]
    limit = g.max_context
    if LIMIT_FILLED in filled and filled[LIMIT_FILLED][1]:
        limit = None
        kept = [n for n in kept if not n.startswith("the model's limit")]
        notes.append(f"max_position_embeddings is not in the file ({filled[LIMIT_FILLED][0]:,} is the {cls} class's "
                     "default, another model's): the model's limit is unknown; --max-model-len or --context sets it")
    return replace(g, max_context=limit, notes=(*kept, *notes), assumed=(*g.assumed, *assumed))


def transformers_version() -> str:
    return _transformers().__version__


def _transformers():
    # without torch, transformers prints an advisory at import; kvbench reads configs only
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    # its deprecation notes on old config fields are not the user's concern, and an error it logs is raised too
    # and said by kvbench in one line (a Falcon config with head_dim 0 printed the whole config to stderr first)
    transformers.logging.set_verbosity(transformers.logging.CRITICAL)
    return transformers


# --- HF configs ---------------------------------------------------------------------------------------

def config_file(path: str | Path) -> Path:
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def read_json(path: Path) -> dict:
    try:  # a regular file of at most 16 MiB and 64 levels (a FIFO, /dev/zero or a bomb: one line)
        raw = bounded.read_json(path, what="config")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except bounded.InputError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config.json holds one JSON object, not a {type(raw).__name__}")
    return raw


class RawConfig(SimpleNamespace):
    """A config of a model type transformers does not know, read as written (no class defaults, no post-init)."""


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


def remote_config_file(raw: dict, folder: str | Path | None) -> tuple[str | None, Path | None]:
    """(the module auto_map's AutoConfig names, its file in ``folder`` if there) for a remote-code config."""
    auto = (raw.get("auto_map") or {}).get("AutoConfig") if isinstance(raw.get("auto_map"), dict) else None
    if not isinstance(auto, str) or "." not in auto:
        return None, None
    module = auto.split("--")[-1].rsplit(".", 1)[0]
    file = Path(folder) / f"{module}.py" if folder is not None else None
    return f"{module}.py", (file if file is not None and file.is_file() else None)


def hf_config(raw: dict, source: str, folder: str | Path | None = None, trust_remote_code: bool = False):
    """The transformers config object for ``raw`` (its class for the model_type; with ``trust_remote_code``
    and a ``folder`` that ships the configuration module auto_map names, that module's class through
    transformers' AutoConfig; else a :class:`RawConfig`) and notes on how it was read."""
    if READ_PLAIN and not trust_remote_code and (plain := plain_config(raw)) is not None:
        return plain, []
    transformers = _transformers()
    from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError

    mapping = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    model_type = raw.get("model_type")
    notes = []
    try:
        if isinstance(model_type, str) and model_type in mapping:
            config = mapping[model_type].from_dict(raw)
        else:
            module, file = remote_config_file(raw, folder)
            unknown = f"model_type {model_type!r} is not one transformers {transformers.__version__} knows"
            if file is not None and trust_remote_code:
                try:
                    config = transformers.AutoConfig.from_pretrained(str(file.parent), trust_remote_code=True)
                except Exception as exc:  # noqa: BLE001 - the model's own code: any failure is its, in one line
                    raise ConfigError(f"{source}: its {file.name} (auto_map AutoConfig) failed under "
                                      f"--trust-remote-code: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
                notes.append(f"{unknown}: read through its own {file.name} (auto_map AutoConfig, --trust-remote-code)")
            else:
                if file is not None:
                    why = f"the folder ships {file.name}: --trust-remote-code reads it through transformers' AutoConfig"
                elif module:
                    where = f"{folder}" if folder is not None else "the config's folder"
                    why = f"its auto_map names {module}, which {where} lacks (download it beside config.json)"
                else:
                    why = "the config names no configuration module (auto_map AutoConfig)"
                notes.append(f"{unknown}: fields read as written (no class defaults); {why}")
                config = RawConfig(**raw)
    except (StrictDataclassFieldValidationError, StrictDataclassClassValidationError, TypeError, ValueError,
            AttributeError) as exc:  # AttributeError: a key the class derives (Falcon's head_dim property)
        first = str(exc).strip().splitlines()
        raise ConfigError(f"{source}: {' '.join(line.strip() for line in first[:2])}") from None
    return config, notes


def text_config(config, source: str):
    """The language model's config, resolved as the model class does (``get_text_config(decoder=True)``)."""
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"{source}: {getattr(config, 'model_type', 'this model')} is an encoder-decoder model; "
                          "kvbench plans decoder-only generation (its cross-attention cache depends on the input, "
                          "not the context)")
    if isinstance(config, PlainConfig):  # a decoder, or a wrapper whose text_config was read plainly
        return config.text_config if isinstance(getattr(config, "text_config", None), PlainConfig) else config
    if isinstance(config, RawConfig):
        sub = getattr(config, "text_config", None)
        if isinstance(sub, dict):  # a wrapper transformers does not know: its text_config, as transformers would
            inner, _ = hf_config(sub, f"{source} (text_config)")
            return text_config(inner, source)
        return config
    try:
        text = config.get_text_config(decoder=True)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked_lm
    if text.model_type in masked_lm and not getattr(text, "is_decoder", False):
        raise ConfigError(f"{source}: {text.model_type} is an encoder (a masked language model): it caches no KV "
                          "for generation (unless its config sets is_decoder)")
    return text


def geometry_from_hf(path: str | Path) -> KVGeometry:
    """The KV geometry of a config.json (or a model folder holding one)."""
    file = config_file(path)
    return geometry_from_hf_dict(read_json(file), str(file))


def geometry_from_hf_dict(raw: dict, source: str = "config.json") -> KVGeometry:
    return parse_hf_dict(raw, source)[2]


def parse_hf_dict(raw: dict, source: str = "config.json", folder: str | Path | None = None,
                  trust_remote_code: bool = False) -> tuple[object, object, KVGeometry]:
    """(the config object, its language model's config, the KV geometry) of a config.json's contents
    (``folder``, ``trust_remote_code``: see :func:`hf_config`)."""
    nested = isinstance(raw.get("text_config"), dict)
    raw_text = raw["text_config"] if nested else raw
    check_values(raw, source)
    if nested:
        check_values(raw_text, f"{source} (text_config)")
    config, notes = hf_config(raw, source, folder, trust_remote_code)
    text = text_config(config, source)
    if builtin(text):
        missing = missing_required(text, raw_text, nested)
        if "head_dim" in raw_text and "hidden_size" in missing and not nested:
            missing.remove("hidden_size")  # the KV reads head_dim; the weights still lack the hidden size
            text.kvbench_unset = ("hidden_size",)
        if "vocab_size" in missing and not nested:  # the KV does not read it; the weights count must not guess it
            text.kvbench_unset = (*getattr(text, "kvbench_unset", ()), "vocab_size")
        for name in missing if nested else ():  # a text_config leaves out what equals its class's defaults
            notes.append(f"{name} {getattr(text, name, None)!r} from the {type(text).__name__} class default: its "
                         "text_config leaves it out, as transformers writes a nested config")
        geometry = _geometry(text, raw_text, config, source, notes)  # its own refusals first (no attention layer)
        kv_missing = [name for name in missing if name != "vocab_size"]
        if kv_missing and not nested:
            defaults = ", ".join(f"{name} {getattr(text, name, None)!r}" for name in kv_missing)
            raise ConfigError(f"{source}: {', '.join(kv_missing)} missing: the KV geometry needs this model's "
                              f"(the {type(text).__name__} class's defaults, {defaults}, are another model's)")
        if not nested and not isinstance(text, PlainConfig):
            geometry = _mark_class_filled(text, raw_text, geometry)
        return config, text, geometry
    geometry = _geometry(text, raw_text, config, source, notes)
    if not isinstance(text, RawConfig) and not nested:  # a remote-code class (--trust-remote-code) fills fields too
        geometry = _mark_class_filled(text, raw_text, geometry)
    return config, text, geometry


def _get(config, name: str, known: bool):
    """A field by its name, or (for a model type transformers does not know) by one of its aliases."""
    for key in (ALIASES.get(name, (name,)) if not known else (name,)):
        value = getattr(config, key, None)
        if value is not None:
            return value
    return None


def _positive_int(value, field: str, source: str, allow_list: bool = False) -> int | list[int]:
    if allow_list and isinstance(value, (list, tuple)):
        return [_positive_int(v, field, source) for v in value]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source}: {field} must be a non-negative integer, not {value!r}")
    return value


def _per_layer(value, n: int, field: str, source: str) -> list[int]:
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise ConfigError(f"{source}: {field} lists {len(values)} values for {n} layers")
    return values


def _geometry(text, raw: dict, config, source: str, notes: list[str]) -> KVGeometry:
    known = builtin(text)  # a remote-code class (--trust-remote-code) keeps its own field names: aliases apply
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", "") or "")

    def field(name, required=True, allow_list=False):
        value = _get(text, name, known)
        if value is None:
            if required:
                names = " or ".join(ALIASES.get(name, (name,)))
                raise ConfigError(f"{source}: {names} is missing: the KV geometry needs it")
            return None
        return _positive_int(value, name, source, allow_list)

    n_layers = field("num_hidden_layers")
    if n_layers == 0:
        raise ConfigError(f"{source}: num_hidden_layers is 0")
    kinds, why = _layer_kinds(text, raw, n_layers, model_type, source)
    if all(kind == "none" for kind, _ in kinds):
        raise ConfigError(f"{source}: {model_type or 'this model'} has no attention layer that caches KV "
                          f"({'; '.join(sorted(set(why)))}): there is no KV cache to plan")
    heads = field("num_attention_heads", allow_list=True)
    heads_per_layer = _per_layer(heads, n_layers, "num_attention_heads", source)
    flags = quantisation_flags(getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None))
    if not all(h for h, (kind, _) in zip(heads_per_layer, kinds) if kind != "none"):
        raise ConfigError(f"{source}: num_attention_heads is 0 on an attention layer")

    # --- MLA: the latent is what the layers hold; the decompressed shape goes beside it ---------------
    rank = getattr(text, "kv_lora_rank", None)
    if rank:
        rope = getattr(text, "qk_rope_head_dim", None)
        if rope is None:
            raise ConfigError(f"{source}: kv_lora_rank without qk_rope_head_dim: the MLA latent's size is unknown")
        rank, rope = _positive_int(rank, "kv_lora_rank", source), _positive_int(rope, "qk_rope_head_dim", source)
        nope, v = getattr(text, "qk_nope_head_dim", None), getattr(text, "v_head_dim", None)
        mla = MLAShape(rank, rope, nope, v, max(heads_per_layer))
        layers = tuple(LayerKV(k, 1, rank + rope, 0, span) if k != "none" else LayerKV("none", why_none=w)
                       for (k, span), w in zip(kinds, why))
        return KVGeometry(layers, max(heads_per_layer), _max_context(text, known, source, notes, model_type), mla, model_type,
                          _dtype(text, config), "hf", tuple(flags), tuple(notes))

    # --- KV heads -----------------------------------------------------------------------------------
    if model_type in ("falcon", "RefinedWeb", "RefinedWebModel"):
        # transformers' FalconAttention: new_decoder_architecture uses num_kv_heads; else multi_query is one
        # KV head, whatever num_kv_heads says (its class default is num_attention_heads)
        if getattr(text, "new_decoder_architecture", False):
            flags.append("new_decoder_architecture")
            kv = _positive_int(getattr(text, "num_kv_heads", None) or heads, "num_kv_heads", source)
        elif getattr(text, "multi_query", False):
            kv, note = 1, "multi_query without new_decoder_architecture: one KV head"
            notes.append(note)
        else:
            kv = heads
    else:
        kv = None
        for name in KV_HEAD_FIELDS:
            value = getattr(text, name, None)
            if value is not None:
                kv = _positive_int(value, name, source, allow_list=True)
                break
        attn = getattr(text, "attn_config", None)  # MPT, DBRX
        if kv is None and attn is not None:
            value = attn.get("kv_n_heads") if isinstance(attn, dict) else getattr(attn, "kv_n_heads", None)
            kv = _positive_int(value, "attn_config.kv_n_heads", source) if value is not None else None
        blocks = _block_configs(text, n_layers, source)
        if blocks is not None:  # DeciLM / Nemotron-NAS: each block's KV heads = heads / n_heads_in_group
            kv = [heads_per_layer[i] // group if group else 1 for i, (_, group) in enumerate(blocks)]
        if kv is None:
            kv = heads
            notes.append("no KV-head field: one KV head per attention head (MHA)")
    kv_per_layer = _per_layer(kv, n_layers, "KV heads", source)

    # --- head dims ------------------------------------------------------------------------------------
    head_dim = getattr(text, "head_dim", None)
    head_dims = None
    if isinstance(head_dim, (list, tuple)):  # one per layer
        head_dims = _per_layer(_positive_int(head_dim, "head_dim", source, allow_list=True), n_layers, "head_dim",
                               source)
        head_dim = max(head_dims)
    elif head_dim is not None:
        head_dim = _positive_int(head_dim, "head_dim", source)
    if not head_dim:
        head_dim = getattr(text, "kv_channels", None) or getattr(text, "hidden_size_per_head", None)
    if not head_dim:
        hidden = field("hidden_size")
        if len(set(heads_per_layer)) != 1:
            raise ConfigError(f"{source}: head_dim is missing and hidden_size / num_attention_heads has no single value")
        head_dim = hidden // heads_per_layer[0]
        if not head_dim:
            raise ConfigError(f"{source}: hidden_size {hidden:,} / num_attention_heads {heads_per_layer[0]:,} is "
                              "below 1: no head width (give head_dim)")
    head_dim_v = getattr(text, "v_head_dim", None) or head_dim
    if known:
        for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv), ("head_dim", head_dim),
                            ("sliding_window", getattr(text, "sliding_window", None))):
            default = getattr(type(text), name, None)
            if value is not None and not _in_file(text, raw, name) and isinstance(default, int):
                notes.append(f"{name} {value} from the {type(text).__name__} class default (not in the file)")
    if "head_dim" not in raw and not known and not isinstance(text, RawConfig) and getattr(text, "head_dim", None):
        notes.append(f"head_dim {head_dim} from the {type(text).__name__} class (remote code; not in the file)")
    elif "head_dim" not in raw and not isinstance(getattr(type(text), "head_dim", None), int):
        notes.append(f"head_dim = hidden_size / num_attention_heads = {head_dim}")

    dims = head_dims or [head_dim] * n_layers
    v_fixed = getattr(text, "v_head_dim", None)
    layers = tuple(LayerKV(k, kvh, hd, v_fixed or hd, span) if k != "none" else LayerKV("none", why_none=w)
                   for (k, span), w, kvh, hd in zip(kinds, why, kv_per_layer, dims))
    return KVGeometry(layers, max(heads_per_layer), _max_context(text, known, source, notes, model_type), None, model_type,
                      _dtype(text, config), "hf", tuple(flags), tuple(notes))


def _in_file(config, raw: dict, name: str) -> bool:
    """Whether the file gives ``name``, itself or as the field its class reads for it (GPT-2's n_head)."""
    return name in raw or getattr(type(config), "attribute_map", {}).get(name) in raw


# What a block of block_configs (DeciLM / Nemotron-NAS, nvidia's modeling_decilm.py and vLLM's nemotron_nas.py)
# holds in place of attention: nothing, or a linear layer; neither caches KV
NO_ATTENTION_BLOCK = {"no_op": "no attention (block_configs: no_op)",
                      "replace_with_linear": "a linear layer in place of attention (block_configs: replace_with_linear)"}


def _block_configs(text, n: int, source: str) -> list[tuple[str, int | None]] | None:
    """Per layer of ``block_configs`` (DeciLM / Nemotron-NAS): ("" or why it caches nothing, n_heads_in_group);
    None without the key. A block that is neither is attention with num_attention_heads / n_heads_in_group KV
    heads (vLLM's nemotron_nas.py DeciLMDecoderLayer)."""
    blocks = getattr(text, "block_configs", None)
    if blocks is None:
        return None
    if not isinstance(blocks, (list, tuple)) or len(blocks) != n:
        raise ConfigError(f"{source}: block_configs must list one block per layer ({n}), not "
                          f"{len(blocks) if isinstance(blocks, (list, tuple)) else type(blocks).__name__}")
    out = []
    for i, block in enumerate(blocks):
        attn = block.get("attention") if isinstance(block, dict) else getattr(block, "attention", None)
        if attn is not None and not isinstance(attn, dict):
            attn = vars(attn) if hasattr(attn, "__dict__") else None
        if not isinstance(attn, dict):
            raise ConfigError(f"{source}: block_configs[{i}] has no attention object (no_op, replace_with_linear, "
                              "n_heads_in_group)")
        none = next((why for key, why in NO_ATTENTION_BLOCK.items() if attn.get(key)), "")
        group = attn.get("n_heads_in_group")
        if not none:
            if isinstance(group, bool) or not isinstance(group, int) or group < 1:
                raise ConfigError(f"{source}: block_configs[{i}].attention.n_heads_in_group must be a whole number "
                                  f">= 1 for an attention block, not {group!r}")
        out.append((none, group if not none else None))
    return out


def _model_layer_kinds(text, n: int, source: str) -> tuple[list[str], dict[int, str]] | None:
    """layer_types from a model's own layout keys where the file has no layer_types (each read as the model's
    code reads it), and why the layers outside attention cache nothing; None where none is given:

    - attn_type_list (MiniMax-Text-01): 0 a lightning (linear) attention layer, 1 softmax attention (its
      modeling code, vLLM's minimax_text_01.py; transformers' MiniMaxConfig holds it as layer_types);
    - layers_block_type ("attention" / "mamba"), or attn_layer_period and attn_layer_offset (Jamba: layer i is
      attention where i % period == offset, transformers' JambaConfig.layers_block_type);
    - block_configs (DeciLM / Nemotron-NAS): a block whose attention is no_op or replace_with_linear."""
    listed = getattr(text, "attn_type_list", None)
    if listed is not None:
        if not isinstance(listed, (list, tuple)) or len(listed) != n or any(v not in (0, 1) for v in listed):
            raise ConfigError(f"{source}: attn_type_list must hold one 0 (linear attention) or 1 (softmax attention) "
                              f"per layer ({n}); kvbench reads no other value")
        return ["full_attention" if v == 1 else "linear_attention" for v in listed], {}
    blocks = getattr(text, "layers_block_type", None)
    period, offset = getattr(text, "attn_layer_period", None), getattr(text, "attn_layer_offset", None)
    if blocks is None and period is not None:
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (period, offset)) or period < 1 \
                or not 0 <= offset < period:
            raise ConfigError(f"{source}: attn_layer_period {period!r} and attn_layer_offset {offset!r} must be whole "
                              "numbers, 0 <= offset < period")
        blocks = ["attention" if i % period == offset else "mamba" for i in range(n)]
    if blocks is not None:
        if not isinstance(blocks, (list, tuple)) or len(blocks) != n or any(b not in ("attention", "mamba")
                                                                            for b in blocks):
            raise ConfigError(f"{source}: layers_block_type must hold one 'attention' or 'mamba' per layer ({n})")
        return ["full_attention" if b == "attention" else "mamba" for b in blocks], {}
    decilm = _block_configs(text, n, source)
    if decilm is not None:
        return (["linear_attention" if none else "full_attention" for none, _ in decilm],
                {i: none for i, (none, _) in enumerate(decilm) if none})
    return None


def _layer_kinds(text, raw: dict, n: int, model_type: str, source: str) -> tuple[list[tuple[str, int | None]], list[str]]:
    """Per layer (kind, span) and why a layer caches nothing."""
    window = getattr(text, "sliding_window", None)
    windows = None
    if isinstance(window, (list, tuple)):  # one window per layer; null or 0: full attention
        windows = _per_layer(list(window), n, "sliding_window", source)
        window = max((w for w in windows if w), default=None)
    chunk = getattr(text, "attention_chunk_size", None)
    types = getattr(text, "layer_types", None)
    if types is not None and (not isinstance(types, (list, tuple)) or set(types) <= MLP_LAYER_TYPES):
        types = None
    why_model: dict[int, str] = {}
    if types is None and (found := _model_layer_kinds(text, n, source)) is not None:
        types, why_model = found
    if types is None and windows is not None:
        types = ["sliding_attention" if w else "full_attention" for w in windows]
    if types is not None:
        if len(types) != n:
            raise ConfigError(f"{source}: layer_types has {len(types)} entries for {n} layers")
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ConfigError(f"{source}: layer_types {', '.join(map(repr, unknown))}: kvbench does not model this "
                              f"attention; it knows {', '.join(sorted(LAYER_TYPES))}")
    elif window and getattr(text, "use_sliding_window", True) is not False:
        types = ["sliding_attention"] * n  # transformers: sliding_window without layer_types windows every layer
    elif chunk:
        types = ["chunked_attention"] * n
    else:
        types = ["full_attention"] * n
    kinds, why = [], []
    for i, t in enumerate(types):
        kind = LAYER_TYPES[t]
        span = (windows[i] if windows is not None else window) if kind == "sliding" else chunk if kind == "chunked" \
            else None
        if kind in ("sliding", "chunked") and not span:
            raise ConfigError(f"{source}: a {t} layer without {'sliding_window' if kind == 'sliding' else 'attention_chunk_size'}")
        kinds.append((kind, span))
        why.append(why_model.get(i) or WHY_NONE.get(t, ""))
    shared = getattr(text, "num_kv_shared_layers", None) or 0  # Gemma 3n: the last layers reuse earlier KV
    for i in range(n - shared, n):
        kinds[i], why[i] = ("none", None), "reuses an earlier layer's KV"
    for i in getattr(text, "cross_attention_layers", None) or ():  # Mllama
        if 0 <= i < n:
            kinds[i], why[i] = ("none", None), "cross-attention: caches the image, not the text"
    return kinds, why


def _max_context(text, known: bool, source: str, notes: list[str], model_type: str) -> int | None:
    """The longest request the model serves: max_position_embeddings (or its alias), scaled by the RoPE
    scaling the config declares (:func:`rope_limit`)."""
    value = _get(text, "max_position_embeddings", known)
    if value is None:
        return None
    base = _positive_int(value, "max_position_embeddings", source)
    limit, note = rope_limit(text, base, model_type)
    if note:
        notes.append(note)
    return limit


class _RopeReader:
    """A config transformers has no class for, as transformers' RotaryEmbeddingConfigMixin reads RoPE."""

    def __init__(self, text, base: int):
        self.rope_parameters = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
        self.rope_theta = getattr(text, "rope_theta", None)
        self.max_position_embeddings = base
        self.layer_types = getattr(text, "layer_types", None)
        if getattr(text, "original_max_position_embeddings", None):
            self.original_max_position_embeddings = text.original_max_position_embeddings


def rope_parameters(text, base: int) -> list[dict]:
    """The config's RoPE parameters as transformers standardizes them (modeling_rope_utils: ``rope_scaling``
    moved to ``rope_parameters``, ``type`` to ``rope_type``, ``original_max_position_embeddings`` filled
    for yarn / llama3 / longrope), one dict per layer type where they are nested."""
    if isinstance(text, PlainConfig):
        return plain_rope_parameters(text)
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    if builtin(text):
        params, reader = getattr(text, "rope_parameters", None), text  # standardized by the class at load
    else:
        raw = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
        if not isinstance(raw, dict) or not raw:
            return []
        reader = type("RopeReader", (_RopeReader, RotaryEmbeddingConfigMixin), {})(text, base)
        reader.standardize_rope_params()
        params = reader.rope_parameters
    if not isinstance(params, dict) or not params:
        return []
    nested = RotaryEmbeddingConfigMixin.nested_rope_parameter_keys(reader, params)
    found = [params[k] for k in nested] if nested else [params]
    return [p for p in found if isinstance(p, dict)]


def rope_limit(text, base: int, model_type: str = "") -> tuple[int, str | None]:
    """(the model's limit, how it was derived): max_position_embeddings, times the factor of a RoPE scaling
    that extends it (linear, dynamic, yarn: yarn from its original_max_position_embeddings), as vLLM
    derives max_model_len (config/model.py _get_and_verify_max_len). llama3 and longrope configs already
    state the extended length in max_position_embeddings, and Gemma 3's is already scaled."""
    if "gemma3" in model_type:
        return base, None
    factor, derived, kind = 1.0, base, None
    for p in rope_parameters(text, base):
        rope_type = p.get("rope_type") or p.get("type") or "default"
        if rope_type in ("default", "su", "longrope", "llama3"):
            continue
        factor = p.get("factor") or factor
        kind = rope_type
        if rope_type == "yarn" and p.get("original_max_position_embeddings"):
            derived = int(p["original_max_position_embeddings"])
    limit = int(derived * factor)
    if kind is None or limit == base:
        return base, None
    field = "original_max_position_embeddings" if kind == "yarn" else "max_position_embeddings"
    return limit, (f"the model's limit: {field} {derived:,} x {kind} factor {factor:g} = {limit:,} tokens "
                   "(its rope_parameters / rope_scaling)")


def builtin(config) -> bool:
    """Whether ``config`` is one of transformers' own classes (not a RawConfig, not a remote-code class)."""
    return isinstance(config, PlainConfig) or (not isinstance(config, RawConfig)
                                               and type(config).__module__.startswith("transformers."))


def quantisation_flags(quant) -> list[str]:
    """Geometry flags from a checkpoint's quantization_config, for the engines' ``auto`` dtypes:
    ``quant_method=<method>`` and ``kv_cache_fp8`` where it declares an 8-bit float KV cache (ModelOpt's
    kv_cache_quant_algo FP8, compressed-tensors' kv_cache_scheme of type float, 8 bits)."""
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict() if callable(getattr(quant, "to_dict", None)) else vars(quant)
    if not isinstance(quant, dict):
        return []
    flags = [f"quant_method={str(quant.get('quant_method') or '').lower()}"] if quant.get("quant_method") else []
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
    kv = (inner.get("kv_cache_scheme") or quant.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
          or quant.get("kv_cache_quant_algo"))
    if isinstance(kv, str) and kv.lower().startswith("fp8") or isinstance(kv, dict) and kv.get("num_bits") == 8 and str(kv.get("type", "")).lower() == "float":
        flags.append("kv_cache_fp8")
    return flags


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
             "attn_layer_offset", "block_configs", "num_nextn_predict_layers"}
NOT_KV_WORDS = ("mlp", "moe", "expert", "ffn", "intermediate", "dropout", "norm", "router", "vocab", "token_id",
                "init", "vision", "audio", "image")
LAYER_KEY = re.compile(r"(layer|block|attn|attention|window|swa|global|local|kv|head)", re.IGNORECASE)
PATTERN_KEY = re.compile(r"(pattern|period|offset|interval|every|freq|ratio|idx|indices|ids|list|types?|layers|map)$",
                         re.IGNORECASE)
KIND_WORDS = ("attention", "attn", "sliding", "full", "global", "local", "linear", "mamba", "window", "swa")


def unread_keys(raw: dict, text) -> list[str]:
    """Keys of a config transformers has no class for (or a remote-code class) that the KV reader did not
    read and that look per-layer: a list as long as the layers, a list of layer kinds, or a layer pattern
    under a model-specific name (``attn_type_list``, ``sliding_window_pattern``, ``global_attn_layers``).
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
        pattern = LAYER_KEY.search(key) and PATTERN_KEY.search(key) and isinstance(value, (int, list, tuple, str, dict))
        if per_layer or kinds or pattern:
            out.append(key)
    return sorted(out)


def refuse_unread(keys, source: str) -> None:
    """One ConfigError naming the per-layer-looking keys the reader did not read: the layout they describe is
    not known, and a plan of every layer as full attention would be several times off, as confident as any."""
    if keys:
        raise ConfigError(f"{source}: {', '.join(keys)} look{'s' * (len(keys) == 1)} per-layer and kvbench does not "
                          "read it: which layers cache what is unknown, so no KV is planned (kvbench reads "
                          "layer_types, attn_type_list, layers_block_type, attn_layer_period/offset, block_configs, "
                          "and per-layer head counts, head_dim and sliding_window; --trust-remote-code reads a class "
                          "that derives layer_types)")


def _dtype(text, config) -> str | None:
    for c in (text, config):
        value = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
        if value is not None:
            return DTYPES.get(str(value).replace("torch.", ""), str(value).replace("torch.", ""))
    return None


# --- GGUF metadata ----------------------------------------------------------------------------------

def geometry_from_gguf_keys(keys: dict, source: str = "GGUF") -> KVGeometry:
    """From GGUF metadata keys: a GGUF file's fields or Ollama's /api/show ``model_info``. A GGUF already
    says what llama.cpp caches (its converter writes llama.cpp's view: MLA heads, windows, patterns)."""
    arch = keys.get("general.architecture")
    if not arch:
        raise ConfigError(f"{source}: general.architecture is missing")

    def key(name):
        return keys.get(f"{arch}.{name}")
    n, heads = key("block_count"), key("attention.head_count")
    missing = [f"{arch}.{k}" for k, v in [("block_count", n), ("attention.head_count", heads)] if v is None]
    if missing:
        raise ConfigError(f"{source}: {', '.join(missing)} missing: the KV geometry needs it")
    heads_l = _per_layer(heads, n, f"{arch}.attention.head_count", source)
    kv = key("attention.head_count_kv")
    kv_l = _per_layer(kv if kv is not None else heads, n, f"{arch}.attention.head_count_kv", source)
    embd = key("embedding_length")
    head_k, head_v = key("attention.key_length"), key("attention.value_length")
    kv_lora = key("attention.kv_lora_rank")
    if head_k is None and (embd is None or not max(heads_l)):
        raise ConfigError(f"{source}: {arch}.attention.key_length or {arch}.embedding_length missing")
    head_k = head_k or embd // max(heads_l)
    head_v = head_v if head_v is not None else head_k
    window = key("attention.sliding_window")
    pattern = key("attention.sliding_window_pattern")
    if window:
        if isinstance(pattern, list):
            sliding = [bool(x) for x in pattern]
        else:
            p = pattern if pattern is not None else {"gemma2": 2, "gemma3": 6, "gpt-oss": 2, "cohere2": 4}.get(arch, 0)
            # llama.cpp's set_swa_pattern: layer il is sliding when il % p < p - 1 (p = 0: every layer)
            sliding = [p == 0 or (i % p) < p - 1 for i in range(n)]
    else:
        sliding = [False] * n
    mla = None
    if kv_lora and key("attention.key_length_mla") is not None:
        # llama.cpp's MLA: one latent of kv_lora_rank + rope, K only (deepseek2)
        rope = key("rope.dimension_count")
        mla = MLAShape(kv_lora, rope, (key("attention.key_length_mla") or 0) - (rope or 0),
                       key("attention.value_length_mla"), max(heads_l))
        head_k, head_v, kv_l = kv_lora + rope, 0, [1] * n
    layers = tuple(LayerKV("sliding" if s else "full", k, head_k, head_v, window if s else None) if k else
                   LayerKV("none", why_none="recurrent: a state of constant size")
                   for s, k in zip(sliding, kv_l))
    return KVGeometry(layers, max(heads_l), key("context_length"), mla, arch, None, "gguf")


def gguf_reader(path: str | Path):
    """gguf's GGUFReader of ``path``, one per file version: it parses every field (the tokenizer's 49K
    strings of the embedded model take seconds), and a plan reads a GGUF's keys and its tensors."""
    st = os.stat(path)
    return _gguf_reader(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader  # heavy import only when a GGUF is read

    try:  # a regular file whose header is a GGUF's, before gguf maps it
        bounded.check_gguf_header(path)
    except bounded.InputError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - numpy's and struct's errors of a truncated or damaged file
        raise ConfigError(f"GGUF file {path} cannot be read: damaged or truncated "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})") from None


def gguf_header(path: str | Path) -> bounded.GGUFHeader | None:
    """A GGUF v2/v3 file's keys (without the tokenizer's vocabulary) and tensor descriptions, read in one checked
    pass without gguf's reader (:func:`kvbench.kv.bounded.read_gguf_header`: 13 ms for the embedded model
    where GGUFReader takes seconds and imports numpy); None for a version 1 file. One per file version."""
    st = os.stat(path)
    return _gguf_header(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _gguf_header(path: str, mtime_ns: int, size: int) -> bounded.GGUFHeader | None:
    try:
        return bounded.read_gguf_header(path)
    except bounded.InputError as exc:
        raise ConfigError(str(exc)) from None


@functools.cache
def ggml_type_sizes() -> dict[int, tuple[int, int]]:
    """gguf's GGML_QUANT_SIZES, {ggml type: (values per block, bytes per block)}, from its constants module
    alone (the gguf package's __init__ imports numpy and its reader; constants.py imports only enum)."""
    import importlib.util

    found = importlib.util.find_spec("gguf")  # locates the package without importing it
    spec = importlib.util.spec_from_file_location("kvbench._gguf_constants",
                                                  Path(found.submodule_search_locations[0]) / "constants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {int(kind): tuple(sizes) for kind, sizes in module.GGML_QUANT_SIZES.items()}


def gguf_tensors(path: str | Path) -> list[tuple[int, int]]:
    """(values, bytes) of each tensor of a GGUF file, as gguf's reader counts them (values x bytes per block /
    values per block)."""
    header = gguf_header(path)
    if header is None:
        return [(int(t.n_elements), int(t.n_bytes)) for t in gguf_reader(path).tensors]
    sizes, out = ggml_type_sizes(), []
    for name, shape, kind in header.tensors:
        if kind not in sizes:
            raise ConfigError(f"GGUF file {path}: tensor {name} has ggml type {kind}, which gguf does not know")
        block, per_block = sizes[kind]
        values = 1
        for n in shape:
            values *= n
        out.append((values, values * per_block // block))
    return out


def gguf_keys(path: str | Path) -> dict:
    """A GGUF file's metadata as {key: value} (arrays as lists), without the tokenizer's vocabulary."""
    header = gguf_header(path)
    if header is not None:
        return dict(header.keys)
    out = {}
    for name, f in gguf_reader(path).fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model",):
            continue
        try:
            out[name] = f.contents()
        except Exception as exc:  # noqa: BLE001 - a field whose bytes do not hold what its type says
            raise ConfigError(f"GGUF file {path}: its key {name} cannot be read ({type(exc).__name__})") from None
    return out


def geometry_from_gguf(path: str | Path) -> KVGeometry:
    return geometry_from_gguf_keys(gguf_keys(path), str(path))
