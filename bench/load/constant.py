"""Open loop with evenly spaced arrivals: exactly 1/rate apart."""
from __future__ import annotations

import numpy as np

from kvbench.backends.base import Backend

from .common import LoadPoint, LoadResult, LoadSettings
from .open_loop import send_on_schedule


def arrival_offsets(n: int, request_rate: float) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests is due; the first at 0."""
    return np.arange(n) / request_rate


async def run(backend: Backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
    return await send_on_schedule(backend, prompts, arrival_offsets(len(prompts), point.request_rate), point, settings)
