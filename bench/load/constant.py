"""Open loop with evenly spaced arrivals: exactly 1/rate apart."""
from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np

from .open_loop import OpenLoop


class Constant(OpenLoop):
    summary: ClassVar[str] = "open loop: arrivals evenly spaced at a request rate"

    profile: Literal["constant"] = "constant"

    @classmethod
    def arrival_offsets(cls, n: int, request_rate: float, seed: int = 0) -> np.ndarray:
        """Unseeded: the schedule is the same whatever ``seed``."""
        return np.arange(n) / request_rate
