"""The parent's watch over its load workers (:mod:`.workers`): every message from a worker awaited with a
deadline, and a worker that ends, fails or falls silent named with how, so that the cell goes on without it.

A worker says "alive" every ``HEARTBEAT_S`` from its event loop while its share runs
(:func:`kvbench.load.workers._heartbeat`); :func:`finished` reads those as they come, and ends a worker
silent for ``hang_s`` (stopped by SIGSTOP, or its loop blocked): it used to hang the cell for ever, its
siblings' requests with it. Before and after the share, :func:`expect` waits for one message at most
``timeout_s``, and says how a worker that ended ended (:class:`WorkerDied`).
"""
from __future__ import annotations

import multiprocessing.connection
import socket
import threading
import time
from dataclasses import dataclass

from .clock import PINGS, ClockMap, best_offset


class WorkerError(RuntimeError):
    """A load worker failed outside any one request (could not start or unpickle its share)."""


class WorkerDied(WorkerError):
    """A load worker ended (killed, crashed) before handing back its requests."""

    def __init__(self, index: int, how: str):
        super().__init__(f"load worker {index} {how} before handing back its requests")
        self.index, self.how = index, how


@dataclass
class Worker:
    """A load worker as the parent holds it: its process, its end of their pipe, its share and clock."""

    index: int
    proc: object
    conn: object
    ordinals: list[int] | None  # an open loop's share (None: it takes from the shared queue)
    offsets: object = None  # an open loop's send times of its share
    clock: ClockMap | None = None
    died: str = ""  # how it ended, when it ended before handing back its requests

    @property
    def name(self) -> str:
        return f"{socket.gethostname()}:{self.proc.pid}"


def finished(team: list[Worker], stop: threading.Event | None, hang_s: float) -> list[Worker]:
    """Wait for every worker's "finished" (its share sent), all at once: the workers that said it, in order.
    One that ends, fails or stays silent for ``hang_s`` (stopped, hung) gets ``died`` set and is ended;
    the others are still waited for. Its "alive" messages are read as they come, so none waits on a full pipe."""
    heard = {w.index: time.monotonic() for w in team}
    running = {w.index: w for w in team}
    done: list[Worker] = []
    while running:
        if stop is not None and stop.is_set():
            raise WorkerError("the load was cancelled")
        multiprocessing.connection.wait([w.conn for w in running.values()]
                                        + [w.proc.sentinel for w in running.values()], timeout=0.2)
        now = time.monotonic()
        for w in list(running.values()):
            try:
                while w.conn.poll(0):
                    kind, value = w.conn.recv()
                    heard[w.index] = now
                    if kind == "finished":
                        done.append(running.pop(w.index))
                        break
                    if kind == "error":
                        w.died = f"failed ({value.strip().splitlines()[-1]})"
                        break
                    if kind != "alive":
                        w.died = f"said {kind!r} during its load"
                        break
            except (EOFError, OSError):
                w.proc.join(1)
                w.died = f"exited ({w.proc.exitcode})" if w.proc.exitcode is not None else "closed its pipe"
            if w.index in running and not w.died and not w.proc.is_alive() and not w.conn.poll(0):
                w.died = f"exited ({w.proc.exitcode})"
            if w.index in running and not w.died and now - heard[w.index] > hang_s:
                w.died = f"stopped answering (silent for {hang_s:g} s: stopped or hung) and was ended"
            if w.died:
                w.proc.kill()
                running.pop(w.index, None)
    return sorted(done, key=lambda w: w.index)


def measure(w: Worker, stop: threading.Event | None, timeout_s: float) -> tuple[float, float]:
    """The worker's clock offset to this process's (:func:`~kvbench.load.clock.best_offset` of a few pings,
    each answered within ``timeout_s``)."""
    pings = []
    for _ in range(PINGS):
        a = time.perf_counter()
        w.conn.send(("clock", None))
        reading = expect(w, "clock", timeout_s, stop)
        pings.append((a, reading, time.perf_counter()))
    return best_offset(pings)


def expect(w: Worker, kind: str, timeout_s: float | None, stop: threading.Event | None = None):
    """The worker's next message, which must be ``kind``; a WorkerError with its traceback otherwise
    (:class:`WorkerDied` where the worker ended)."""
    conn, proc, i = w.conn, w.proc, w.index
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if stop is not None and stop.is_set():
            raise WorkerError("the load was cancelled")
        if not proc.is_alive() and not conn.poll(0):
            raise WorkerDied(i, f"exited ({proc.exitcode})")
        if deadline is not None and time.monotonic() > deadline:
            raise WorkerError(f"load worker {i} did not say '{kind}' within {timeout_s:g} s")
    try:
        got, value = conn.recv()
    except EOFError:  # it ended: say how
        proc.join(1)
        raise WorkerDied(i, f"exited ({proc.exitcode})" if proc.exitcode is not None else "closed its pipe") from None
    if got == "error":
        if kind in ("finished", "done"):  # during its load: what it had not handed back is lost
            raise WorkerDied(i, f"failed ({value.strip().splitlines()[-1]})")
        raise WorkerError(f"load worker {i} failed:\n{value}")
    return value
