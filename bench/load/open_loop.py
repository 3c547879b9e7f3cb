"""Open loop: requests leave on a schedule, whether or not earlier ones have finished. With a concurrency
cap, a request due while the cap is full waits; its lag behind the schedule is recorded, so coordinated
omission shows instead of hiding in a lower achieved rate. The arrival profiles (:mod:`.poisson`,
:mod:`.constant`) give the schedule (:meth:`OpenLoop.arrival_offsets`); this module sends on it.

Workload section: ``[load] profile = "poisson"`` (or another arrival profile), ``request_rates = [...]``
(requests/s, one point each), ``max_concurrency`` (the cap on requests in flight; leave it out for none),
and ``requests`` per cell or ``duration_s``.
"""
from __future__ import annotations

import asyncio
import math
import time
import zlib
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field, field_validator, model_validator

from kvbench.backends.base import Backend
from kvbench.backends.streaming import open_client

from .common import InFlight, LoadResult, LoadSettings, send_one
from .interrupt import stopping
from .profile import LoadPoint, LoadProfile, Share
from .split import split_count

if TYPE_CHECKING:  # numpy is loaded where a schedule is sent, not by a workload's check
    import numpy as np


class OpenLoop(LoadProfile):
    """What the arrival profiles share; each declares its ``profile`` name and :meth:`arrival_offsets`."""

    splits_over_workers: ClassVar[bool] = True

    request_rates: list[float] = Field(min_length=1)  # requests/s, one point each
    max_concurrency: int | None = Field(default=None, gt=0)  # at most this many in flight (None: no cap)

    @field_validator("request_rates", mode="before")
    @classmethod
    def _finite_rates(cls, rates):
        if isinstance(rates, list):
            for r in rates:
                if isinstance(r, (int, float)) and not (math.isfinite(r) and r > 0):
                    raise ValueError(f"request rate {r} must be a finite number of requests/s above 0")
        return rates

    @field_validator("request_rates")
    @classmethod
    def _each_rate_once(cls, rates):
        twice = sorted({r for r in rates if rates.count(r) > 1})
        if twice:  # two cells with one id (their rows mixed)
            raise ValueError(f"request_rates lists {', '.join(map(str, twice))} more than once: give each once")
        return rates

    @model_validator(mode="after")
    def _bounded(self):
        if self.requests is None and self.duration_s is None:
            raise ValueError("an open loop needs requests = N (per cell) or duration_s")
        return self

    @classmethod
    def arrival_offsets(cls, n: int, request_rate: float, seed: int) -> np.ndarray:
        """Seconds after the start at which each of ``n`` requests is due; the first at 0."""
        raise NotImplementedError

    def points(self) -> list[LoadPoint]:
        return [LoadPoint(self.name, self.max_concurrency, r) for r in self.request_rates]

    def max_in_flight(self) -> int:
        return self.max_concurrency or max(1, int(max(self.request_rates) * 4))

    def requests_per_cell(self, point: LoadPoint) -> int:
        """``requests``; else enough for ``duration_s`` at the rate (Poisson arrivals can run ahead of the
        mean, hence the margin; the schedule drops what falls after the duration)."""
        if self.requests is not None:
            return self.requests
        return int(math.ceil(point.request_rate * self.duration_s * 1.5)) + 10

    @classmethod
    def from_flat(cls, flat: dict) -> dict | None:
        if flat.get("load_profile") != cls.name:
            return None
        if "request_rates" not in flat:
            raise ValueError(f"load_profile {cls.name!r} needs request_rates = [...] or \"saturation\"")
        caps = flat.get("concurrency", [])
        if not isinstance(caps, list) or len(caps) > 1:
            raise ValueError("an open loop takes one concurrency cap: concurrency = [N] (or leave it out)")
        section = {"profile": cls.name, "request_rates": flat["request_rates"],
                   "max_concurrency": caps[0] if caps else None}
        # rounds and saturation_steps never applied to a list of rates: read, and ignored as they were
        return section | {k: flat[k] for k in ("requests", "duration_s") if k in flat}

    def flat(self) -> dict:
        caps = [] if self.max_concurrency is None else [self.max_concurrency]
        return {"load_profile": self.name, "concurrency": caps, "request_rates": list(self.request_rates),
                "requests": self.requests, "duration_s": self.duration_s}

    @classmethod
    def check_point(cls, point: LoadPoint) -> None:
        if not (point.request_rate and point.request_rate > 0):
            raise ValueError(f"a {cls.name} load needs request_rate > 0")

    @classmethod
    def slug(cls, point: LoadPoint) -> str:
        rate = f"{point.request_rate:g}".replace(".", "_")
        return f"{cls.name}-r{rate}" + (f"-cap{point.concurrency}" if point.concurrency else "")

    @classmethod
    def label(cls, concurrency: int | None, request_rate: float | None) -> str:
        """``poisson 2.5/s, <=8``: an open loop at 2.5 requests/s capped at 8 in flight."""
        if request_rate is None:
            return f"x{concurrency}"
        cap = "" if concurrency is None else f", <={int(concurrency)}"
        return f"{cls.name} {request_rate:g}/s{cap}"

    @classmethod
    async def run(cls, backend: Backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
        offsets = cls.arrival_offsets(len(prompts), point.request_rate, settings.seed)
        return await send_on_schedule(backend, prompts, offsets, point, settings)

    @classmethod
    def shares(cls, prompts: list, point: LoadPoint, seed: int, workers: int) -> list[Share]:
        """The schedule made once for the whole cell (this profile's arrivals, the cell's seed) and dealt
        out round-robin, every request keeping its send time; a cap split like a closed loop's concurrency."""
        cap = point.concurrency
        n = max(1, min(workers, len(prompts), cap or workers))
        offsets = cls.arrival_offsets(len(prompts), point.request_rate, seed)
        caps = split_count(cap, n) if cap else [None] * n
        shares = [list(range(w, len(prompts), n)) for w in range(n)]
        return [([prompts[i] for i in idx], LoadPoint(point.profile, caps[w], point.request_rate), offsets[idx])
                for w, idx in enumerate(shares)]


def schedule_seed(workload_seed: int, prompt_tokens: int, repeat: int, load_slug: str) -> int:
    """The arrival schedule's seed for one cell: the same in every process, so every engine and every run
    of a workload gets the same schedule (``hash()`` of a str would change with PYTHONHASHSEED)."""
    return zlib.crc32(f"{workload_seed}:{prompt_tokens}:{repeat}:{load_slug}".encode())


async def send_on_schedule(backend: Backend, prompts: list, offsets: np.ndarray, point: LoadPoint,
                           settings: LoadSettings) -> LoadResult:
    """Send prompt i ``offsets[i]`` seconds after the start, at most ``point.concurrency`` in flight (None:
    no cap); with ``settings.duration_s``, requests due after it are dropped."""
    offsets = offsets[:len(prompts)]
    due_at = range(len(offsets))
    if settings.duration_s:  # indices, not a list of prompts: a CellPromptList builds each one when taken
        import numpy as np

        due_at = np.flatnonzero(offsets < settings.duration_s)
    max_concurrency, timeout_s = point.concurrency, settings.timeout_s
    cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = InFlight()
    results, lags = [], []
    async with open_client(max_concurrency or len(due_at) or 1, timeout_s) as client:
        t_start = time.perf_counter()

        async def fire(prompt, due: float):
            if cap:
                await cap.acquire()
            try:
                if stopping():  # due while the cap was full: not sent once the load is stopping
                    return
                lags.append(time.perf_counter() - due)
                with in_flight:
                    result = await send_one(backend, client, prompt, settings)
                result.t_scheduled = due
                results.append(result)
            finally:
                if cap:
                    cap.release()

        tasks = []
        for i in due_at:
            prompt, offset = prompts[int(i)], offsets[int(i)]
            if stopping():  # the cancellation may have been swallowed (see .interrupt)
                break
            due = t_start + float(offset)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(prompt, due)))
        await asyncio.gather(*tasks)
    return LoadResult(results, t_start, time.perf_counter(), offered_request_rate=point.request_rate,
                      max_in_flight=in_flight.peak, send_lags=lags)
