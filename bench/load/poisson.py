"""Open loop with Poisson arrivals: exponential gaps with mean 1/rate, seeded so that every engine and
every run gets the same schedule."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from .open_loop import OpenLoop

if TYPE_CHECKING:  # numpy is loaded where a schedule is made, not by a workload's check
    import numpy as np


class Poisson(OpenLoop):
    summary: ClassVar[str] = "open loop: Poisson arrivals at a request rate"

    profile: Literal["poisson"] = "poisson"

    @classmethod
    def arrival_offsets(cls, n: int, request_rate: float, seed: int) -> np.ndarray:
        import numpy as np

        gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
        return np.concatenate([[0.0], np.cumsum(gaps[:-1])])
