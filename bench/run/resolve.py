"""Step "resolve" of a run: what the command line names, made into what the run uses.

Before a run folder exists (cheap, so a refusal creates nothing): the options from the flags
(:func:`options_from_flags`, each option read and checked as bench/run/options.py declares it) and the
model located (:func:`~kvbench.common.models.locate`). Inside the run: the model's files, converted once
where an engine needs an HF-format copy of a GGUF (:func:`resolve_model`).
"""
from __future__ import annotations

from typing import Any

from rich.console import Console

from kvbench.backends import gguf_converter
from kvbench.common import models
from kvbench.run.option_fields import read_flags
from kvbench.run.options import RunOptions


def options_from_flags(values: dict[str, Any]) -> RunOptions:
    """The run's options from ``kvbench run``'s flags (by parameter name). ValueError (one line, a
    WorkloadError or ConfigError among them) or FlagError where one is refused."""
    return read_flags(RunOptions, values)


def resolve_model(options: RunOptions, console: Console) -> models.ModelFiles:
    """The model's files and geometry (ModelError where it cannot be had)."""
    return models.resolve(options.model, gguf_converter(console.print), log=console.print,
                          weights=options.needs_weights)
