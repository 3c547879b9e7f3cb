"""Closed loop: ``concurrency`` workers, each sends its next request as soon as its last one ends."""
from __future__ import annotations

import asyncio
import time

from kvbench.backends.base import Backend
from kvbench.backends.streaming import open_client

from .interrupt import stopping
from .common import InFlight, LoadPoint, LoadResult, LoadSettings, send_one


async def run(backend: Backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
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
