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

The public entry: the geometry of an HF config is assembled here from the readers, one module a source, and
everything callers use is re-exported, so they import from this module only. config_core (shared names and
checks of a count), config_checks (the values, the required fields, the keys left unread), config_plain (configs
read without transformers), config_hf (transformers' classes, remote code, RoPE limits, quantization flags),
config_layers (which layers cache what) and config_gguf (GGUF metadata).
"""
from __future__ import annotations

from pathlib import Path

# callers import from this module: what the readers give them is re-exported here
from kvbench.kv.config_checks import (  # noqa: F401 - re-exported
    COUNTS,
    MAX_LAYERS,
    MAX_WIDTH,
    PER_LAYER,
    READ_KEYS,
    REQUIRED,
    STRUCTURAL,
    check_values,
    missing_required,
    refuse_unread,
    unread_keys,
)
from kvbench.kv.config_core import (  # noqa: F401 - re-exported
    ALIASES,
    DTYPES,
    KV_HEAD_FIELDS,
    LAYER_TYPES,
    WHY_NONE,
    ConfigError,
    per_layer,
    positive_int,
)
from kvbench.kv.config_gguf import (  # noqa: F401 - re-exported
    geometry_from_gguf,
    geometry_from_gguf_keys,
    ggml_type_sizes,
    gguf_header,
    gguf_keys,
    gguf_reader,
    gguf_tensors,
)
from kvbench.kv.config_hf import (  # noqa: F401 - re-exported
    KV_FILLED,
    LIMIT_FILLED,
    WEIGHT_FILLED,
    RawConfig,
    builtin,
    class_filled,
    config_file,
    hf_config,
    mark_class_filled,
    quantisation_flags,
    read_json,
    remote_config_file,
    rope_limit,
    rope_parameters,
    text_config,
    transformers_version,
)
from kvbench.kv.config_layers import block_configs, layer_kinds
from kvbench.kv.config_plain import PlainConfig, plain_config, plain_rope_parameters  # noqa: F401
from kvbench.kv.geometry import KVGeometry, LayerKV, MLAShape


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
            geometry = mark_class_filled(text, raw_text, geometry)
        return config, text, geometry
    geometry = _geometry(text, raw_text, config, source, notes)
    if not isinstance(text, RawConfig) and not nested:  # a remote-code class (--trust-remote-code) fills fields too
        geometry = mark_class_filled(text, raw_text, geometry)
    return config, text, geometry


def _get(config, name: str, known: bool):
    """A field by its name, or (for a model type transformers does not know) by one of its aliases."""
    for key in (ALIASES.get(name, (name,)) if not known else (name,)):
        value = getattr(config, key, None)
        if value is not None:
            return value
    return None


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
        return positive_int(value, name, source, allow_list)

    n_layers = field("num_hidden_layers")
    if n_layers == 0:
        raise ConfigError(f"{source}: num_hidden_layers is 0")
    kinds, why = layer_kinds(text, raw, n_layers, model_type, source)
    if all(kind == "none" for kind, _ in kinds):
        raise ConfigError(f"{source}: {model_type or 'this model'} has no attention layer that caches KV "
                          f"({'; '.join(sorted(set(why)))}): there is no KV cache to plan")
    heads = field("num_attention_heads", allow_list=True)
    heads_per_layer = per_layer(heads, n_layers, "num_attention_heads", source)
    flags = quantisation_flags(getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None))
    if not all(h for h, (kind, _) in zip(heads_per_layer, kinds) if kind != "none"):
        raise ConfigError(f"{source}: num_attention_heads is 0 on an attention layer")

    # --- MLA: the latent is what the layers hold; the decompressed shape goes beside it ---------------
    rank = getattr(text, "kv_lora_rank", None)
    if rank:
        rope = getattr(text, "qk_rope_head_dim", None)
        if rope is None:
            raise ConfigError(f"{source}: kv_lora_rank without qk_rope_head_dim: the MLA latent's size is unknown")
        rank, rope = positive_int(rank, "kv_lora_rank", source), positive_int(rope, "qk_rope_head_dim", source)
        nope, v = getattr(text, "qk_nope_head_dim", None), getattr(text, "v_head_dim", None)
        mla = MLAShape(rank, rope, nope, v, max(heads_per_layer))
        layers = tuple(LayerKV(k, 1, rank + rope, 0, span) if k != "none" else LayerKV("none", why_none=w)
                       for (k, span), w in zip(kinds, why))
        return KVGeometry(layers, max(heads_per_layer), _max_context(text, known, source, notes, model_type), mla, model_type,
                          _dtype(text, config), "hf", tuple(flags), tuple(notes), vocab_size=_vocab(text))

    # --- KV heads -----------------------------------------------------------------------------------
    if model_type in ("falcon", "RefinedWeb", "RefinedWebModel"):
        # transformers' FalconAttention: new_decoder_architecture uses num_kv_heads; else multi_query is one
        # KV head, whatever num_kv_heads says (its class default is num_attention_heads)
        if getattr(text, "new_decoder_architecture", False):
            flags.append("new_decoder_architecture")
            kv = positive_int(getattr(text, "num_kv_heads", None) or heads, "num_kv_heads", source)
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
                kv = positive_int(value, name, source, allow_list=True)
                break
        attn = getattr(text, "attn_config", None)  # MPT, DBRX
        if kv is None and attn is not None:
            value = attn.get("kv_n_heads") if isinstance(attn, dict) else getattr(attn, "kv_n_heads", None)
            kv = positive_int(value, "attn_config.kv_n_heads", source) if value is not None else None
        blocks = block_configs(text, n_layers, source)
        if blocks is not None:  # DeciLM / Nemotron-NAS: each block's KV heads = heads / n_heads_in_group
            kv = [heads_per_layer[i] // group if group else 1 for i, (_, group) in enumerate(blocks)]
        if kv is None:
            kv = heads
            notes.append("no KV-head field: one KV head per attention head (MHA)")
    kv_per_layer = per_layer(kv, n_layers, "KV heads", source)

    # --- head dims ------------------------------------------------------------------------------------
    head_dim = getattr(text, "head_dim", None)
    head_dims = None
    if isinstance(head_dim, (list, tuple)):  # one per layer
        head_dims = per_layer(positive_int(head_dim, "head_dim", source, allow_list=True), n_layers, "head_dim",
                               source)
        head_dim = max(head_dims)
    elif head_dim is not None:
        head_dim = positive_int(head_dim, "head_dim", source)
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
                      _dtype(text, config), "hf", tuple(flags), tuple(notes), vocab_size=_vocab(text))


def _in_file(config, raw: dict, name: str) -> bool:
    """Whether the file gives ``name``, itself or as the field its class reads for it (GPT-2's n_head)."""
    return name in raw or getattr(type(config), "attribute_map", {}).get(name) in raw


def _max_context(text, known: bool, source: str, notes: list[str], model_type: str) -> int | None:
    """The longest request the model serves: max_position_embeddings (or its alias), scaled by the RoPE
    scaling the config declares (:func:`rope_limit`)."""
    value = _get(text, "max_position_embeddings", known)
    if value is None:
        return None
    base = positive_int(value, "max_position_embeddings", source)
    limit, note = rope_limit(text, base, model_type)
    if note:
        notes.append(note)
    return limit


def _vocab(text) -> int | None:
    """The vocabulary the config names (``vocab_size``, Megatron's ``padded_vocab_size``), None where it names
    none a whole positive number."""
    for name in ("vocab_size", "padded_vocab_size"):
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _dtype(text, config) -> str | None:
    for c in (text, config):
        value = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
        if value is not None:
            return DTYPES.get(str(value).replace("torch.", ""), str(value).replace("torch.", ""))
    return None
