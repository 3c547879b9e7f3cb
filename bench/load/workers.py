"""Load from more than one core: the cell's requests split over ``settings.workers`` processes, each with its
own event loop running kvbench's own streaming client (:mod:`kvbench.backends.streaming`) through the same
load profile, and their results merged into one :class:`LoadResult`. The profile that drives the point
splits the cell (:meth:`~kvbench.load.profile.LoadProfile.shares`); one that cannot says so
(:attr:`~kvbench.load.profile.LoadProfile.splits_over_workers`), and the cell is refused in one line.

- Closed loop: the concurrency is split over the workers (c=5 on 2 workers: 3 and 2) and the prompts are
  dealt out in the same proportion, in order (worker 0, 1, 0, 1, 0, ...): each worker runs the profile's
  closed loop over its share. A worker that finishes its share early does not take over another's (no
  shared queue: a cross-process queue would put its latency in front of every send).
- Open loop: the schedule is made once, in the parent, for the whole cell (the profile's own arrival
  times and seed), and dealt out round-robin; every request keeps its send time. A concurrency cap is split
  like a closed loop's concurrency.

One clock: every worker stamps with ``time.perf_counter()``, which on Linux is CLOCK_MONOTONIC, one clock
for the whole machine (not per process): a time taken in one process compares with a time taken in
another (``tests/load/test_workers.py`` checks this). All workers start their load at one common
instant chosen by the parent once every worker has started and said it is ready; process start-up (0.3-1 s
of imports per worker) is outside the cell. The merged result's ``t_start`` is that instant.

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
from dataclasses import replace

import httpx

from kvbench.backends import streaming
from kvbench.backends.base import Backend
from kvbench.backends.process import ServerProcess
from kvbench.common import redact

from .common import LoadResult, LoadSettings, run_async
from .open_loop import send_on_schedule
from .profile import LoadPoint, Share

READY_TIMEOUT_S = 120.0  # a worker that has not started and read its share by then is given up on
START_MARGIN_S = 0.05  # between the parent choosing the common start and the workers starting
CONTEXT = "spawn"


class WorkerError(RuntimeError):
    """A load worker failed outside any one request (could not start, unpickle its share, or crashed)."""


class MergedLoadResult(LoadResult):
    """A :class:`LoadResult` of several workers. ``loop_lag_s_max`` keeps the worst of every event loop that
    took part: :func:`~kvbench.load.common.run_async` sets it from the parent's loop (which only waits),
    and that must not hide a worker's late loop, which stamped the chunks."""

    def __setattr__(self, name, value):
        if name == "loop_lag_s_max" and value is not None and getattr(self, name, None) is not None:
            value = max(value, self.loop_lag_s_max)
        super().__setattr__(name, value)


# --- splitting a cell --------------------------------------------------------------------------------

def plan(prompts: list, point: LoadPoint, settings: LoadSettings, workers: int) -> list[Share]:
    """Each worker's share: (prompts, load point, send times or None), as the profile that drives ``point``
    splits it; never more workers than there are requests, closed-loop streams or open-loop cap. A profile
    that cannot be split is refused (WorkerError, one line)."""
    driver = point.driver
    if not driver.splits_over_workers:
        raise WorkerError(f"load profile {driver.name!r} runs from one load process only; use --load-workers 1")
    return driver.shares(prompts, point, settings.seed, workers)


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


async def _share(conn, backend, dropped, prompts, point: LoadPoint, offsets, settings: LoadSettings):
    """One worker's load: say it is ready (its event loop running, its heap frozen), wait for the common
    start instant ``t_go`` (perf_counter, shared by all processes), run its share from then. The profile
    takes its own start a few microseconds after ``t_go``; an open loop's send times are put back on the
    common schedule (``t_go`` + offset), and its lags measured against it, so that a worker's late start
    counts as lag instead of moving the schedule."""
    conn.send(("ready", dropped))
    kind, t_go = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    if kind != "go":
        return None
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


def _worker_main(conn) -> None:
    """A worker process: read its share, start its event loop, run (:func:`_share`), send the result."""
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
        result = run_async(_share(conn, backend, dropped, prompts, point, offsets, settings), signals=False)
        if result is not None:
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


# --- the parent ----------------------------------------------------------------------------------------

def run_workers(backend: Backend, prompts: list, point: LoadPoint, settings: LoadSettings,
                stop: threading.Event | None = None) -> LoadResult:
    """Run the cell on ``settings.workers`` processes and merge their results (blocking: the async
    :func:`run` awaits it in a thread). ``stop`` set: the workers are ended and a WorkerError raised (the
    load was cancelled: Ctrl-C, SIGTERM)."""
    shares = plan(prompts, point, settings, settings.workers)
    clone, dropped = portable_backend(backend)
    endpoints, secrets = endpoint_settings(), redact.held_values()
    # each worker keeps its own timeout streak (a copy); the parent's is brought up to date after
    worker_settings = replace(settings, workers=1)
    ctx = multiprocessing.get_context(CONTEXT)
    procs, conns = [], []
    try:
        for _ in shares:
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child_end,), name="kvbench-load-worker", daemon=True)
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        for conn, (share, share_point, offsets) in zip(conns, shares):
            conn.send_bytes(dumps_for_worker((clone, dropped, endpoints, secrets, share, share_point, offsets,
                                               worker_settings)))
        for i, conn in enumerate(conns):
            _expect(conn, procs[i], "ready", READY_TIMEOUT_S, i, stop)
        t_go = time.perf_counter() + START_MARGIN_S
        for conn in conns:
            conn.send(("go", t_go))
        # a request may take settings.timeout_s after the last one was sent; a closed loop sends in turn
        results = [_expect(conn, procs[i], "done", None, i, stop) for i, conn in enumerate(conns)]
    finally:
        for conn in conns:
            conn.close()
        for proc in procs:
            if stop is not None and stop.is_set():
                # SIGKILL: a cancelled load keeps nothing of theirs, and a worker still starting up has
                # not yet undone a SIGTERM ignored in the process that spawned it
                proc.kill()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    merged = merge(results, t_go, point.request_rate)
    if settings.streak:
        for r in sorted(merged.results, key=lambda r: r.t_done or r.t_sent):
            settings.streak.record(bool(r.error) and r.error.startswith("timed out"))
    return merged


def _expect(conn, proc, kind: str, timeout_s: float | None, i: int, stop: threading.Event | None = None):
    """The worker's next message, which must be ``kind``; a WorkerError with its traceback otherwise."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if stop is not None and stop.is_set():
            raise WorkerError("the load was cancelled")
        if not proc.is_alive() and not conn.poll(0):
            raise WorkerError(f"load worker {i} exited ({proc.exitcode}) before it sent '{kind}'")
        if deadline is not None and time.monotonic() > deadline:
            raise WorkerError(f"load worker {i} did not say '{kind}' within {timeout_s:g} s")
    try:
        got, value = conn.recv()
    except EOFError:
        raise WorkerError(f"load worker {i} closed its pipe before it sent '{kind}'") from None
    if got == "error":
        raise WorkerError(f"load worker {i} failed:\n{value}")
    return value


def merge(results: list[LoadResult], t_start: float, offered_rate: float | None) -> MergedLoadResult:
    """The workers' results as one: every request (in send order), the common start, the last end, the
    send lags of all, the most requests in flight at once over all workers (from the requests' own
    windows, sent to done), and the worst event-loop lag."""
    requests = sorted((r for res in results for r in res.results), key=lambda r: r.t_sent)
    lags = [lag for res in results for lag in res.send_lags]
    loop_lags = [res.loop_lag_s_max for res in results if res.loop_lag_s_max is not None]
    return MergedLoadResult(requests, t_start, max((res.t_end for res in results), default=t_start),
                            offered_request_rate=offered_rate, max_in_flight=in_flight_peak(requests),
                            send_lags=lags, loop_lag_s_max=max(loop_lags) if loop_lags else None)


def in_flight_peak(results) -> int:
    """The most requests outstanding at once, from each request's send and end times."""
    events = []
    for r in results:
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
