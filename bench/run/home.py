"""What a run or a setup must write into KVBENCH_HOME (engine environments not installed yet, a GGUF's
HF-format copy not made yet), and the one-line refusal where it cannot be written: checked before a run
folder exists or an install starts. Light to import (no pandas): `kvbench setup` reads it.
"""
from __future__ import annotations

from pathlib import Path

from kvbench.backends import REGISTRY
from kvbench.common import models
from kvbench.common.envs import HOME_ADVICE, Recipe, home_problem, is_installed
from kvbench.run.backend_config import BackendConfig


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
