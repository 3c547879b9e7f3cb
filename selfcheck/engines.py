"""The engines as the self-checks reach them: by name through the registry (``kvbench.backends``), never by
importing an engine's folder (tests/test_structure.py checks that).

The registry offers an engine's adapter class (``REGISTRY[name]``) and its KV rules (``kv_rules``). A self-check
that needs another part of an engine (its startup-memory rules, a script that runs in its environment) finds
it here from the folder the registry's rules class lives in, so that the one place that knows the layout of
an engine's folder outside ``backends/`` is this module.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from kvbench.backends import HF_TOOLS_ENGINE, REGISTRY, kv_rules

# The engine whose environments hold transformers: its rules size transformers' caches, its scripts measure
# them on a GPU, its adapter makes the HF-format copy of a GGUF.
TRANSFORMERS = HF_TOOLS_ENGINE


def transformers_adapter():
    """TRANSFORMERS' adapter class: its ``gguf_converter(python=...)`` converts with a given interpreter (the
    registry's ``gguf_converter`` uses the engine's own environment)."""
    return REGISTRY[TRANSFORMERS]


def _package(engine: str) -> str:
    rules = kv_rules(engine)
    if rules is None:
        raise LookupError(f"{engine} has no KV rules in the registry: its folder cannot be found from them")
    return type(rules).__module__.rpartition(".")[0]


def engine_module(engine: str, name: str) -> ModuleType:
    """The module ``name`` of the engine's folder (e.g. ``gpumem``, ``kvrules``); importing it loads no adapter."""
    return importlib.import_module(f"{_package(engine)}.{name}")


def startup_rule_module(engine: str) -> ModuleType | None:
    """The module of the engine's startup-memory rule (its ``gpumem``, as its rules module imports it): the home
    of its ``FITTED`` constants and their ``FITS``. None for an engine without one."""
    rules = kv_rules(engine)
    for cls in type(rules).__mro__ if rules is not None else ():
        module = getattr(importlib.import_module(cls.__module__), "gpumem", None)
        if module is not None:
            return module
    return None


def engine_script(engine: str, name: str) -> Path:
    """A script of the engine's ``scripts/`` folder: run inside an interpreter of its own, never imported."""
    package = importlib.import_module(_package(engine))
    return Path(package.__file__).resolve().parent / "scripts" / name
