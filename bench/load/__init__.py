"""Load profiles: one small module each, a class that owns its settings (a workload's ``[load]`` section),
the load points its cells run at and how requests arrive at a point (:mod:`.profile`); :mod:`.registry`
lists them.

- :mod:`.concurrent`: closed loop, ``concurrency`` workers, each sends its next request when the last ends;
- :mod:`.poisson`, :mod:`.constant`: open loop at a request rate (:mod:`.open_loop` sends on the schedule);
- :mod:`.sweep`: a closed loop finds the saturation rate, then open-loop rates up to it;
- :mod:`.workers`: a point from several processes (``LoadSettings.workers`` > 1), results merged;
- :mod:`.owner`: one share of a point sent from several machines, started at the owner's barrier;
- :mod:`.clock`: the load processes' clock offsets to the run's owner.
"""
from __future__ import annotations

from .common import LoadResult, LoadSettings, TimeoutStreak, frozen_heap, run_async
from .concurrent import ONE_AT_A_TIME
from .profile import LoadPoint, LoadProfile, profile_class
from .registry import PROFILES

__all__ = ["ONE_AT_A_TIME", "PROFILES", "LoadPoint", "LoadProfile", "LoadResult", "LoadSettings", "TimeoutStreak",
           "frozen_heap", "profile_class", "run", "run_async"]


async def run(backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
    """Drive ``prompts`` through ``backend`` with the profile that drives ``point`` (from
    ``settings.workers`` processes when more than one: :mod:`.workers`; one share of it, with other
    machines', when ``settings.share`` says so: :mod:`.owner`). Every request comes back with its ordinal,
    the process that sent it and that process's clock offset to the run's owner (this process: 0)."""
    if settings.share is not None:
        from . import owner
        return await owner.run_share(backend, prompts, point, settings)
    if settings.workers > 1:
        from . import workers
        return await workers.run(backend, prompts, point, settings)
    result = await point.driver.run(backend, prompts, point, settings)
    for r in result.results:
        r.clock_offset_start_s = r.clock_offset_end_s = 0.0
    return result
