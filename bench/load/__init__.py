"""Load profiles: one small module each. Every profile takes the backend, the cell's prompts and its
settings, and returns a :class:`~bench.load.common.LoadResult`.

- :mod:`.concurrent`: closed loop, ``concurrency`` workers, each sends its next request when the last ends;
- :mod:`.rate`: open loop at a request rate (Poisson or constant arrivals), optionally capped in flight;
- :mod:`.sweep`: which load points a workload asks for, including a sweep of rates up to saturation.
"""
from .common import LoadPoint, LoadResult, frozen_heap, run_async

__all__ = ["LoadPoint", "LoadResult", "frozen_heap", "run_async"]
