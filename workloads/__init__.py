"""Workload definitions (TOML data files in this folder) and the token-exact prompt builder."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal, Union

from pydantic import BaseModel, Field, ValidationError, field_validator

WORKLOAD_DIR = Path(__file__).parent


class Workload(BaseModel):
    """One workload family. Cells are every (prompt_tokens, concurrency) pair."""

    model_config = {"extra": "forbid"}

    name: str
    description: str = ""
    seed: int
    prompt_tokens: list[Union[int, Literal["max"]]] = Field(min_length=1)
    output_tokens: int = Field(gt=0)
    concurrency: list[int] = Field(min_length=1)
    rounds: int = Field(default=1, gt=0)
    warmup_requests: int = Field(default=1, ge=0)
    warmup_prompt_tokens: int = Field(default=128, gt=0)

    @field_validator("prompt_tokens")
    @classmethod
    def _positive_lengths(cls, lengths):
        for n in lengths:
            if n != "max" and n <= 0:
                raise ValueError(f"prompt length {n} must be a positive integer or \"max\"")
        return lengths

    @field_validator("concurrency")
    @classmethod
    def _positive_concurrency(cls, levels):
        if any(c <= 0 for c in levels):
            raise ValueError("every concurrency level must be >= 1")
        return levels

    def prompt_lengths(self, max_context: int) -> list[int]:
        """Resolve "max" against the model's context limit; drop rungs that would not fit."""
        limit = max_context - self.output_tokens
        resolved = sorted({limit if n == "max" else int(n) for n in self.prompt_tokens})
        return [n for n in resolved if n <= limit]


class WorkloadError(ValueError):
    pass


def available() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))


def load(name_or_path: str) -> Workload:
    """Load a workload by name (a file in workloads/) or by path to a TOML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = WORKLOAD_DIR / f"{name_or_path}.toml"
    if not path.exists():
        raise WorkloadError(f"unknown workload {name_or_path!r}; known: {', '.join(available())} "
                            "(or give a path to a .toml file)")
    try:
        return Workload.model_validate(tomllib.loads(path.read_text()))
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise WorkloadError(f"{path}: {problems}") from None
