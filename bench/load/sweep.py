"""Which load points a workload asks for. A sweep over concurrency levels or request rates is a list of
points; a sweep "up to saturation" first runs a closed loop at the workload's concurrency, then open-loop
rates spread evenly up to the request rate that loop achieved (the engine's saturation rate)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .common import LoadPoint

if TYPE_CHECKING:  # workloads validate their load profile against this package's registry
    from kvbench.workloads import Workload


def static_points(workload: Workload) -> list[LoadPoint]:
    """The points known before anything runs (all of them, unless the rates sweep up to saturation)."""
    if not workload.open_loop:
        return [LoadPoint(workload.load_profile, c) for c in workload.concurrency]
    cap = workload.concurrency[0] if workload.concurrency else None
    if workload.request_rates == "saturation":
        return [LoadPoint("concurrent", cap)]  # finds the saturation rate; the rates follow
    return [LoadPoint(workload.load_profile, cap, r) for r in workload.request_rates]


def saturation_points(workload: Workload, saturation_rate: float) -> list[LoadPoint]:
    """``saturation_steps`` rates evenly spaced up to ``saturation_rate`` (requests/s), e.g. 4 steps:
    25 %, 50 %, 75 %, 100 %."""
    if not saturation_rate or saturation_rate <= 0:
        return []
    cap = workload.concurrency[0] if workload.concurrency else None
    steps = workload.saturation_steps
    return [LoadPoint(workload.load_profile, cap, round(saturation_rate * i / steps, 4)) for i in range(1, steps + 1)]


def points_after(workload: Workload, finder: LoadPoint, measured_rate: float) -> list[LoadPoint]:
    """The points that follow a cell run at ``finder`` that achieved ``measured_rate`` (requests/s): a
    saturation sweep's open-loop rates after its closed loop; none for any other point or workload."""
    if workload.request_rates != "saturation" or finder.open_loop:
        return []
    return saturation_points(workload, measured_rate)


def points_found_later(workload: Workload) -> int:
    """How many points per prompt length are known only once a cell has run (a saturation sweep's rates)."""
    return workload.saturation_steps if workload.request_rates == "saturation" else 0


def max_in_flight(workload: Workload) -> int:
    """The most requests a workload can have outstanding at once: the engine is started with room for it
    (vLLM's max-num-seqs, llama.cpp's slots), unless the KV boundary sizes the pool smaller on purpose."""
    if workload.concurrency:
        return max(workload.concurrency)
    return max(1, int(max(workload.request_rates) * 4)) if isinstance(workload.request_rates, list) else 1
