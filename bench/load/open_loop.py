"""Open loop: requests leave on a schedule, whether or not earlier ones have finished. With a concurrency
cap, a request due while the cap is full waits; its lag behind the schedule is recorded, so coordinated
omission shows instead of hiding in a lower achieved rate. The arrival profiles (:mod:`.poisson`,
:mod:`.constant`) give the schedule; this module sends on it."""
from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np

from kvbench.backends.base import Backend
from kvbench.backends.streaming import open_client

from .interrupt import stopping
from .common import InFlight, LoadPoint, LoadResult, LoadSettings, send_one


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
