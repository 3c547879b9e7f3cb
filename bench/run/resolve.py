"""Step "resolve" of a run: what the command line names, made into what the run uses.

Before a run folder exists (cheap, so a refusal creates nothing): the options from the flags
(:func:`options_from_flags`, each option read and checked as bench/run/options.py declares it) and the
model located (:func:`~kvbench.common.models.locate`). Inside the run: the model's files, converted once
where an engine needs an HF-format copy of a GGUF (:func:`resolve_model`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from kvbench.backends import REGISTRY, gguf_converter
from kvbench.common import models
from kvbench.common.envs import HOME_ADVICE, Recipe, home_problem, is_installed
from kvbench.run.backend_config import BackendConfig
from kvbench.run.option_fields import read_flags
from kvbench.run.options import RunOptions


def options_from_flags(values: dict[str, Any]) -> RunOptions:
    """The run's options from ``kvbench run``'s flags (by parameter name). ValueError (one line, a
    WorkloadError or ConfigError among them) or FlagError where one is refused."""
    return read_flags(RunOptions, values)


def resolve_model(options: RunOptions, console: Console) -> models.ModelFiles:
    """The model's files and geometry (ModelError where it cannot be had)."""
    return models.resolve(options.model, gguf_converter(console.print), log=console.print)


def recipes_needed(backends: list[BackendConfig], every: bool = False) -> list[Recipe]:
    """The environments the backends run from (``every``: and the tools beside them, as `kvbench setup`
    installs): none for an attached server, an engine that only attaches, or options naming the user's own
    install (sglang:python=PATH)."""
    out = []
    for cfg in backends:
        cls = REGISTRY[cfg.engine]
        if cfg.url or cfg.deployment or cls.attach_only or cls.own_install(cfg.options):
            continue
        out += cls.recipes(cfg.version) if every else [cls.recipe(cfg.version)]
    return out


def home_refusal(recipes: list[Recipe], model_path: Path | None) -> str | None:
    """Why what must be written into KVBENCH_HOME (environments not installed yet, a GGUF's HF-format copy not
    made yet) cannot be, in one line; None where nothing is to be written there or it can be."""
    missing = [r.name for r in recipes if not is_installed(r)]
    if model_path is not None and model_path.is_file() and \
            not (models.hf_copy_dir(model_path) / "config.json").exists():
        missing.append(f"the HF-format copy of {model_path.name}")
    problem = home_problem() if missing else None
    return f"{problem} (needed for {', '.join(missing)}): {HOME_ADVICE}" if problem else None
