"""Load profiles: one small module each, named in :mod:`.registry`. Every profile takes the backend, the
cell's prompts, its :class:`LoadPoint` and :class:`LoadSettings`, and returns a :class:`LoadResult`.

- :mod:`.concurrent`: closed loop, ``concurrency`` workers, each sends its next request when the last ends;
- :mod:`.poisson`, :mod:`.constant`: open loop at a request rate (:mod:`.open_loop` sends on the schedule);
- :mod:`.sweep`: which load points a workload asks for, including a sweep of rates up to saturation.
"""
from __future__ import annotations

import importlib

from .common import LoadPoint, LoadResult, LoadSettings, TimeoutStreak, frozen_heap, run_async
from .registry import PROFILES, profile_info

__all__ = ["PROFILES", "LoadPoint", "LoadResult", "LoadSettings", "TimeoutStreak", "frozen_heap", "run", "run_async"]


async def run(backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
    """Drive ``prompts`` through ``backend`` with the profile ``point`` names."""
    module = importlib.import_module(f"{__name__}.{profile_info(point.profile).module}")
    return await module.run(backend, prompts, point, settings)
