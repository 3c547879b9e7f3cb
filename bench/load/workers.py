"""Load from more than one core: the cell's requests split over ``settings.workers`` processes, each with its
own event loop running kvbench's own streaming client (:mod:`kvbench.backends.streaming`) through the same
load profile, and their requests merged into one :class:`LoadResult`, every one of them accounted for. The
profile that drives the point splits the cell (:meth:`~kvbench.load.profile.LoadProfile.shares`); one that
cannot says so (:attr:`~kvbench.load.profile.LoadProfile.splits_over_workers`), and the cell is refused in one
line. This process, the parent, is the schedule's owner: it hands out the work, starts every worker at one
instant and takes back every request.

- Closed loop: the concurrency is split over the workers (c=5 on 2 workers: 3 and 2 streams) and the
  requests are one shared queue: a stream that is free takes the next request of the cell, whichever
  worker it is in, so the cell keeps its concurrency to the end as one process would (a static deal of the
  prompts left the streams of a worker that finished early idle while another's share still ran: the
  cell's tail ran below its concurrency; ``python -m kvbench.selfcheck.workers_bench --split``). Taking a
  request is a lock and a counter shared by the processes (microseconds); the queue is the cell's ordinals,
  and which worker took each is noted beside it.
- Open loop: the schedule is made once, in the parent, for the whole cell (the profile's own arrival
  times and seed), and dealt out round-robin; every request keeps its send time. A concurrency cap is split
  like a closed loop's concurrency.

One clock: every worker stamps with its own ``time.perf_counter()`` (on Linux CLOCK_MONOTONIC, one clock for
the machine), and the parent measures each worker's offset to its own clock by pings over the worker's
pipe, before the start and after the worker's last request (:mod:`.clock`); the worker's times are put on
the parent's clock with them, and each request keeps both offsets (``tests/load/test_workers.py`` checks
that a worker's clock set off by seconds is corrected). All workers start their load at one common instant
chosen by the parent once every worker has started, said it is ready and had its offset measured; process
start-up (0.3-1 s of imports per worker) is outside the cell. The merged result's ``t_start`` is that
instant.

A worker that dies during the cell (killed, crashed) takes with it the requests it had not handed back: they
are recorded as lost (:data:`~kvbench.load.common.LOST`, the cell's ``n_lost``), never dropped, and its
siblings' requests are kept; the cell goes on without it. So does a worker that stops answering: its event
loop says it is alive every :data:`HEARTBEAT_S` while its share runs, and one silent for :data:`HANG_S`
(stopped, or its loop blocked) is ended, its requests lost with the reason. A worker that cannot start fails
the cell (:class:`WorkerError`). The parent's watch over its workers (every message awaited with a deadline,
the heartbeats read, a dead or silent worker named) is :mod:`.supervision`.

Workers are started with the ``spawn`` context (a fresh interpreter: the harness has sampler threads, which
``fork`` would copy in whatever state they are in). The backend goes to each worker as a copy of its state
without the server process handle, HTTP clients and TLS contexts (none is needed to stream:
:class:`_WorkerPickler`); the credentials and TLS settings of attached servers
(:func:`kvbench.backends.streaming.configure_endpoint`) go with it, and so do the credentials the harness
holds for scrubbing (:func:`kvbench.common.redact.held_values`): a worker masks them in a server's words before
it cuts an error to its length, as the harness would (a spawned interpreter holds none of its own).
"""
from __future__ import annotations

import asyncio
import copy
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import ssl
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import httpx

from kvbench.backends import streaming
from kvbench.backends.base import Backend
from kvbench.backends.process import ServerProcess
from kvbench.common import redact

from .clock import ClockMap
from .common import LoadResult, LoadSettings, is_lost, lost_request, run_async
from .open_loop import send_on_schedule
from .profile import LoadPoint, Share
from .supervision import Worker, WorkerDied, WorkerError, expect, finished, measure

READY_TIMEOUT_S = 120.0  # a worker that has not started and read its share by then is given up on
HEARTBEAT_S = 0.5  # a worker's event loop says it is alive this often while its share runs
# a worker silent this long while its share runs is stopped (SIGSTOP) or hung (its event loop blocked): it is
# ended and its requests recorded lost; its siblings' are kept (such a worker used to hang the cell for ever)
HANG_S = 30.0
START_MARGIN_S = 0.05  # between the parent choosing the common start and the workers starting
CONTEXT = "spawn"
TAKEN_BY_NONE = -1


class MergedLoadResult(LoadResult):
    """A :class:`LoadResult` of several workers. ``loop_lag_s_max`` keeps the worst of every event loop that
    took part: :func:`~kvbench.load.common.run_async` sets it from the parent's loop (which only waits),
    and that must not hide a worker's late loop, which stamped the chunks."""

    def __setattr__(self, name, value):
        if name == "loop_lag_s_max" and value is not None and getattr(self, name, None) is not None:
            value = max(value, self.loop_lag_s_max)
        super().__setattr__(name, value)


# --- splitting a cell --------------------------------------------------------------------------------

def plan(prompts: Sequence, point: LoadPoint, settings: LoadSettings, workers: int) -> list[Share]:
    """Each worker's share: (ordinals, load point, send times or None), as the profile that drives
    ``point`` splits the cell's ordinals 0..n-1 (its prompts are indexed by them: none is built here);
    never more workers than there are requests, closed-loop streams or open-loop cap. A profile that cannot
    be split is refused (WorkerError, one line)."""
    driver = point.driver
    if not driver.splits_over_workers:
        raise WorkerError(f"load profile {driver.name!r} runs from one load process only; use --load-workers 1")
    return driver.shares(list(range(len(prompts))), point, settings.seed, workers)


@dataclass
class SharedQueue:
    """A closed loop's requests as one queue for all its workers: the next ordinal to take (a counter under
    its lock) and, per ordinal, the worker that took it (:data:`TAKEN_BY_NONE`: none)."""

    next_ordinal: object  # multiprocessing.Value("q")
    taken_by: object  # multiprocessing.Array("h", n), without a lock: each slot is written once, under next's

    @classmethod
    def create(cls, ctx, n: int) -> SharedQueue:
        return cls(ctx.Value("q", 0), ctx.Array("h", [TAKEN_BY_NONE] * n, lock=False))

    def take(self, worker: int, n: int) -> int | None:
        with self.next_ordinal.get_lock():
            k = self.next_ordinal.value
            if k >= n:
                return None
            self.next_ordinal.value = k + 1
            self.taken_by[k] = worker
        return k

    def taken(self, worker: int) -> list[int]:
        return [k for k, w in enumerate(self.taken_by) if w == worker]

    def untaken(self) -> list[int]:
        return [k for k, w in enumerate(self.taken_by) if w == TAKEN_BY_NONE]


class _QueueView:
    """A worker's view of the cell's prompts: iterating takes the next request off the shared queue (a
    closed-loop profile iterates its prompts as its streams free up)."""

    def __init__(self, prompts: Sequence, queue: SharedQueue, worker: int):
        self.prompts, self.queue, self.worker = prompts, queue, worker

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator:
        n = len(self.prompts)
        while (k := self.queue.take(self.worker, n)) is not None:
            prompt = self.prompts[k]
            yield prompt if prompt.ordinal is not None else replace(prompt, ordinal=k)


# --- what goes to a worker ---------------------------------------------------------------------------

def _nothing():
    return None


class _WorkerPickler(pickle.Pickler):
    """Pickles the backend for a worker: what only the harness's process uses (the engine's process
    handle, untimed HTTP clients, TLS contexts, locks), wherever it sits (also inside the adapters of a
    deployment's replicas), goes as None or, for a lock, as a new one."""

    def reducer_override(self, obj):
        if isinstance(obj, (httpx.Client, httpx.AsyncClient, ssl.SSLContext, subprocess.Popen, ServerProcess)):
            return _nothing, ()
        if isinstance(obj, _LOCKS):
            return type(obj), ()
        return NotImplemented


_LOCKS = (type(threading.Lock()), type(threading.RLock()))


def dumps_for_worker(obj) -> bytes:
    buffer = io.BytesIO()
    _WorkerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def portable_backend(backend: Backend) -> tuple[Backend, list[str]]:
    """A copy of ``backend`` that can be pickled to a worker (:class:`_WorkerPickler`); an attribute that
    still cannot be pickled is left out, and named (the second item), so a worker that misses one says which."""
    clone = copy.copy(backend)
    dropped = []
    for name, value in list(vars(clone).items()):
        try:
            dumps_for_worker(value)
        except Exception:  # noqa: BLE001 - whatever cannot cross to another process
            delattr(clone, name)
            dropped.append(name)
    return clone, dropped


def endpoint_settings() -> list[tuple]:
    """The attached servers' credentials and whether they use TLS (the context itself does not pickle:
    the worker rebuilds it from the backend's ``ca_bundle`` option)."""
    return [(key, ep.headers, ep.tls is not None) for key, ep in streaming._ENDPOINTS.items()]


def _apply_endpoints(backend: Backend, endpoints: list[tuple]) -> None:
    for key, headers, tls in endpoints:
        streaming._ENDPOINTS[key] = streaming.Endpoint(headers, backend.tls if tls else None)


def _answer_clock(conn, until: str):
    """Answer the parent's clock pings (this process's ``perf_counter``) until it says ``until``; returns
    what came with that message."""
    while True:
        kind, value = conn.recv()
        if kind == "clock":
            conn.send(("clock", time.perf_counter()))
        elif kind == until:
            return value
        else:
            return None


async def _share(conn, backend, dropped, prompts, point: LoadPoint, offsets, settings: LoadSettings):
    """One worker's load: say it is ready (its event loop running, its heap frozen), answer the parent's
    clock pings, wait for the common start instant ``t_go`` (on this process's clock: the parent has put it
    there), run its share from then. The profile takes its own start a few microseconds after ``t_go``; an
    open loop's send times are put back on the common schedule (``t_go`` + offset), and its lags measured
    against it, so that a worker's late start counts as lag instead of moving the schedule."""
    conn.send(("ready", dropped))
    t_go = await asyncio.get_running_loop().run_in_executor(None, _answer_clock, conn, "go")
    if t_go is None:
        return None
    beat = asyncio.create_task(_heartbeat(conn))
    try:
        return await run_from(t_go, backend, prompts, point, offsets, settings)
    finally:
        beat.cancel()


async def _heartbeat(conn) -> None:
    """Say "alive" to the parent every :data:`HEARTBEAT_S` from the worker's event loop: a stopped process
    or a blocked loop falls silent, and the parent ends it (:data:`HANG_S`)."""
    while True:
        conn.send(("alive", None))
        await asyncio.sleep(HEARTBEAT_S)


async def run_from(t_go: float, backend, prompts, point: LoadPoint, offsets, settings: LoadSettings) -> LoadResult:
    """A share of a cell started at ``t_go`` (this process's ``perf_counter``): with its profile's own
    arrivals (``offsets`` None), or on the cell's schedule, ``offsets`` seconds after ``t_go``."""
    delay = t_go - time.perf_counter()
    if delay > 0.002:
        await asyncio.sleep(delay - 0.002)
    while time.perf_counter() < t_go:  # the last 2 ms: asyncio's timers are good to about 1 ms
        pass
    if offsets is None:  # the share keeps its profile's own arrivals
        return await point.driver.run(backend, prompts, point, settings)
    result = await send_on_schedule(backend, prompts, offsets, point, settings)
    skew = result.t_start - t_go
    for r in result.results:
        if r.t_scheduled is not None:
            r.t_scheduled -= skew
    result.send_lags = [lag + skew for lag in result.send_lags]
    result.t_start = t_go
    return result


def _exit_with_the_parent() -> None:
    """A worker whose harness died (SIGKILL included) stops sending at once instead of finishing its share:
    multiprocessing's parent sentinel becomes ready when the parent process is gone."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def _worker_main(conn, index: int = 0, queue: SharedQueue | None = None) -> None:
    """A worker process: read its share, start its event loop, run (:func:`_share`; a closed loop takes its
    requests off the shared ``queue``), say it has finished, answer the parent's clock pings, hand back its
    requests."""
    # Ctrl-C in a terminal reaches the whole process group: the parent decides, and ends its workers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the parent's terminate()) ends the worker at once, also where the parent ignores it and a
    # spawned child would inherit that (kvbench ignores both signals while it winds down after a Ctrl-C)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_exit_with_the_parent, daemon=True).start()
    try:
        backend, dropped, endpoints, secrets, prompts, point, offsets, settings = pickle.loads(conn.recv_bytes())
        for secret in secrets:  # before any answer is read: an echoed key is masked before it is cut
            redact.hold_secret(secret)
        _apply_endpoints(backend, endpoints)
        if queue is not None:
            prompts = _QueueView(prompts, queue, index)
        result = run_async(_share(conn, backend, dropped, prompts, point, offsets, settings), signals=False)
        if result is not None:
            conn.send(("finished", None))
            if _answer_clock(conn, "results") is not None:
                conn.send(("done", result))
    except KeyboardInterrupt:
        pass
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it as a WorkerError
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        conn.close()


#: The function a worker process runs (a test may run one that sets its clock off first).
WORKER_MAIN = _worker_main


# --- the parent ----------------------------------------------------------------------------------------

def run_workers(backend: Backend, prompts: Sequence, point: LoadPoint, settings: LoadSettings,
                stop: threading.Event | None = None, queue: bool = True) -> LoadResult:
    """Run the cell on ``settings.workers`` processes and merge their requests (blocking: the async
    :func:`run` awaits it in a thread). ``stop`` set: the workers are ended and a WorkerError raised (the
    load was cancelled: Ctrl-C, SIGTERM). ``queue`` False: a closed loop's prompts dealt out to the workers
    up front instead of one shared queue (the way they were split before; kept to measure the two)."""
    shares = plan(prompts, point, settings, settings.workers)
    closed = all(offsets is None for _, _, offsets in shares)
    clone, dropped = portable_backend(backend)
    endpoints, secrets = endpoint_settings(), redact.held_values()
    # each worker keeps its own timeout streak (a copy); the parent's is brought up to date after
    worker_settings = replace(settings, workers=1)
    ctx = multiprocessing.get_context(CONTEXT)
    shared = SharedQueue.create(ctx, len(prompts)) if closed and queue else None
    team: list[Worker] = []
    try:
        for i, (ordinals, share_point, offsets) in enumerate(shares):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=WORKER_MAIN, args=(child_end, i, shared), name="kvbench-load-worker",
                               daemon=True)
            proc.start()
            child_end.close()
            team.append(Worker(i, proc, parent_end, None if shared else ordinals, offsets))
        for w, (ordinals, share_point, offsets) in zip(team, shares):
            mine = prompts if shared else [numbered(prompts, k) for k in ordinals]
            w.conn.send_bytes(dumps_for_worker((clone, dropped, endpoints, secrets, mine, share_point, offsets,
                                                worker_settings)))
        for w in team:
            expect(w, "ready", READY_TIMEOUT_S, stop)
        for w in team:
            offset, _ = measure(w, stop, READY_TIMEOUT_S)
            w.clock = ClockMap(0.0, offset)
        t_go = time.perf_counter() + START_MARGIN_S
        for w in team:
            w.clock = ClockMap(t_go - w.clock.offset_start, w.clock.offset_start)
            w.conn.send(("go", t_go - w.clock.offset_start))  # on the worker's own clock
        # a request may take settings.timeout_s after the last one was sent; a closed loop sends in turn: no
        # deadline for the share itself, but every worker must say it is alive while it runs
        results = []
        for w in finished(team, stop, HANG_S):
            try:
                offset, _ = measure(w, stop, READY_TIMEOUT_S)
                w.clock = replace(w.clock, t_end=time.perf_counter() - offset, offset_end=offset)
                w.conn.send(("results", True))
                results.append((w, expect(w, "done", READY_TIMEOUT_S, stop)))
            except WorkerError as exc:  # it ended during its load: what it had not handed back is lost
                if stop is not None and stop.is_set():
                    raise
                w.died = exc.how if isinstance(exc, WorkerDied) else str(exc)
                w.proc.kill()
    finally:
        for w in team:
            w.conn.close()
        for w in team:
            if stop is not None and stop.is_set():
                # SIGKILL: a cancelled load keeps nothing of theirs, and a worker still starting up has
                # not yet undone a SIGTERM ignored in the process that spawned it
                w.proc.kill()
            w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
    for w, result in results:
        for r in result.results:
            w.clock.apply(r)
        result.t_start, result.t_end = w.clock(result.t_start), w.clock(result.t_end)
    lost = _lost(prompts, team, shared, settings, t_go, bool(results))
    merged = merge([result for _, result in results], t_go, point.request_rate, lost, len(team))
    if settings.streak:
        for r in sorted(merged.results, key=lambda r: r.t_done or r.t_sent):
            settings.streak.record(bool(r.error) and r.error.startswith("timed out"))
    return merged


def numbered(prompts: Sequence, k: int):
    """Prompt ``k`` of the cell, its ordinal set where the prompt has none (a test's list)."""
    prompt = prompts[k]
    return prompt if prompt.ordinal is not None else replace(prompt, ordinal=k)


def _lost(prompts: Sequence, team: list[Worker], shared: SharedQueue | None, settings: LoadSettings,
          t_go: float, any_finished: bool) -> list:
    """The requests of the workers that died: what each had taken off the queue (or its whole share of an
    open loop, as far as the duration reaches), and, when no worker lived to finish, what none took."""
    lost = []
    for w in team:
        if not w.died:
            continue
        if shared is not None:
            ordinals = shared.taken(w.index)
        else:
            ordinals = list(w.ordinals)
            if settings.duration_s and w.offsets is not None:  # those due after the duration were never to go
                ordinals = [k for k, due in zip(ordinals, w.offsets) if due < settings.duration_s]
        lost += [lost_request(numbered(prompts, k), t_go, k, w.name, w.died) for k in ordinals]
    if shared is not None and not any_finished:
        lost += [lost_request(numbered(prompts, k), t_go, k, "(none alive)", "every load worker ended")
                 for k in shared.untaken()]
    return lost


def merge(results: list[LoadResult], t_start: float, offered_rate: float | None, lost: list | None = None,
          processes: int | None = None) -> MergedLoadResult:
    """The workers' results as one: every request (in send order; the ``lost`` ones too), the common start,
    the last end, the send lags of all, the most requests in flight at once over all workers (from the
    requests' own windows, sent to done), and the worst event-loop lag."""
    requests = sorted((r for res in results for r in res.results), key=lambda r: r.t_sent)
    lags = [lag for res in results for lag in res.send_lags]
    loop_lags = [res.loop_lag_s_max for res in results if res.loop_lag_s_max is not None]
    return MergedLoadResult(requests + list(lost or []), t_start, max((res.t_end for res in results),
                                                                      default=t_start),
                            offered_request_rate=offered_rate, max_in_flight=in_flight_peak(requests),
                            send_lags=lags, loop_lag_s_max=max(loop_lags) if loop_lags else None,
                            processes=processes or len(results))


def in_flight_peak(results) -> int:
    """The most requests outstanding at once, from each request's send and end times (a lost request's are
    not known: left out)."""
    events = []
    for r in results:
        if is_lost(r):
            continue
        end = r.t_done if r.t_done is not None else (r.chunk_times[-1] if r.chunk_times else r.t_sent)
        events += [(r.t_sent, 1), (end, -1)]
    peak = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a send at the same instant
        now += step
        peak = max(peak, now)
    return peak


async def run(backend: Backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
    """:func:`run_workers` without blocking the caller's event loop; cancelled (Ctrl-C, SIGTERM), it ends
    the workers within a fraction of a second instead of waiting for their requests."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(run_workers, backend, prompts, point, settings, stop)
    except asyncio.CancelledError:
        stop.set()
        raise
