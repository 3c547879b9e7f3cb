"""Open loop with evenly spaced arrivals: exactly 1/rate apart."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from .open_loop import OpenLoop

if TYPE_CHECKING:  # numpy is loaded where a schedule is made, not by a workload's check
    import numpy as np


class Constant(OpenLoop):
    summary: ClassVar[str] = "open loop: arrivals evenly spaced at a request rate"

    profile: Literal["constant"] = "constant"

    @classmethod
    def arrival_offsets(cls, n: int, request_rate: float, seed: int = 0) -> np.ndarray:
        """Unseeded: the schedule is the same whatever ``seed``."""
        import numpy as np

        return np.arange(n) / request_rate
