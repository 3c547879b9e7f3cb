"""What every load profile is, and the load point a cell runs at.

A profile is a pydantic model of its own settings (a workload file's ``[load]`` section, ``profile = NAME``
picking the class) that says which load points the workload's cells run at, and, as a class, how one
point's requests reach the engine: its arrivals, its run, and whether it can be split over several load
processes. A :class:`LoadPoint` names the profile that drives it; every profile class registers its name
when it is defined (:mod:`.registry` imports them all).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

_REGISTERED: dict[str, type[LoadProfile]] = {}


def profile_class(name: str, key: str = "load profile") -> type[LoadProfile]:
    """The profile class named ``name``; a ValueError naming the allowed ones otherwise (``key``: how the
    name was given, for the message)."""
    try:
        return _REGISTERED[name]
    except (KeyError, TypeError):
        raise ValueError(f"{key} {name!r}: unknown load profile; allowed: {', '.join(_REGISTERED)}") from None


def registered() -> dict[str, type[LoadProfile]]:
    return dict(_REGISTERED)


@dataclass(frozen=True)
class LoadPoint:
    """How hard a cell pushes, and the profile that drives it: a closed loop of ``concurrency`` workers, or
    an open loop of ``request_rate`` requests/s with at most ``concurrency`` in flight (None: unbounded)."""

    profile: str  # the driving profile's name, recorded in every row of the cell
    concurrency: int | None = 1
    request_rate: float | None = None

    def __post_init__(self):
        self.driver.check_point(self)

    @property
    def driver(self) -> type[LoadProfile]:
        return profile_class(self.profile)

    @property
    def slug(self) -> str:
        """Short, file-name safe: c4, poisson-r2.5, constant-r1-cap8."""
        return self.driver.slug(self)


# a share of one cell for one load process: its prompts, its point, its send times (None: its own arrivals)
Share = tuple[list, LoadPoint, Any]


def refuse_true_as_a_number(model: type[BaseModel], data):
    """``data`` for ``model``, refused where a non-bool field holds true or false: TOML's true/false are no
    lengths, counts or rates (pydantic would read them as 1 and 0). For a ``mode="before"`` validator."""
    if not isinstance(data, dict):
        return data
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None or "bool" in str(field.annotation):
            continue
        if any(isinstance(v, bool) for v in (value if isinstance(value, list) else [value])):
            raise ValueError(f"{key} = {value!r}: true and false are not numbers".replace("True", "true")
                             .replace("False", "false"))
    return data


class LoadProfile(BaseModel):
    """A workload's load. Subclasses declare ``profile: Literal[NAME] = NAME`` (the section's key and the
    class's registered name) and their settings, and override the hooks below that apply to them."""

    # nan and inf are floats to TOML and pydantic, but no duration or rate
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # whether a point of this profile runs correctly from several load processes (bench/load/workers.py)
    splits_over_workers: ClassVar[bool] = False
    # yields points of other profiles (a sweep): asked first when a flat workload file is read
    yields_others: ClassVar[bool] = False

    requests: int | None = Field(default=None, gt=0)  # per cell
    duration_s: float | None = Field(default=None, gt=0)  # no request starts after this long (in-flight ones finish)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs):
        super().__pydantic_init_subclass__(**kwargs)
        field = cls.model_fields.get("profile")
        # only a class that declares its own name: a subclass that keeps its parent's does not replace it
        if "profile" in cls.__dict__.get("__annotations__", {}) and isinstance(field.default, str):
            cls.name = field.default
            _REGISTERED[cls.name] = cls

    @model_validator(mode="before")
    @classmethod
    def _no_true_as_a_number(cls, data):
        return refuse_true_as_a_number(cls, data)

    # --- the points a workload's cells run at -----------------------------------------------------------

    def points(self) -> list[LoadPoint]:
        """The points known before anything runs, in the order their cells run."""
        raise NotImplementedError

    def points_after(self, ran: LoadPoint, achieved_rate: float) -> list[LoadPoint]:
        """The points that follow a cell run at ``ran`` that achieved ``achieved_rate`` requests/s (a
        profile that finds its points by measuring); none by default."""
        return []

    def points_found_later(self) -> int:
        """How many points per prompt length :meth:`points_after` adds (for the progress bar)."""
        return 0

    def max_in_flight(self) -> int:
        """The most requests a cell can have outstanding at once: the engine is started with room for it."""
        raise NotImplementedError

    def requests_per_cell(self, point: LoadPoint) -> int:
        """Prompts a cell at ``point`` needs."""
        raise NotImplementedError

    def drivers(self) -> list[type[LoadProfile]]:
        """The profiles that drive this profile's points."""
        return [type(self)]

    def check_workers(self, workers: int) -> None:
        """Refuse, in one line, ``workers`` load processes where a point of this load cannot be split."""
        if workers <= 1:
            return
        for driver in self.drivers():
            if not driver.splits_over_workers:
                raise ValueError(f"--load-workers {workers}: load profile {driver.name!r} runs from one load "
                                 "process only; use --load-workers 1")

    # --- the flat form (workload files before [load]; run.json's record) ---------------------------------

    @classmethod
    def from_flat(cls, flat: dict) -> dict | None:
        """This profile's section from a flat workload's load keys (those given, defaults left out), or
        None when they name another profile."""
        return None

    def flat(self) -> dict:
        """This load as a flat workload's keys (the form run.json records)."""
        raise NotImplementedError

    # --- driving one point -----------------------------------------------------------------------------

    @classmethod
    def check_point(cls, point: LoadPoint) -> None:
        raise ValueError(f"load profile {cls.name!r} yields other profiles' points; it drives none itself")

    @classmethod
    def slug(cls, point: LoadPoint) -> str:
        raise NotImplementedError

    @classmethod
    def label(cls, concurrency: int | None, request_rate: float | None) -> str:
        """How a cell's load is written for people (console, reports, compare)."""
        raise NotImplementedError

    @classmethod
    async def run(cls, backend, prompts: Sequence, point: LoadPoint, settings):
        """Drive ``prompts`` through ``backend`` at ``point``, from this process; a LoadResult."""
        raise NotImplementedError

    @classmethod
    def shares(cls, prompts: Sequence, point: LoadPoint, seed: int, workers: int) -> list[Share]:
        """The cell split over at most ``workers`` load processes (only where :attr:`splits_over_workers`)."""
        raise ValueError(f"load profile {cls.name!r} runs from one load process only; use --load-workers 1")
