"""Open loop with Poisson arrivals: exponential gaps with mean 1/rate, seeded so that every engine and
every run gets the same schedule."""
from __future__ import annotations

import numpy as np

from kvbench.backends.base import Backend

from .common import LoadPoint, LoadResult, LoadSettings
from .open_loop import send_on_schedule


def arrival_offsets(n: int, request_rate: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests is due; the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


async def run(backend: Backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
    offsets = arrival_offsets(len(prompts), point.request_rate, settings.seed)
    return await send_on_schedule(backend, prompts, offsets, point, settings)
