"""Open loop: requests leave on a schedule (Poisson or evenly spaced arrivals at ``request_rate``/s),
whether or not earlier ones have finished. With a concurrency cap, a request due while the cap is full
waits; its lag behind the schedule is recorded, so coordinated omission shows instead of hiding in a
lower achieved rate."""
from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np

from backends.base import Backend
from backends.streaming import open_client

from .common import InFlight, LoadResult, send_one


def schedule_seed(workload_seed: int, prompt_tokens: int, repeat: int, load_slug: str) -> int:
    """The arrival schedule's seed for one cell: the same in every process, so every engine and every run
    of a workload gets the same Poisson schedule (``hash()`` of a str would change with PYTHONHASHSEED)."""
    return zlib.crc32(f"{workload_seed}:{prompt_tokens}:{repeat}:{load_slug}".encode())


def arrival_offsets(n: int, request_rate: float, kind: str, seed: int) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests is due. Poisson: exponential gaps with
    mean 1/rate (seeded, so every engine gets the same schedule); constant: exactly 1/rate apart. The
    first request is due at 0 in both."""
    if kind == "constant":
        return np.arange(n) / request_rate
    if kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
        return np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    raise ValueError(f"arrival kind {kind!r}: allowed are poisson, constant")


async def run(backend: Backend, prompts: list, request_rate: float, kind: str, timeout_s: float,
              max_concurrency: int | None = None, seed: int = 0, duration_s: float | None = None) -> LoadResult:
    offsets = arrival_offsets(len(prompts), request_rate, kind, seed)
    if duration_s:
        keep = offsets < duration_s
        offsets, prompts = offsets[keep], [p for p, k in zip(prompts, keep) if k]
    cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = InFlight()
    results, lags = [], []
    async with open_client(max_concurrency or len(prompts) or 1, timeout_s) as client:
        t_start = time.perf_counter()

        async def fire(prompt, due: float):
            if cap:
                await cap.acquire()
            try:
                lags.append(time.perf_counter() - due)
                with in_flight:
                    result = await send_one(backend, client, prompt, timeout_s)
                result.t_scheduled = due
                results.append(result)
            finally:
                if cap:
                    cap.release()

        tasks = []
        for prompt, offset in zip(prompts, offsets):
            due = t_start + float(offset)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(prompt, due)))
        await asyncio.gather(*tasks)
    return LoadResult(results, t_start, time.perf_counter(), offered_request_rate=request_rate,
                      max_in_flight=in_flight.peak, send_lags=lags)
