"""What every load profile shares: its settings besides the load point, sending one request, and the result."""
from __future__ import annotations

import asyncio
import gc
import os
import socket
import time
from collections.abc import Callable
from typing import Any
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from kvbench.backends.base import Backend
from kvbench.backends.streaming import TRANSPORT_ERRORS
from kvbench.common.redact import holding, scrub, scrub_value
from kvbench.backends.types import RequestResult

from .interrupt import signals_call, stopping


class TimeoutStreak:
    """Requests in a row that timed out, over one engine start. An engine that has stopped answering (a
    wedged scheduler, a hung worker) would otherwise cost the full request timeout for every request of
    every remaining cell; after ``limit`` timeouts in a row the rest are not sent."""

    def __init__(self, limit: int | None = 3):
        self.limit, self.count = limit, 0

    @property
    def tripped(self) -> bool:
        return bool(self.limit) and self.count >= self.limit

    def record(self, timed_out: bool) -> None:
        self.count = self.count + 1 if timed_out else 0

    def probation(self) -> None:
        """The engine answered a probe after the streak tripped: send its requests again, and let one more
        timeout (before any answer) trip it again."""
        if self.limit:
            self.count = self.limit - 1

    def describe(self) -> str:
        return f"the engine stopped answering: {self.count} requests in a row timed out"


@dataclass(frozen=True)
class LoadShare:
    """One load process's share of a cell sent from several machines (bench/load/owner.py): share ``index``
    of ``of``, started at the owner's barrier for ``key`` (the cell's id), its times put on the owner's clock."""

    index: int
    of: int
    owner: Any  # an OwnerClient
    key: str


@dataclass(frozen=True)
class LoadSettings:
    """What every profile is told besides its load point."""

    timeout_s: float  # one request's limit
    duration_s: float | None = None  # no request starts after this many seconds (the ones in flight finish)
    seed: int = 0  # the arrival schedule's seed (open loops)
    streak: TimeoutStreak | None = None  # shared by the cells of one engine start
    workers: int = 1  # load generator processes (bench/load/workers.py); 1: this process alone
    # called with each request's result as it ends (the run's in-cell progress line); this process only
    on_done: Callable[[RequestResult], None] | None = field(default=None, compare=False)
    # this process sends one share of the cell, started with the others' at the owner's barrier
    # (kvbench run --load-share/--load-owner: bench/load/owner.py); None: the whole cell
    share: LoadShare | None = field(default=None, compare=False)


#: How a lost request's error begins: sent (or due) by a load process that died before handing it back,
#: so what became of it is not known. It counts as failed, and in the cell's ``n_lost``.
LOST = "lost: "


def is_lost(r: RequestResult) -> bool:
    return bool(r.error) and r.error.startswith(LOST)


def lost_request(prompt, t: float, ordinal: int | None, process: str, why: str) -> RequestResult:
    """The record of a request lost with load process ``process`` (``why``: how it ended), stamped ``t``
    (the cell's start: when it left is not known)."""
    r = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, t)
    r.error, r.ordinal, r.load_process = f"{LOST}load process {process} {why} before handing it back", ordinal, process
    return r


@dataclass
class LoadResult:
    results: list[RequestResult]
    t_start: float  # perf_counter when the load began
    t_end: float
    offered_request_rate: float | None = None  # open loop: the rate asked for
    max_in_flight: int = 0  # most requests outstanding at once, as the client saw it
    send_lags: list[float] = field(default_factory=list)  # open loop: t_sent - t_scheduled per request
    loop_lag_s_max: float | None = None  # the client's own delay (LoopLagMonitor), set by run_async
    processes: int = 1  # load processes that sent it (bench/load/workers.py, kvbench merge)
    notes: list[str] = field(default_factory=list)  # what the cell's row is flagged with (a share absent)

    @property
    def achieved_request_rate(self) -> float | None:
        """Requests sent per second, from the first send to the last (what the engine was offered in fact;
        requests lost with a load process are left out: when they left is not known)."""
        sent = sorted(r.t_sent for r in self.results if not is_lost(r))
        if len(sent) < 2 or sent[-1] <= sent[0]:
            return None
        return (len(sent) - 1) / (sent[-1] - sent[0])


class InFlight:
    """Counts outstanding requests and remembers the most at once."""

    def __init__(self):
        self.now = self.peak = 0

    def __enter__(self):
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        self.now -= 1


async def send_one(backend: Backend, client, prompt, settings: LoadSettings) -> RequestResult:
    """One request. Whatever goes wrong inside it (a timeout, a transport error, a malformed or wrong-shape
    event the adapter cannot read) becomes that request's error: one bad request never ends the run."""
    t0 = time.perf_counter()
    streak = settings.streak
    if streak and streak.tripped:
        error = f"not sent: {streak.describe()}"
    else:
        timed_out = False
        try:
            # asyncio.timeout, not wait_for: no task of its own per request (the client's ceiling,
            # docs/harness-benchmarks.md: wait_for's task cost ~10 us a request)
            async with asyncio.timeout(settings.timeout_s):
                result = await backend.stream(client, prompt)
            if streak:
                streak.record(False)
            if (bad := result.drop_bad_counts()) is not None:
                result.error = f"bad response: {bad}" if result.error is None else result.error
            return _done(result, prompt, settings)
        except (asyncio.TimeoutError, TimeoutError):
            # a replica's timeout while the deployment still answers: "replica H:P: timed out ...", which
            # neither counts here nor, not starting "timed out", in the load workers' parent
            where = backend.timed_out(prompt.request_id)
            error, timed_out = f"timed out after {settings.timeout_s:g} s", where is None
            error = error if where is None else f"{where}: {error}"
        except TRANSPORT_ERRORS as exc:
            error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # malformed stream
            error = f"bad response: {exc}"
        except Exception as exc:  # noqa: BLE001 - an event of the wrong shape (a list, null, a string...)
            error = f"bad response: {type(exc).__name__}: {exc}"
        if streak:
            streak.record(timed_out)
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, t0)
    result.error, result.t_done = error, time.perf_counter()
    return _done(result, prompt, settings)


_process_id: tuple[int, str] = (0, "")


def process_id() -> str:
    """This load process's name in the records: host and pid (a pod's host name is the pod's)."""
    global _process_id
    if _process_id[0] != os.getpid():  # a spawned worker is a process of its own
        _process_id = (os.getpid(), f"{socket.gethostname()}:{os.getpid()}")
    return _process_id[1]


def _done(result: RequestResult, prompt, settings: LoadSettings) -> RequestResult:
    result.ordinal, result.load_process = prompt.ordinal, process_id()
    if holding():  # a server's words (an error page echoing the key) lose every credential kvbench holds
        result.error = scrub(result.error) if result.error else result.error
        result.engine_details = scrub_value(result.engine_details)
    if settings.on_done is not None:
        settings.on_done(result)
    return result


_frozen_depth = 0


@contextmanager
def frozen_heap():
    """Collect the young generations, then freeze the heap (``gc.freeze``) until the block ends (nested
    blocks share the outermost freeze). A full collection walks every object the process holds: 0.1-0.5 s in
    a process that has loaded pandas and a run's results, and one that fell inside a load would stop the
    client and its samplers that long. Frozen, the collections during the block walk only what the block
    allocates. The old generation is not collected first: that would be the same full walk before every
    cell (0.1 s each, measured), and its garbage is thawed with it and collected later as usual."""
    global _frozen_depth
    if _frozen_depth == 0:
        gc.collect(1)
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


class LoopLagMonitor:
    """How late the client's event loop runs a timer due every ``interval_s``. While the loop is late it
    reads no socket, so a token that arrived then is stamped up to that much late: the largest lateness
    bounds the client's own error in that cell's TTFT and ITL (a starved or overloaded client shows here)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.lag_max = 0.0

    async def run(self):
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lag_max = max(self.lag_max, time.perf_counter() - due)


def run_async(coro, signals: bool = True):
    """Run a load coroutine to completion on a fresh event loop (uvloop's when installed: less client
    overhead per streamed token) with the heap frozen (:func:`frozen_heap`), and return its result; a
    :class:`LoadResult` gets the loop's largest lag (:class:`LoopLagMonitor`).

    ``signals``: SIGINT and SIGTERM (in the main thread) stop the load (:mod:`.interrupt`): the main task
    is cancelled, no further request is sent, and KeyboardInterrupt is raised once the loop has closed;
    a signal noted before the load began stops it before it sends anything.

    The result is handed out through a box rather than as the main task's result: at the end of
    ``asyncio.run`` Python 3.11 formats the main task's repr (in ``signal.getsignal``), which for a load's
    results (every chunk time of every request) cost 0.4 s per thousand requests of 256 tokens."""
    box = []
    running: list = []  # (loop, main task) once the loop runs

    def cancel(signum: int) -> None:
        if running:
            loop, task = running[0]
            loop.call_soon_threadsafe(task.cancel)  # wakes the loop if it sleeps in its selector

    async def main():
        running.append((asyncio.get_running_loop(), asyncio.current_task()))
        if signals and stopping():
            coro.close()
            return
        monitor = LoopLagMonitor()
        watch = asyncio.create_task(monitor.run())
        try:
            result = await coro
        finally:
            watch.cancel()
        if isinstance(result, LoadResult):
            result.loop_lag_s_max = monitor.lag_max
        box.append(result)

    with frozen_heap(), (signals_call(cancel) if signals else nullcontext()):
        try:
            try:
                import uvloop
            except ImportError:
                asyncio.run(main())
            else:
                uvloop.run(main())
        except asyncio.CancelledError:
            if not (signals and stopping()):
                raise
    if signals and stopping():
        raise KeyboardInterrupt
    return box[0]
