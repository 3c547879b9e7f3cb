"""One clock for the load processes of a run: each process's offset to the run's owner (the process whose
``time.perf_counter()`` the run's records are on), measured the way NTP does, and the map that puts a
process's own readings on the owner's clock.

An offset is measured by pings: the owner reads its clock (``a``), asks the process for its own (``w``),
reads its clock again (``b``); the process's reading was taken somewhere between ``a`` and ``b``, so
``(a + b) / 2 - w`` is the offset, wrong by at most half the round trip. Of several pings the one with the
shortest round trip is kept. Measured at the start of a cell and again at its end, a process's readings are
mapped with the offset interpolated between the two (a clock that drifts or is stepped during the cell
shows as two different offsets, and each reading gets the offset of its moment).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvbench.backends.types import RequestResult

PINGS = 7  # round trips per measurement; the shortest is kept


def best_offset(pings: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset, round trip) of the ping with the shortest round trip; each ping is (owner before, process
    reading, owner after). The offset is what to add to the process's reading to get the owner's."""
    a, w, b = min(pings, key=lambda p: p[2] - p[0])
    return (a + b) / 2 - w, b - a


def measure_offset(ping: Callable[[], tuple[float, float, float]], pings: int = PINGS) -> tuple[float, float]:
    """:func:`best_offset` of ``pings`` calls of ``ping``."""
    return best_offset([ping() for _ in range(pings)])


@dataclass(frozen=True)
class ClockMap:
    """A process's readings on the owner's clock: ``offset_start`` measured at its reading ``t_start``,
    ``offset_end`` at ``t_end`` (None: not measured, the start's holds), linear between them and held
    beyond them."""

    t_start: float
    offset_start: float
    t_end: float | None = None
    offset_end: float | None = None

    def offset(self, t: float) -> float:
        if self.offset_end is None or self.t_end is None or self.t_end <= self.t_start:
            return self.offset_start
        share = min(1.0, max(0.0, (t - self.t_start) / (self.t_end - self.t_start)))
        return self.offset_start + (self.offset_end - self.offset_start) * share

    def __call__(self, t: float | None) -> float | None:
        return None if t is None else t + self.offset(t)

    def apply(self, r: RequestResult) -> RequestResult:
        """``r``'s times moved onto the owner's clock (in place), the two offsets recorded on it."""
        r.t_sent = self(r.t_sent)
        r.chunk_times = [self(t) for t in r.chunk_times]
        r.t_done, r.t_scheduled = self(r.t_done), self(r.t_scheduled)
        r.clock_offset_start_s, r.clock_offset_end_s = self.offset_start, self.offset_end
        return r
