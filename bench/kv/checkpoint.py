"""What a checkpoint holds, counted from its config: its parameters by module kind (:class:`Breakdown`), and
:class:`Weights`, the answer every source of a model's weight bytes gives (kvbench.kv.weights, .quantized)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

# architectures whose MLP has two matrices (up, down) rather than three (gate, up, down)
UNGATED_MLP = {"gpt2", "opt", "falcon", "RefinedWeb", "RefinedWebModel", "gpt_neox", "gptj", "bloom", "gpt_bigcode",
               "mpt", "phi", "starcoder2", "stablelm_epoch"}


FALCON = ("falcon", "RefinedWeb", "RefinedWebModel")


@dataclass(frozen=True)
class Weights:
    bytes: float | None  # None: unknown
    source: str  # where the figure comes from, or why it is unknown
    exact: bool = False
    parameters: float | None = None  # the model's parameters (main model, as published: MTP layers not counted)
    # kind -> bytes ("embeddings", "lm_head", "attention", "mla", "dense_mlp", "experts", "shared_experts",
    # "router", "norms", "mamba", "mtp"); empty when the figure is exact or unknown
    breakdown: dict = field(default_factory=dict, compare=False, hash=False)
    # how the figure was found: "user", "safetensors", "gguf", "index", "catalog", "hub", "quantization_config",
    # "override", "estimate", "published", "unknown"
    method: str = ""


@dataclass(frozen=True)
class Part:
    """One kind of tensor in the checkpoint: ``rows`` x ``cols`` (a vector has cols 1), ``copies`` per layer
    (the routed experts), on each of ``layers`` (None: once). ``role``: "linear" (a Linear layer's weight, what
    quantisation replaces), "vector" (norms, biases, conv kernels, A/D), "router", "embedding", "lm_head"."""
    kind: str
    name: str  # the module's canonical HF name, "{i}" for the layer index
    rows: int
    cols: int = 1
    role: str = "vector"
    layers: tuple[int, ...] | None = None
    copies: int = 1

    @property
    def per_layer(self) -> int:
        return self.rows * self.cols * self.copies

    @property
    def parameters(self) -> int:
        return self.per_layer * (len(self.layers) if self.layers is not None else 1)

    def names(self):
        """(layer index or None, module name) for each place the part is."""
        if self.layers is None:
            yield None, self.name
        else:
            for i in self.layers:
                yield i, self.name.format(i=i)


@dataclass(frozen=True)
class Breakdown:
    parts: tuple[Part, ...]
    how: str  # the counting, in words
    vision: bool = False  # a multimodal wrapper: the vision tower is not counted

    @property
    def parameters(self) -> float:
        """The model's parameters (the MTP layers a checkpoint may carry are not counted)."""
        return float(sum(p.parameters for p in self.parts if p.kind != "mtp"))

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.parts:
            out[p.kind] = out.get(p.kind, 0) + p.parameters
        return out


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


def parameter_breakdown(text, wrapper=None) -> Breakdown:
    """The checkpoint's tensors, by module kind, of the text model a transformers config object describes.
    Raises _Unknown (what is missing) or TypeError/ValueError (sizes that do not count)."""
    model_type = str(getattr(text, "model_type", ""))
    h = _need(text, "hidden_size", "n_embd", "d_model", "model_dim")  # (OpenELM: model_dim, num_transformer_layers,
    layers = _need(text, "num_hidden_layers", "n_layer", "num_layers", "num_transformer_layers")  # num_query_heads)
    heads = _need(text, "num_attention_heads", "n_head", "num_query_heads")
    vocab = _need(text, "vocab_size", "padded_vocab_size")
    heads_l = _layer_values(heads, layers, "num_attention_heads")
    heads = max(heads_l)
    hd = _first(text, "head_dim") if isinstance(_first(text, "head_dim"), int) else None
    if hd is None and len(set(heads_l)) > 1:
        raise _Unknown("head_dim (num_attention_heads differs per layer)")
    hd = hd or h // heads
    kv_l = _layer_values(_first(text, "num_key_value_heads_per_layer", "num_key_value_heads", "num_kv_heads",
                                "n_head_kv", "multi_query_group_num") or heads_l, layers, "num_key_value_heads")
    blocks = _decilm_blocks(text, h, heads_l, layers)  # DeciLM / Nemotron-NAS: each block its own widths
    if blocks is not None:
        kv_l = [kv or 1 for kv in blocks[0]]
    if model_type in FALCON and getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_l = [1] * layers
    kv = max(kv_l)

    def by_layer(on, *per_layer):
        """``on`` grouped by the per-layer values at each index (layers past the list, MTP's, take the last)."""
        groups: dict[tuple, list[int]] = {}
        for i in on:
            groups.setdefault(tuple(v[min(i, len(v) - 1)] for v in per_layer), []).append(i)
        return [(key, tuple(idx)) for key, idx in groups.items()]
    gpt_oss = model_type == "gpt_oss"

    def attention(on, kind_override=None):
        at = "model.layers.{i}.self_attn."
        if getattr(text, "kv_lora_rank", None):
            rank, rope = text.kv_lora_rank, text.qk_rope_head_dim
            nope, v = _need(text, "qk_nope_head_dim"), _need(text, "v_head_dim")
            q_rank = getattr(text, "q_lora_rank", None)
            if q_rank:
                out = [Part("mla", at + "q_a_proj", q_rank, h, "linear", on),
                       Part("norms", at + "q_a_layernorm", q_rank, 1, "vector", on),
                       Part("mla", at + "q_b_proj", heads * (nope + rope), q_rank, "linear", on)]
            else:
                out = [Part("mla", at + "q_proj", heads * (nope + rope), h, "linear", on)]
            out += [Part("mla", at + "kv_a_proj_with_mqa", rank + rope, h, "linear", on),
                    Part("norms", at + "kv_a_layernorm", rank, 1, "vector", on),
                    Part("mla", at + "kv_b_proj", heads * (nope + v), rank, "linear", on),
                    Part("attention", at + "o_proj", h, heads * v, "linear", on)]
        else:
            out = []
            for (nq, nkv), idx in by_layer(on, heads_l, kv_l):  # one group per (heads, KV heads) of the layers
                out += [Part("attention", at + "q_proj", nq * hd, h, "linear", idx),
                        Part("attention", at + "k_proj", nkv * hd, h, "linear", idx),
                        Part("attention", at + "v_proj", nkv * hd, h, "linear", idx),
                        Part("attention", at + "o_proj", h, nq * hd, "linear", idx)]
                if getattr(text, "attention_bias", False) or model_type.startswith("qwen2"):
                    out += [Part("attention", at + "q_proj.bias", nq * hd, 1, "vector", idx),
                            Part("attention", at + "k_proj.bias", nkv * hd, 1, "vector", idx),
                            Part("attention", at + "v_proj.bias", nkv * hd, 1, "vector", idx)]
            if gpt_oss:  # its o_proj has a bias too, and each head a learned attention sink
                out += [Part("attention", at + "o_proj.bias", h, 1, "vector", on),
                        Part("attention", at + "sinks", heads, 1, "vector", on)]
        return [_kind(p, kind_override) for p in out]

    gated = model_type not in UNGATED_MLP
    projections = ("gate_proj", "up_proj", "down_proj") if gated else ("up_proj", "down_proj")

    def mlp(prefix, kind, inter, on, copies=1):
        return [Part(kind, prefix + name, h if name == "down_proj" else inter, inter if name == "down_proj" else h,
                     "linear", on, copies) for name in projections]

    dense_inter = _first(text, "intermediate_size_mlp", "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")
    if blocks is not None:
        dense_inter = blocks[1]
    if dense_inter is None and not gated:
        dense_inter = 4 * h  # GPT-2, Falcon, BLOOM: the MLP is 4 x hidden
    experts = _first(text, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
    mtp_layers = _first(text, "num_nextn_predict_layers") or 0
    mtp_layers = mtp_layers if isinstance(mtp_layers, int) and mtp_layers > 0 else 0
    moe_set = set(_moe_layer_indices(text, layers + mtp_layers, model_type)) if experts else set()
    moe_on = tuple(i for i in range(layers) if i in moe_set)
    dense_on = tuple(i for i in range(layers) if i not in moe_set)
    shared_name = "shared_experts" if model_type.startswith(("deepseek", "kimi")) else "shared_expert"

    expert_inter = shared = 0
    if experts:
        expert_inter = _need(text, "moe_intermediate_size", "intermediate_size")
        if not isinstance(expert_inter, int):
            raise ValueError(f"the experts' width (moe_intermediate_size or intermediate_size) is {expert_inter!r}: "
                             "kvbench counts experts of one width")
        shared = (_first(text, "n_shared_experts") or 0) * expert_inter
        shared = shared or _first(text, "shared_expert_intermediate_size") or 0
        if model_type.startswith("llama4"):
            shared = _need(text, "intermediate_size")  # one shared expert beside the routed ones

    def ffn(moe_idx, dense_idx, kind_override=None):
        out = []
        if moe_idx:
            out += mlp("model.layers.{i}.mlp.experts.", "experts", expert_inter, moe_idx, experts)
            if shared:
                out += mlp(f"model.layers.{{i}}.mlp.{shared_name}.", "shared_experts", shared, moe_idx)
            router = "model.layers.{i}.mlp.router" if gpt_oss else "model.layers.{i}.mlp.gate"
            out.append(Part("router", router, experts, h, "router", moe_idx))
            if gpt_oss:  # the experts' and the router's biases
                out += [Part("experts", "model.layers.{i}.mlp.experts.gate_up_proj_bias", 2 * expert_inter, 1,
                             "vector", moe_idx, experts),
                        Part("experts", "model.layers.{i}.mlp.experts.down_proj_bias", h, 1, "vector", moe_idx,
                             experts),
                        Part("router", router + ".bias", experts, 1, "vector", moe_idx)]
        if dense_idx:
            if dense_inter is None:
                raise _Unknown("intermediate_size")
            for (width,), idx in by_layer(dense_idx, _layer_values(dense_inter, layers, "intermediate_size")):
                if width:  # 0: a layer without an MLP
                    out += mlp("model.layers.{i}.mlp.", "dense_mlp", width, idx)
        return [_kind(p, kind_override) for p in out]

    mamba_on = _mamba_layer_indices(text, layers)
    attn_on = tuple(i for i in range(layers) if i not in set(mamba_on))
    if blocks is not None:  # a block without attention holds nothing, or one linear layer in its place
        attn_on = tuple(i for i in attn_on if blocks[0][i])
    parts = [Part("embeddings", "model.embed_tokens", vocab, h, "embedding")]
    parts += attention(attn_on)
    if mamba_on:
        parts += _mamba_mixer_parts(text, h, mamba_on)
    parts += ffn(moe_on, dense_on)
    if blocks is not None and blocks[2]:
        parts.append(Part("dense_mlp", "model.layers.{i}.linear", h, h, "linear", blocks[2]))
    parts.append(Part("norms", "model.layers.{i}.input_layernorm", h, 1, "vector", tuple(range(layers))))
    parts.append(Part("norms", "model.layers.{i}.post_attention_layernorm", h, 1, "vector", tuple(range(layers))))
    parts.append(Part("norms", "model.norm", h))
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(wrapper, "tie_word_embeddings", False))
    if not tied:
        parts.append(Part("lm_head", "lm_head", vocab, h, "lm_head"))

    if experts:
        how = (f"{experts} routed experts of {expert_inter}" + (f" + shared {shared}" if shared else "")
               + f" on {len(moe_on)} of {layers} layers")
    else:
        how = "dense"
    if mamba_on:
        how += f"; {len(mamba_on)} Mamba layers"
    if mtp_layers:  # DeepSeek's multi-token-prediction layers: in the checkpoint, loaded only to speculate
        on = tuple(range(layers, layers + mtp_layers))
        parts += attention(on, "mtp")
        parts += ffn(tuple(i for i in on if i in moe_set), tuple(i for i in on if i not in moe_set), "mtp")
        for name, rows, cols, role in (("model.layers.{i}.eh_proj", h, 2 * h, "vector"),
                                       ("model.layers.{i}.enorm", h, 1, "vector"),
                                       ("model.layers.{i}.hnorm", h, 1, "vector"),
                                       ("model.layers.{i}.input_layernorm", h, 1, "vector"),
                                       ("model.layers.{i}.post_attention_layernorm", h, 1, "vector"),
                                       ("model.layers.{i}.embed_tokens", vocab, h, "embedding"),
                                       ("model.layers.{i}.shared_head.norm", h, 1, "vector"),
                                       ("model.layers.{i}.shared_head.head", vocab, h, "lm_head")):
            parts.append(Part("mtp", name, rows, cols, role, on))
        how += f"; the checkpoint also holds {mtp_layers} MTP layer{'s' * (mtp_layers > 1)}"
    return Breakdown(tuple(parts), how, vision=wrapper is not None and wrapper is not text)


def _decilm_blocks(text, h: int, heads_l: list[int], layers: int) -> tuple[list[int], list[int], tuple[int, ...]] | None:
    """DeciLM / Nemotron-NAS block_configs as (KV heads per layer, 0 without attention; the MLP's width per
    layer, 0 without one; the layers holding a linear layer in place of attention or MLP), as nvidia's
    modeling_decilm.py builds them (vLLM's nemotron_nas.py: an MLP of ffn_mult has int(2 x ffn_mult x hidden / 3)
    rounded up to a multiple of 256). None without block_configs."""
    blocks = getattr(text, "block_configs", None)
    if blocks is None:
        return None
    if not isinstance(blocks, (list, tuple)) or len(blocks) != layers:
        raise ValueError(f"block_configs lists {len(blocks) if isinstance(blocks, (list, tuple)) else 0} blocks for "
                         f"{layers} layers")
    kv, widths, linear = [], [], []

    def part(block, name):
        value = block.get(name) if isinstance(block, dict) else getattr(block, name, None)
        return value if isinstance(value, dict) else vars(value) if hasattr(value, "__dict__") else {}
    for i, block in enumerate(blocks):
        attn, mlp = part(block, "attention"), part(block, "ffn")
        if attn.get("no_op") or attn.get("replace_with_linear"):
            kv.append(0)
            if attn.get("replace_with_linear"):
                linear.append(i)
        else:
            kv.append(heads_l[i] // attn["n_heads_in_group"])
        if mlp.get("no_op") or mlp.get("replace_with_linear"):
            widths.append(0)
            if mlp.get("replace_with_linear"):
                linear.append(i)
        elif isinstance(mlp.get("intermediate_size"), int):
            widths.append(mlp["intermediate_size"])
        else:
            width = int(2 * mlp["ffn_mult"] * h / 3)
            widths.append(width + (-width) % 256)
    return kv, widths, tuple(sorted(linear))


def _layer_values(value, layers: int, key: str) -> list[int]:
    """One value per layer: a number for every layer, or a list of one per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != layers or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{key} lists {len(value)} values for {layers} layers")
        return list(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} is {value!r}, not a whole number")
    return [value] * layers


def _kind(part: Part, kind: str | None) -> Part:
    return part if kind is None else replace(part, kind=kind)


def estimate_parameters(text, wrapper=None) -> tuple[float, str]:
    """(parameters, how counted) of the text model a transformers config object describes."""
    b = parameter_breakdown(text, wrapper)
    how = b.how.split("; the checkpoint also holds")[0]
    return b.parameters, how


def _moe_layer_indices(text, layers: int, model_type: str) -> list[int]:
    """Which layers have experts: DeepSeek's first_k_dense_replace and moe_layer_freq, Qwen's
    mlp_only_layers and decoder_sparse_step, Llama 4's interleave_moe_layer_step / moe_layers."""
    listed = getattr(text, "moe_layers", None)
    if isinstance(listed, (list, tuple)):
        return [int(i) for i in listed]
    first_dense = getattr(text, "first_k_dense_replace", None) or 0
    freq = getattr(text, "moe_layer_freq", None) or 1
    if getattr(text, "first_k_dense_replace", None) is not None:
        return [i for i in range(layers) if i >= first_dense and (i - first_dense) % freq == 0]
    step = getattr(text, "interleave_moe_layer_step", None)
    if step:
        return [i for i in range(layers) if (i + 1) % step == 0]
    period = getattr(text, "expert_layer_period", None)  # Jamba: experts every period-th layer from the offset
    if period:
        offset = getattr(text, "expert_layer_offset", None) or 0
        return [i for i in range(layers) if i % period == offset]
    mlp_only = set(getattr(text, "mlp_only_layers", None) or ())
    sparse_step = getattr(text, "decoder_sparse_step", None) or 1
    return [i for i in range(layers) if i not in mlp_only and (i + 1) % sparse_step == 0]


def _moe_layers(text, layers: int, model_type: str) -> int:
    return len(_moe_layer_indices(text, layers, model_type))


def _mamba_layer_indices(text, layers: int) -> tuple[int, ...]:
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    if len(types) != layers:
        return ()
    return tuple(i for i, t in enumerate(types) if t in ("linear_attention", "mamba"))


def _mamba_layers(text, layers: int) -> int:
    return len(_mamba_layer_indices(text, layers))


def _mamba_mixer_parts(text, h: int, on: tuple[int, ...]) -> list[Part]:
    """A Mamba mixer's tensors (in/out projections, conv, x/dt projections, A, D)."""
    d_state = _first(text, "mamba_d_state", "state_size", "ssm_state_size") or 16
    d_conv = _first(text, "mamba_d_conv", "conv_kernel") or 4
    d_inner = (_first(text, "mamba_expand", "expand") or 2) * h
    dt_rank = _first(text, "mamba_dt_rank", "time_step_rank")
    dt_rank = dt_rank if isinstance(dt_rank, int) else -(-h // 16)
    m = "model.layers.{i}.mamba."
    return [Part("mamba", m + "in_proj", 2 * d_inner, h, "linear", on),
            Part("mamba", m + "conv1d", d_inner, d_conv, "vector", on),
            Part("mamba", m + "x_proj", dt_rank + 2 * d_state, d_inner, "linear", on),
            Part("mamba", m + "dt_proj", d_inner, dt_rank, "linear", on),
            Part("mamba", m + "A_log", d_inner, d_state, "vector", on),
            Part("mamba", m + "D", d_inner, 1, "vector", on),
            Part("mamba", m + "out_proj", h, d_inner, "linear", on)]


def _mamba_mixer(text, h: int) -> int:
    """A Mamba mixer's parameters (one layer's)."""
    return sum(p.per_layer for p in _mamba_mixer_parts(text, h, (0,)))
