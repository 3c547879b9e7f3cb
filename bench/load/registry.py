"""The load profiles by name. Adding a profile = one module in this package with an async
``run(backend, prompts, point, settings) -> LoadResult``, and one line here.

``open_loop``: requests leave on a schedule at ``request_rate`` (capped by ``concurrency`` when given);
otherwise a closed loop of ``concurrency`` workers. Workload files and load points are checked against
this table, so a profile name is written once, here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProfileInfo:
    module: str  # in kvbench.load
    open_loop: bool
    summary: str


PROFILES: dict[str, ProfileInfo] = {
    "concurrent": ProfileInfo("concurrent", False, "closed loop: N workers, each sends when its last request ends"),
    "poisson": ProfileInfo("poisson", True, "open loop: Poisson arrivals at a request rate"),
    "constant": ProfileInfo("constant", True, "open loop: arrivals evenly spaced at a request rate"),
}


def profile_info(name: str) -> ProfileInfo:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown load profile {name!r}; allowed: {', '.join(PROFILES)}") from None
