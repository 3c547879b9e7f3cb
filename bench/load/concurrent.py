"""Closed loop: ``concurrency`` workers, each sends its next request as soon as its last one ends.

Workload section: ``[load] profile = "concurrent"``, ``concurrency = [levels]`` (one point each),
``rounds`` (requests per worker, unless ``requests`` per cell is given), ``duration_s``.
"""
from __future__ import annotations

import asyncio
import time
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from kvbench.backends.base import Backend
from kvbench.backends.streaming import open_client

from .common import InFlight, LoadResult, LoadSettings, send_one
from .interrupt import stopping
from .profile import LoadPoint, LoadProfile, Share
from .split import deal, split_count


class Concurrent(LoadProfile):
    summary: ClassVar[str] = "closed loop: N workers, each sends when its last request ends"
    splits_over_workers: ClassVar[bool] = True

    profile: Literal["concurrent"] = "concurrent"
    concurrency: list[int] = Field(min_length=1)  # one point per level
    rounds: int = Field(default=1, gt=0)  # requests per worker, when `requests` per cell is not given

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, levels):
        if any(c <= 0 for c in levels):
            raise ValueError("every concurrency level must be >= 1")
        twice = sorted({c for c in levels if levels.count(c) > 1})
        if twice:  # two cells with one id (their rows mixed)
            raise ValueError(f"concurrency lists {', '.join(map(str, twice))} more than once: give each once")
        return levels

    def points(self) -> list[LoadPoint]:
        return [LoadPoint(self.name, c) for c in self.concurrency]

    def max_in_flight(self) -> int:
        return max(self.concurrency)

    def requests_per_cell(self, point: LoadPoint) -> int:
        return self.requests if self.requests is not None else (point.concurrency or 1) * self.rounds

    @classmethod
    def from_flat(cls, flat: dict) -> dict | None:
        if flat.get("load_profile") != cls.name:
            return None
        if "request_rates" in flat:
            raise ValueError("request_rates only apply to an open-loop load_profile")
        if "concurrency" not in flat:
            raise ValueError(f"load_profile {cls.name!r} needs concurrency = [levels, ...]")
        return {"profile": cls.name, **{k: v for k, v in flat.items() if k != "load_profile"}}

    def flat(self) -> dict:
        return {"load_profile": self.name, "concurrency": list(self.concurrency), "requests": self.requests,
                "rounds": self.rounds, "duration_s": self.duration_s}

    @classmethod
    def check_point(cls, point: LoadPoint) -> None:
        if not (point.concurrency and point.concurrency > 0):
            raise ValueError("a closed loop needs concurrency >= 1")
        if point.request_rate is not None:
            raise ValueError("a closed loop sends when a request ends: it takes no request_rate")

    @classmethod
    def slug(cls, point: LoadPoint) -> str:
        return f"c{point.concurrency}"

    @classmethod
    def label(cls, concurrency: int | None, request_rate: float | None) -> str:
        return f"x{concurrency}"

    @classmethod
    async def run(cls, backend: Backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
        """Send ``prompts`` in order; with ``settings.duration_s``, no request starts after that many seconds
        (the ones in flight finish)."""
        concurrency, timeout_s = point.concurrency, settings.timeout_s
        pending = iter(prompts)  # each prompt built when a worker takes it (a CellPromptList builds on demand)
        results = []
        in_flight = InFlight()
        t_start = time.perf_counter()
        deadline = t_start + settings.duration_s if settings.duration_s else None
        async with open_client(concurrency, timeout_s) as client:
            async def worker():
                # a stop signal ends the loop here too: a cancellation swallowed by wait_for (see .interrupt)
                while not (stopping() or deadline and time.perf_counter() >= deadline):
                    prompt = next(pending, None)
                    if prompt is None:
                        return
                    with in_flight:
                        result = await send_one(backend, client, prompt, settings)
                    results.append(result)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return LoadResult(results, t_start, time.perf_counter(), max_in_flight=in_flight.peak)

    @classmethod
    def shares(cls, prompts: list, point: LoadPoint, seed: int, workers: int) -> list[Share]:
        """The concurrency split over the workers (c=5 on 2: 3 and 2), the prompts dealt out in the same
        proportion, in order; each worker runs this profile's closed loop over its share."""
        n = max(1, min(workers, point.concurrency, len(prompts)))
        conc = split_count(point.concurrency, n)
        return [(share, LoadPoint(point.profile, conc[w]), None) for w, share in enumerate(deal(prompts, conc))]


ONE_AT_A_TIME = LoadPoint(Concurrent.name, 1)  # requests one after another (warm-up, probes)

