"""Which layers cache what: each layer's kind and span from layer_types, or from a model's own layout keys read as
its code reads them (:func:`layer_kinds`, :func:`block_configs`)."""
from __future__ import annotations

from kvbench.kv.config_core import LAYER_TYPES, MLP_LAYER_TYPES, WHY_NONE, ConfigError, per_layer


# What a block of block_configs (DeciLM / Nemotron-NAS, nvidia's modeling_decilm.py and vLLM's nemotron_nas.py)
# holds in place of attention: nothing, or a linear layer; neither caches KV
NO_ATTENTION_BLOCK = {"no_op": "no attention (block_configs: no_op)",
                      "replace_with_linear": "a linear layer in place of attention (block_configs: replace_with_linear)"}


def block_configs(text, n: int, source: str) -> list[tuple[str, int | None]] | None:
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
    - block_configs (DeciLM / Nemotron-NAS): a block whose attention is no_op or replace_with_linear;
    - dense_attention_every_n_layers (Phi-3-small): layer i is dense attention where (i + 1) % n == 0, the others
      block-sparse attention (its modeling_phi3_small.py and vLLM's phi3_small.py). Both kinds are attention that
      writes every token's K and V to the layer's cache (vLLM gives each layer the same Attention and a cache of
      its own; blocksparse_params only change which cached blocks a query reads), so every layer caches KV at
      full length."""
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
    decilm = block_configs(text, n, source)
    if decilm is not None:
        return (["linear_attention" if none else "full_attention" for none, _ in decilm],
                {i: none for i, (none, _) in enumerate(decilm) if none})
    every = getattr(text, "dense_attention_every_n_layers", None)
    if every is not None:  # 0: no dense layer (its code's `if n and ...`); block-sparse layers cache all the same
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"{source}: dense_attention_every_n_layers must be a whole number >= 0 (a period of "
                              f"layers), not {every!r}"[:300])
        return ["full_attention"] * n, {}
    return None


def layer_kinds(text, raw: dict, n: int, model_type: str, source: str) -> tuple[list[tuple[str, int | None]], list[str]]:
    """Per layer (kind, span) and why a layer caches nothing."""
    window = getattr(text, "sliding_window", None)
    windows = None
    if isinstance(window, (list, tuple)):  # one window per layer; null or 0: full attention
        windows = per_layer(list(window), n, "sliding_window", source)
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
