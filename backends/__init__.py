"""Engine adapters, one folder each: ``backends/<engine>/adapter.py`` (start, stream, poll, stop) and
``backends/<engine>/kvrules.py`` (how the engine sizes and rounds its KV; imports only ``kvbench.kv``).

This module is the registry: adding an engine is its folder plus one line in :data:`ENGINES`. Nothing is
imported until asked for, so that the planner, which reads only the rules, never loads an adapter. What an
engine can do beyond the core hooks (backends/base.py) it declares as capability groups
(backends/capabilities.py); what several engines share is in backends/shared/, never imported from another
engine's folder.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from kvbench.kv.rules import KVRules

    from .base import Backend

# engine -> (its adapter class in adapter.py, its rules class in kvrules.py or None)
ENGINES: dict[str, tuple[str, str | None]] = {
    "hf": ("HFBackend", "TransformersKV"),
    "vllm": ("VLLMBackend", "VLLMKV"),
    "llamacpp": ("LlamaCppBackend", "LlamaCppKV"),
    "tgi": ("TGIBackend", "TGIKV"),
    "ollama": ("OllamaBackend", "OllamaKV"),
    "sglang": ("SGLangBackend", "SGLangKV"),
    "openai": ("OpenAIBackend", None),
}
# What `make bench`, `kvbench run`, `setup` and `validate` run when no -b is given: the engines that run here.
DEFAULT_ENGINES: tuple[str, ...] = ("hf", "vllm", "llamacpp")
# Engines whose environments lend a tool beside serving: transformers makes the HF-format copy of a GGUF
# and builds the random-weight validation models; llama.cpp's converter makes a GGUF from an HF folder.
HF_TOOLS_ENGINE = "hf"
GGUF_TOOLS_ENGINE = "llamacpp"


class _Registry(Mapping):
    """engine name -> adapter class, each adapter module imported on first use."""

    def __getitem__(self, engine: str) -> type[Backend]:
        if engine not in ENGINES:
            raise KeyError(engine)
        return _adapter(engine)

    def __iter__(self) -> Iterator[str]:
        return iter(ENGINES)

    def __len__(self) -> int:
        return len(ENGINES)


@cache
def _adapter(engine: str) -> type[Backend]:
    return getattr(importlib.import_module(f"{__name__}.{engine}.adapter"), ENGINES[engine][0])


REGISTRY: Mapping[str, type[Backend]] = _Registry()


@cache
def kv_rules(engine: str) -> KVRules | None:
    """The engine's KV rules, from its kvrules module alone (None: it has none, e.g. attach-only openai)."""
    cls_name = ENGINES[engine][1]
    if cls_name is None:
        return None
    return getattr(importlib.import_module(f"{__name__}.{engine}.kvrules"), cls_name)()


def engines_with_rules() -> list[str]:
    return [name for name, (_, rules) in ENGINES.items() if rules is not None]


def gguf_converter(log=print):
    """What makes the HF-format copy of a GGUF (for the engines that read safetensors)."""
    return REGISTRY[HF_TOOLS_ENGINE].gguf_converter(log)


def hf_tools_python(log=print) -> Path:
    """An interpreter with torch and transformers: the Python of the environment of the engine that lends them
    (installed on first use). An engine that needs one asks here, not that engine's folder."""
    from kvbench.common.envs import ensure_env, env_python

    tools = REGISTRY[HF_TOOLS_ENGINE]
    return env_python(ensure_env(tools.recipe(tools.default_version), log=log))
