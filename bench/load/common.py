"""What every load profile shares: the load point a cell runs at, sending one request, and the result."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from backends.base import Backend, RequestResult
from backends.streaming import TRANSPORT_ERRORS

Profile = Literal["concurrent", "poisson", "constant"]


@dataclass(frozen=True)
class LoadPoint:
    """How hard a cell pushes: a closed loop of ``concurrency`` workers, or an open loop of
    ``request_rate`` requests/s (Poisson or evenly spaced) with at most ``concurrency`` in flight
    (None: unbounded)."""

    profile: Profile = "concurrent"
    concurrency: int | None = 1
    request_rate: float | None = None

    def __post_init__(self):
        if self.profile == "concurrent" and not (self.concurrency and self.concurrency > 0):
            raise ValueError("a closed loop needs concurrency >= 1")
        if self.profile != "concurrent" and not (self.request_rate and self.request_rate > 0):
            raise ValueError(f"a {self.profile} load needs request_rate > 0")

    @property
    def slug(self) -> str:
        """Short, file-name safe: c4, poisson-r2.5, constant-r1-cap8."""
        if self.profile == "concurrent":
            return f"c{self.concurrency}"
        rate = f"{self.request_rate:g}".replace(".", "_")
        return f"{self.profile}-r{rate}" + (f"-cap{self.concurrency}" if self.concurrency else "")


@dataclass
class LoadResult:
    results: list[RequestResult]
    t_start: float  # perf_counter when the load began
    t_end: float
    offered_request_rate: float | None = None  # open loop: the rate asked for
    max_in_flight: int = 0  # most requests outstanding at once, as the client saw it
    send_lags: list[float] = field(default_factory=list)  # open loop: t_sent - t_scheduled per request

    @property
    def achieved_request_rate(self) -> float | None:
        """Requests sent per second, from the first send to the last (what the engine was offered in fact)."""
        sent = sorted(r.t_sent for r in self.results)
        if len(sent) < 2 or sent[-1] <= sent[0]:
            return None
        return (len(sent) - 1) / (sent[-1] - sent[0])


class InFlight:
    """Counts outstanding requests and remembers the most at once."""

    def __init__(self):
        self.now = self.peak = 0

    def __enter__(self):
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        self.now -= 1


async def send_one(backend: Backend, client, prompt, timeout_s: float) -> RequestResult:
    """One request; a timeout, transport error or malformed stream becomes a failed result."""
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(backend.stream(client, prompt), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        error = f"timed out after {timeout_s:.0f} s"
    except TRANSPORT_ERRORS as exc:
        error = f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # malformed stream
        error = f"bad response: {exc}"
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, t0)
    result.error, result.t_done = error, time.perf_counter()
    return result


def run_async(coro):
    """Run a load coroutine to completion on a fresh event loop (uvloop's when installed: less client
    overhead per streamed token) and return its result.

    The result is handed out through a box rather than as the main task's result: at the end of
    ``asyncio.run`` Python 3.11 formats the main task's repr (in ``signal.getsignal``), which for a load's
    results (every chunk time of every request) cost 0.4 s per thousand requests of 256 tokens."""
    box = []

    async def main():
        box.append(await coro)

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
    return box[0]
