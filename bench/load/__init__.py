"""Load profiles: one small module each, named in :mod:`.registry`. Every profile takes the backend, the
cell's prompts, its :class:`LoadPoint` and :class:`LoadSettings`, and returns a :class:`LoadResult`.

- :mod:`.concurrent`: closed loop, ``concurrency`` workers, each sends its next request when the last ends;
- :mod:`.poisson`, :mod:`.constant`: open loop at a request rate (:mod:`.open_loop` sends on the schedule);
- :mod:`.sweep`: which load points a workload asks for, including a sweep of rates up to saturation;
- :mod:`.workers`: any profile from several processes (``LoadSettings.workers`` > 1), results merged.
"""
from __future__ import annotations

import importlib

from .common import LoadPoint, LoadResult, LoadSettings, TimeoutStreak, frozen_heap, run_async
from .registry import PROFILES, profile_info

__all__ = ["PROFILES", "LoadPoint", "LoadResult", "LoadSettings", "TimeoutStreak", "frozen_heap", "run", "run_async"]


async def run(backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
    """Drive ``prompts`` through ``backend`` with the profile ``point`` names (from ``settings.workers``
    processes when more than one: :mod:`.workers`)."""
    if settings.workers > 1:
        from . import workers
        return await workers.run(backend, prompts, point, settings)
    module = importlib.import_module(f"{__name__}.{profile_info(point.profile).module}")
    return await module.run(backend, prompts, point, settings)
