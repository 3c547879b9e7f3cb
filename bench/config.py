"""Typed configuration of a run: which backends (engine + version + options), model, workload."""
from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, Field

from kvbench.backends import REGISTRY
from kvbench.backends.options import OptionError, validate
from kvbench.suggest import hint as did_you_mean


class ConfigError(ValueError):
    pass


class BackendConfig(BaseModel):
    """One engine at one version. The version picks the isolated environment, so two versions of one
    engine can run in the same run (``vllm@0.31.0`` and ``vllm@0.32.0``)."""

    engine: str
    version: str
    options: dict = Field(default_factory=dict)
    url: str | None = None  # attach to a server already running there instead of starting one

    @property
    def label(self) -> str:
        if self.url:
            return f"{self.engine}@{urlsplit(self.url).netloc}"
        return f"{self.engine}-{self.version}"

    @classmethod
    def parse(cls, text: str) -> "BackendConfig":
        """``ENGINE[@VERSION][:KEY=VALUE,...]``, e.g. ``vllm``, ``vllm@0.32.0``, ``llamacpp:threads=2``."""
        head, _, opts = text.partition(":")
        engine, _, version = head.partition("@")
        engine = engine.strip().lower()
        if engine not in REGISTRY:
            raise ConfigError(f"backend {engine!r} is not known; {did_you_mean(engine, REGISTRY)}allowed: {', '.join(sorted(REGISTRY))}")
        options = check_options(engine, parse_options(opts, repr(text)))
        url = options.pop("url", None)
        if url is not None:
            url = str(url)
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
                raise ConfigError(f"url {url!r} in {text!r} must look like http://host:port")
        return cls(engine=engine, version=version or REGISTRY[engine].default_version, options=options, url=url)


def check_options(engine: str, options: dict) -> dict:
    """The options checked against the engine's declaration (its adapter's ``option_specs``), typed."""
    try:
        return validate(engine, REGISTRY[engine], options)
    except OptionError as exc:
        raise ConfigError(str(exc)) from None


def parse_options(text: str, where: str) -> dict:
    """``KEY=VALUE,KEY=VALUE`` as a dict, values as bool, int, float or str."""
    options = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"option {item!r} in {where} must be KEY=VALUE")
        options[key.strip()] = _scalar(value.strip())
    return options


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
