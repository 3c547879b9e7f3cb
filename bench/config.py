"""Typed configuration of a run: which backends (engine + version + options), model, workload."""
from __future__ import annotations

from pydantic import BaseModel, Field

from backends import REGISTRY


class ConfigError(ValueError):
    pass


class BackendConfig(BaseModel):
    """One engine at one version. The version picks the isolated environment, so two versions of one
    engine can run in the same run (``vllm@0.31.0`` and ``vllm@0.32.0``)."""

    engine: str
    version: str
    options: dict = Field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.engine}-{self.version}"

    @classmethod
    def parse(cls, text: str) -> "BackendConfig":
        """``ENGINE[@VERSION][:KEY=VALUE,...]``, e.g. ``vllm``, ``vllm@0.32.0``, ``llamacpp:threads=2``."""
        head, _, opts = text.partition(":")
        engine, _, version = head.partition("@")
        engine = engine.strip().lower()
        if engine not in REGISTRY:
            raise ConfigError(f"backend {engine!r} is not known; allowed: {', '.join(sorted(REGISTRY))}")
        options = {}
        for item in filter(None, opts.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"backend option {item!r} in {text!r} must be KEY=VALUE")
            options[key.strip()] = _scalar(value.strip())
        return cls(engine=engine, version=version or REGISTRY[engine].default_version, options=options)


def _scalar(value: str):
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
