"""A sweep of open-loop rates up to saturation: a closed loop at ``concurrency`` first finds the request
rate the engine sustains, then ``steps`` rates evenly spaced up to it (4 steps: 25 %, 50 %, 75 %, 100 %)
run with the ``arrivals`` profile, at most ``concurrency`` in flight. The profile yields its next points
once the closed loop has run (:meth:`Sweep.points_after`); it drives no point itself.

Workload section: ``[load] profile = "sweep"``, ``arrivals = "poisson"`` (an open-loop profile),
``concurrency = N``, ``steps``, ``requests`` per cell, ``duration_s``.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from .concurrent import Concurrent
from .open_loop import OpenLoop
from .profile import LoadPoint, LoadProfile, profile_class, registered


class Sweep(LoadProfile):
    summary: ClassVar[str] = "a closed loop finds the saturation rate, then open-loop rates up to it"
    yields_others: ClassVar[bool] = True

    profile: Literal["sweep"] = "sweep"
    arrivals: str  # the open-loop profile of the rates
    concurrency: int = Field(gt=0)  # the closed loop that finds the rate, and the rates' cap on requests in flight
    steps: int = Field(default=4, gt=0)
    # the closed loop has no rate to size a duration by: every cell sends this many
    requests: int = Field(gt=0)

    @field_validator("arrivals")
    @classmethod
    def _an_open_loop(cls, name):
        arrivals = profile_class(name, "arrivals")
        if not issubclass(arrivals, OpenLoop):
            opens = [n for n, c in registered().items() if issubclass(c, OpenLoop)]
            raise ValueError(f"arrivals {name!r} is not an open-loop profile ({', '.join(opens)})")
        return name

    def finder(self) -> LoadPoint:
        return LoadPoint(Concurrent.name, self.concurrency)

    def points(self) -> list[LoadPoint]:
        return [self.finder()]  # the rates follow once it has run

    def points_after(self, ran: LoadPoint, achieved_rate: float) -> list[LoadPoint]:
        if ran != self.finder() or not achieved_rate or achieved_rate <= 0:
            return []
        return [LoadPoint(self.arrivals, self.concurrency, round(achieved_rate * i / self.steps, 4))
                for i in range(1, self.steps + 1)]

    def points_found_later(self) -> int:
        return self.steps

    def max_in_flight(self) -> int:
        return self.concurrency

    def requests_per_cell(self, point: LoadPoint) -> int:
        return self.requests

    def drivers(self) -> list[type[LoadProfile]]:
        return [Concurrent, profile_class(self.arrivals)]

    @classmethod
    def from_flat(cls, flat: dict) -> dict | None:
        """A flat workload's ``request_rates = "saturation"`` (with ``load_profile`` naming the arrivals)."""
        if flat.get("request_rates") != "saturation":
            return None
        caps = flat.get("concurrency", [])
        if not caps:
            raise ValueError("request_rates = \"saturation\" needs concurrency = [N] for the closed loop "
                             "that finds the saturation rate (N is also the cap)")
        if len(caps) > 1:
            raise ValueError("an open loop takes one concurrency cap: concurrency = [N] (or leave it out)")
        if "requests" not in flat:
            raise ValueError("request_rates = \"saturation\" needs requests = N (per cell)")
        section = {"profile": cls.name, "arrivals": flat.get("load_profile"), "concurrency": caps[0],
                   "steps": flat.get("saturation_steps", 4)}
        # rounds never applied to a sweep: read, and ignored as it was
        return section | {k: flat[k] for k in ("requests", "duration_s") if k in flat}

    def flat(self) -> dict:
        return {"load_profile": self.arrivals, "concurrency": [self.concurrency], "request_rates": "saturation",
                "saturation_steps": self.steps, "requests": self.requests, "duration_s": self.duration_s}

