"""Closed loop: ``concurrency`` workers, each sends its next request as soon as its last one ends."""
from __future__ import annotations

import asyncio
import time

from backends.base import Backend
from backends.streaming import open_client

from .common import InFlight, LoadResult, send_one


async def run(backend: Backend, prompts: list, concurrency: int, timeout_s: float,
              duration_s: float | None = None) -> LoadResult:
    """Send ``prompts`` in order; with ``duration_s``, no request starts after that many seconds (the
    ones in flight finish)."""
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []
    in_flight = InFlight()
    t_start = time.perf_counter()
    deadline = t_start + duration_s if duration_s else None
    async with open_client(concurrency, timeout_s) as client:
        async def worker():
            while not (deadline and time.perf_counter() >= deadline):
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                with in_flight:
                    result = await send_one(backend, client, prompt, timeout_s)
                results.append(result)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(results, t_start, time.perf_counter(), max_in_flight=in_flight.peak)
