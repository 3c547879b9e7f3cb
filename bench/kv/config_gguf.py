"""A model's KV geometry from GGUF metadata (a GGUF file's keys, or Ollama's ``/api/show`` ``model_info``), and a GGUF
file's keys and tensors read without gguf's reader where the header allows."""
from __future__ import annotations

import functools
import os
from pathlib import Path

from kvbench.kv import bounded
from kvbench.kv.config_core import ConfigError, per_layer
from kvbench.kv.geometry import KVGeometry, LayerKV, MLAShape


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
    heads_l = per_layer(heads, n, f"{arch}.attention.head_count", source)
    kv = key("attention.head_count_kv")
    kv_l = per_layer(kv if kv is not None else heads, n, f"{arch}.attention.head_count_kv", source)
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
    vocab = key("vocab_size")  # llama.cpp's converter writes it; the tokenizer's list is not read
    return KVGeometry(layers, max(heads_l), key("context_length"), mla, arch, None, "gguf",
                      vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None)


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
