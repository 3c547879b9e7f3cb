"""Workload definitions (TOML data files in this folder) and the token-exact prompt builder.

A workload is data: prompt lengths, output length, the load (its ``[load]`` section, read by the load
profile it names: kvbench.load), repeats, and the family's own settings (a shared prefix, several chat
turns, a KV pool sized below the concurrency). Every engine runs exactly the same requests.

A file from before ``[load]`` gives the load as top-level keys (``load_profile``, ``concurrency``,
``request_rates``, ...): still read, with the same meaning (kvbench.load.registry), and the form
:meth:`Workload.model_dump` writes (run.json's record of the workload).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Union

from pydantic import (BaseModel, Field, SerializeAsAny, ValidationError, field_validator, model_serializer,
                      model_validator)

from kvbench.common.files import check_plain_name
from kvbench.kv import bounded
from kvbench.load import LoadProfile
from kvbench.load.profile import refuse_true_as_a_number
from kvbench.load import registry as load_profiles

WORKLOAD_DIR = Path(__file__).parent
# Bounds on the counts a workload (or --repeats) asks for: far above any real benchmark's, far below what
# would exhaust memory before the first request (10**12 repeats once ended in a MemoryError traceback)
MAX_REPEATS = 1_000
MAX_WARMUP_REQUESTS = 10_000
MAX_REQUESTS_PER_CELL = 1_000_000
MAX_IN_FLIGHT = 100_000
MAX_CELLS = 100_000  # per engine start: prompt lengths x load points x turns x repeats


class Workload(BaseModel):
    """One workload file. Cells are every (variant, prompt length, load point, repeat)."""

    # nan and inf are floats to TOML and pydantic, but no duration, rate or SLO
    model_config = {"extra": "forbid", "allow_inf_nan": False}

    name: str
    description: str = ""
    family: Literal["ladder", "shared_prefix", "multi_turn", "kv_boundary", "kv_quant", "speculation"] = "ladder"
    seed: int
    prompt_tokens: list[Union[int, Literal["max"]]] = Field(min_length=1)
    output_tokens: int = Field(gt=0)
    # --- load: the [load] section, validated by the profile it names (kvbench.load) --------------------
    load: SerializeAsAny[LoadProfile]
    repeats: int = Field(default=1, gt=0)  # run every cell this many times (for confidence intervals)
    warmup_requests: int = Field(default=1, ge=0)
    warmup_prompt_tokens: int = Field(default=128, gt=0)
    # --- SLO for goodput ------------------------------------------------------------------------
    slo_ttft_s: float | None = Field(default=None, gt=0)
    slo_tpot_s: float | None = Field(default=None, gt=0)
    # --- family settings ------------------------------------------------------------------------
    shared_prefix_tokens: int = Field(default=0, ge=0)  # shared_prefix: the same first N tokens in every prompt
    prefix_caching: list[bool] = Field(default_factory=list)  # one engine start per setting; []: engine default
    turns: int = Field(default=1, gt=0)  # multi_turn: prompt_tokens of new user text per turn
    kv_pool_sequences: int | None = Field(default=None, gt=0)  # kv_boundary: pool sized for this many sequences
    # kv_quant: one engine start per KV dtype, the same prompts on each, greedy, with the top-k log-probabilities
    # of every generated token (docs/kv-quant.md). kv_dtypes: "baseline" (the engine's own 16-bit cache),
    # "quantised" (every KV dtype below 16 bits the engine takes) or dtype names (`kvbench run --kv-dtypes`
    # overrides them); prompt_text: "synthetic" (seeded plain-word tokens) or "kjv" (natural text: the King
    # James Bible from Debian's bible-kjv-text, read with teacher forcing where the engine returns prompt
    # log-probabilities)
    kv_dtypes: list[str] = Field(default_factory=lambda: ["baseline", "quantised"])
    top_logprobs: int = Field(default=20, ge=0)
    prompt_text: Literal["synthetic", "kjv"] = "synthetic"
    # speculation: the prompt kinds, each a cell of its own (docs/speculation.md): "copy" (a seeded passage
    # given twice: the model goes on copying it, which n-gram lookup predicts) and "free" (seeded plain words:
    # what follows is the model's own, which only a draft model can guess)
    prompt_kinds: list[Literal["copy", "free"]] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _load_section(cls, data):
        """The load as its section: from ``[load]``, or from a flat file's top-level load keys."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        flat = {k: data.pop(k) for k in load_profiles.FLAT_DEFAULTS if k in data}
        if "load" in data and flat:
            raise ValueError(f"give the load once: a [load] section or the flat keys ({', '.join(flat)}), not both")
        if "load" not in data:
            data["load"] = load_profiles.section_from_flat(flat)
        return data

    @field_validator("load", mode="before")
    @classmethod
    def _read_by_its_profile(cls, section):
        return load_profiles.read_section(section) if isinstance(section, dict) else section

    @model_serializer(mode="wrap")
    def _flat_load(self, handler):
        """The flat form: the load's keys in its place, every one present (run.json's record)."""
        out = {}
        for key, value in handler(self).items():
            if key == "load":
                out.update(load_profiles.flat(self.load))
            else:
                out[key] = value
        return out

    def model_copy(self, *, update=None, deep: bool = False):
        """A copy with ``update`` applied and validated; flat load keys update the load (``{"rounds": 2}``)."""
        if not update:
            return super().model_copy(deep=deep)
        data = self.model_dump()
        if "load" in update:
            data = {k: v for k, v in data.items() if k not in load_profiles.FLAT_DEFAULTS}
        return type(self).model_validate(data | dict(update))

    @model_validator(mode="before")
    @classmethod
    def _no_true_as_a_number(cls, data):
        return refuse_true_as_a_number(cls, data)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name):
        # the name goes into the default run id, a folder name: it must not be a path
        return check_plain_name(name, "workload name")

    @field_validator("prompt_tokens")
    @classmethod
    def _positive_lengths(cls, lengths):
        for n in lengths:
            if n != "max" and n <= 0:
                raise ValueError(f"prompt length {n} must be a positive integer or \"max\"")
        return lengths

    @model_validator(mode="after")
    def _no_length_twice(self):
        """A length given twice would be two cells with one id (their rows mixed); the load's profile
        refuses a level or rate given twice."""
        twice = sorted({v for v in self.prompt_tokens if self.prompt_tokens.count(v) > 1}, key=str)
        if twice:
            raise ValueError(f"prompt_tokens lists {', '.join(map(str, twice))} more than once: give each once")
        return self

    @model_validator(mode="after")
    def _consistent(self):
        if self.family == "shared_prefix" and not self.shared_prefix_tokens:
            raise ValueError("family \"shared_prefix\" needs shared_prefix_tokens > 0")
        if self.family != "shared_prefix" and self.shared_prefix_tokens:
            raise ValueError("shared_prefix_tokens only applies to family \"shared_prefix\"")
        if self.family == "multi_turn" and self.turns < 2:
            raise ValueError("family \"multi_turn\" needs turns >= 2")
        if self.family == "kv_quant" and "baseline" not in self.kv_dtypes:
            raise ValueError("family \"kv_quant\" compares with each engine's 16-bit cache: kv_dtypes needs \"baseline\"")
        if self.family != "kv_quant" and self.prompt_text != "synthetic":
            raise ValueError("prompt_text applies to family \"kv_quant\" only")
        if (self.family == "speculation") != bool(self.prompt_kinds):
            raise ValueError("family \"speculation\" needs prompt_kinds (copy, free), and only it takes them")
        if len(set(self.prompt_kinds)) != len(self.prompt_kinds):
            raise ValueError(f"prompt_kinds {self.prompt_kinds}: each kind once")
        if self.family == "kv_boundary" and not self.kv_pool_sequences:
            raise ValueError("family \"kv_boundary\" needs kv_pool_sequences (the pool is sized for that many)")
        return self

    @model_validator(mode="after")
    def _within_bounds(self):
        """Counts within :data:`MAX_REPEATS` and its siblings: one line naming the key, never a plan that
        exhausts memory or never ends."""
        if self.repeats > MAX_REPEATS:
            raise ValueError(f"repeats = {self.repeats:,}: at most {MAX_REPEATS:,}")
        if self.warmup_requests > MAX_WARMUP_REQUESTS:
            raise ValueError(f"warmup_requests = {self.warmup_requests:,}: at most {MAX_WARMUP_REQUESTS:,}")
        try:
            points = self.load.points()
            in_flight = self.load.max_in_flight()
            per_cell = max((self.load.requests_per_cell(p) for p in points), default=0)
        except OverflowError:  # a rate times a duration beyond any float
            raise ValueError("the load's request_rates x duration_s is beyond any count of requests") from None
        if per_cell > MAX_REQUESTS_PER_CELL:
            raise ValueError(f"load: a cell of {per_cell:,} requests (requests, or concurrency x rounds, or rate "
                             f"x duration_s): at most {MAX_REQUESTS_PER_CELL:,}")
        if in_flight > MAX_IN_FLIGHT:
            raise ValueError(f"load: {in_flight:,} requests in flight at once (concurrency, or max_concurrency, or "
                             f"4 x the rate): at most {MAX_IN_FLIGHT:,}")
        check_cells(self, self.repeats)
        return self

    def prompt_lengths(self, max_context: int) -> list[int]:
        """Resolve "max" against the model's context limit; drop rungs that would not fit (a multi-turn
        rung must fit all its turns)."""
        limit = max_context - self.output_tokens
        if self.family == "multi_turn":  # the last turn holds every earlier turn and reply
            limit = (max_context - self.output_tokens * self.turns) // self.turns
        resolved = sorted({limit if n == "max" else int(n) for n in self.prompt_tokens})
        return [n for n in resolved if self.shared_prefix_tokens < n <= limit] if self.shared_prefix_tokens \
            else [n for n in resolved if n <= limit]

    def longest_prompt(self, length: int) -> int:
        """Tokens of the longest prompt a rung sends (the last turn of a multi-turn rung)."""
        return self.prompt_tokens_sent(length, self.turns if self.family == "multi_turn" else 0)

    def kinds(self) -> list[str]:
        """The prompt kinds of a cell ([""]: one kind, every family but speculation's)."""
        return list(self.prompt_kinds) or [""]

    def prompt_tokens_sent(self, length: int, turn: int = 0) -> int:
        """Tokens a rung's prompt has (turn ``turn`` of a multi-turn rung holds the earlier turns and replies)."""
        return turn * length + (turn - 1) * self.output_tokens if turn else length


class WorkloadError(ValueError):
    pass


def cells_per_start(workload: Workload, repeats: int) -> int:
    """Cells one engine start runs before any a load profile adds: lengths x points x turns (or prompt kinds)
    x repeats."""
    turns = workload.turns if workload.family == "multi_turn" else len(workload.kinds())
    return len(workload.prompt_tokens) * len(workload.load.points()) * turns * repeats


def check_cells(workload: Workload, repeats: int) -> None:
    """ValueError (one line) where one engine start would run more than :data:`MAX_CELLS` cells."""
    n = cells_per_start(workload, repeats)
    if n > MAX_CELLS:
        raise ValueError(f"{len(workload.prompt_tokens)} prompt lengths x {len(workload.load.points())} load points"
                         + (f" x {workload.turns} turns" if workload.family == "multi_turn" else "")
                         + f" x {repeats:,} repeats = {n:,} cells per engine start: at most {MAX_CELLS:,}")


def available() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))


def load(name_or_path: str) -> Workload:
    """Load a workload by name (a file in workloads/) or by path to a TOML file."""
    path = Path(name_or_path)
    if (path.suffix or len(path.parts) > 1) and not path.exists():  # a path, not a name
        raise WorkloadError(f"no such file: {name_or_path} (the workload)")
    if not path.suffix:
        path = WORKLOAD_DIR / f"{name_or_path}.toml"
    if not path.exists():
        raise WorkloadError(f"unknown workload {name_or_path!r}; known: {', '.join(available())} "
                            "(or give a path to a .toml file)")
    try:  # a regular file of at most 4 MiB and 64 levels (a FIFO or /dev/zero: one line, no hang)
        return Workload.model_validate(bounded.read_toml(path, what="workload"))
    except bounded.InputError as exc:
        raise WorkloadError(str(exc)) from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'workload'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in exc.errors())
        raise WorkloadError(f"{path}: {problems}") from None
