"""An HF config read through transformers' own config classes (:func:`hf_config`, :func:`text_config`), or as
written (:class:`RawConfig`) for a model type transformers does not know; what a class fills where the file is
silent (:func:`class_filled`); the model's limit from its RoPE scaling (:func:`rope_limit`); and a checkpoint's
quantization_config as geometry flags (:func:`quantisation_flags`)."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from kvbench.kv import bounded
from kvbench.kv.config_core import ALIASES, ConfigError
from kvbench.kv.config_plain import PlainConfig, plain_config, plain_rope_parameters
from kvbench.kv.geometry import KVGeometry

READ_PLAIN = True  # read plain configs without transformers (PlainConfig); False: every config through its class


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


def mark_class_filled(text, raw: dict, geometry: KVGeometry) -> KVGeometry:
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
