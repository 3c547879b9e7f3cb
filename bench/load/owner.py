"""Load from several machines: separate ``kvbench run`` processes (pods), each sending one share of every cell
(``--load-share I/N``), with one of them, share 0, the run's owner (``--load-owner HOST:PORT``).

The owner serves two things over plain HTTP (a few requests per cell, none during the load):

- ``GET /clock``: its ``time.perf_counter()``. Every process measures its clock offset to the owner's by a
  few of these pings at the start and the end of each cell (:mod:`.clock`: the shortest round trip's
  midpoint; off by at most half that round trip), and puts its requests' times on the owner's clock.
- ``POST /arrive`` (``{"key": cell, "share": i}``): the start barrier. The answer waits until every share has
  arrived at that cell (or :data:`BARRIER_TIMEOUT_S` has passed: the shares that never came are then
  absent, and later barriers do not wait for them), then gives every process one start instant on the
  owner's clock, :data:`START_MARGIN_S` ahead; each process starts its share then, on its own clock.
- ``POST /leave`` (``{"share": i}``): a process has finished its run; the owner's process waits for every
  present share to leave before it ends (their last clock pings need it).

So the shares of a cell run at once, from one start, and their records are on one clock: ``kvbench merge``
then joins the folders into one run (:mod:`kvbench.run.merge`). The owner binds the address it is given
(``0.0.0.0`` for pods reaching it over the cluster's network; 127.0.0.1 for processes on one machine).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from .clock import PINGS, ClockMap, best_offset

BARRIER_TIMEOUT_S = 600.0  # a share that has not arrived by then (its pod still starting, or dead) is absent
START_MARGIN_S = 0.25  # between the last arrival and the common start: every answer has reached its process
REQUEST_TIMEOUT_S = 10.0  # a clock ping or a leave
BODY_MAX_BYTES = 4096
# a share may start before its owner (pods start in any order): until it has first reached the owner it
# tries again for this long while the owner refuses connections or its name does not resolve yet
CONNECT_DEADLINE_S = BARRIER_TIMEOUT_S
# once reached, an owner that refuses connections has ended: given up on after this long
RECONNECT_DEADLINE_S = REQUEST_TIMEOUT_S
RETRY_S = 0.5
SAY_EVERY_S = 30.0  # a wait at a barrier, or for the owner, is said this often


class OwnerError(RuntimeError):
    """The load owner could not be reached, or answered what it should not."""


@dataclass
class _Barrier:
    arrived: set[int] = field(default_factory=set)
    t_go: float | None = None
    missing: list[int] = field(default_factory=list)


class LoadOwner:
    """The owner's side: the clock, the barriers and the leaving, for ``processes`` shares."""

    def __init__(self, host: str, port: int, processes: int, barrier_timeout_s: float = BARRIER_TIMEOUT_S,
                 say: Callable[[str], None] | None = None):
        self.processes, self.barrier_timeout_s = processes, barrier_timeout_s
        self.say = say or _say
        self._cond = threading.Condition()
        self._barriers: dict[str, _Barrier] = {}
        self.absent: set[int] = set()  # shares that missed a barrier
        self.left: set[int] = set()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/clock":
                    return self._answer(200, {"t": time.perf_counter()})
                self._answer(404, {"error": "not found"})

            def do_POST(self):
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    if not 0 < length <= BODY_MAX_BYTES:
                        raise ValueError("a body of 1-4096 bytes")
                    body = json.loads(self.rfile.read(length))
                    share = int(body["share"])
                    if not 0 <= share < owner.processes:
                        raise ValueError(f"share {share} of {owner.processes}")
                    if self.path == "/arrive":
                        return self._answer(200, owner.arrive(str(body["key"]), share))
                    if self.path == "/leave":
                        return self._answer(200, owner.leave(share))
                except (ValueError, KeyError, TypeError) as exc:
                    return self._answer(400, {"error": str(exc)})
                self._answer(404, {"error": "not found"})

            def _answer(self, status: int, data: dict):
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):  # the run's console is for the run
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvbench-load-owner", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def arrive(self, key: str, share: int) -> dict:
        """Wait at cell ``key``'s barrier until every share not absent has arrived (or the timeout), then
        the common start on the owner's clock and the shares that never came."""
        with self._cond:
            barrier = self._barriers.setdefault(key, _Barrier())
            barrier.arrived.add(share)
            self.absent.discard(share)
            t0 = time.monotonic()
            deadline, said = t0 + self.barrier_timeout_s, t0
            while barrier.t_go is None:
                expected = set(range(self.processes)) - self.absent
                if expected <= barrier.arrived:
                    barrier.t_go = time.perf_counter() + START_MARGIN_S
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    barrier.missing = sorted(expected - barrier.arrived)
                    self.absent |= set(barrier.missing)
                    barrier.t_go = time.perf_counter() + START_MARGIN_S
                    self.say(f"load owner: {key}: shares {_listed(barrier.missing)} of {self.processes} did not "
                             f"reach the start within {self.barrier_timeout_s:g} s: starting without them (their "
                             "requests are not in this run)")
                    break
                if share == min(barrier.arrived) and time.monotonic() - said >= SAY_EVERY_S:  # one says it
                    said = time.monotonic()
                    self.say(f"load owner: {key}: waiting for shares {_listed(sorted(expected - barrier.arrived))} "
                             f"of {self.processes} ({said - t0:.0f} s of {self.barrier_timeout_s:g} s)")
                self._cond.wait(min(left, 1.0))
            self._cond.notify_all()
            return {"t_go": barrier.t_go, "missing": barrier.missing}

    def leave(self, share: int) -> dict:
        with self._cond:
            self.left.add(share)
            self._cond.notify_all()
        return {"left": sorted(self.left)}

    def wait_for_the_others(self, timeout_s: float = BARRIER_TIMEOUT_S) -> list[int]:
        """Block until every share not absent has left (or the timeout); the shares that did not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                staying = set(range(self.processes)) - self.absent - self.left
                if not staying or time.monotonic() >= deadline:
                    return sorted(staying)
                self._cond.wait(min(1.0, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _listed(shares: list[int]) -> str:
    return ", ".join(map(str, shares[:10])) + (f" ... ({len(shares)})" if len(shares) > 10 else "")


class OwnerClient:
    """A load process's side: its share, its clock offset to the owner's and the barrier. The owner's own
    process (share 0) asks its :class:`LoadOwner` directly: its offset is 0 by definition."""

    def __init__(self, url: str, share: int, processes: int, local: LoadOwner | None = None,
                 say: Callable[[str], None] | None = None):
        self.url, self.share, self.processes, self.local = url.rstrip("/"), share, processes, local
        self._http = httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False)
        self.reached = False  # whether the owner has answered once (before: it may still be starting)
        self.say = say or _say

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One call to the owner. Until the owner has first answered, a refused connection (or a name that does
        not resolve yet: its pod is starting) is tried again until :data:`CONNECT_DEADLINE_S`, said every
        :data:`SAY_EVERY_S`; after, until :data:`RECONNECT_DEADLINE_S`. Any other failure at once."""
        t0 = time.monotonic()
        said = t0
        while True:
            try:
                answer = self._http.request(method, f"{self.url}{path}", **kwargs)
                answer.raise_for_status()
                self.reached = True
                return answer
            except httpx.ConnectError as exc:
                waited = time.monotonic() - t0
                limit = RECONNECT_DEADLINE_S if self.reached else CONNECT_DEADLINE_S
                if waited >= limit:
                    raise OwnerError(f"the load owner at {self.url} did not answer {path}: "
                                     f"no connection{' any more' if self.reached else ''} for {waited:.0f} s "
                                     f"({type(exc).__name__}: {exc})") from None
                if not self.reached and time.monotonic() - said >= SAY_EVERY_S:
                    said = time.monotonic()
                    self.say(f"load share {self.share}: waiting for the load owner at {self.url} ({waited:.0f} s "
                             f"of {limit:g} s: {exc})")
                time.sleep(min(RETRY_S, max(0.0, limit - waited)))
            except httpx.HTTPError as exc:
                raise OwnerError(f"the load owner at {self.url} did not answer {path}: {type(exc).__name__}: "
                                 f"{exc}") from None

    def _post(self, path: str, body: dict, timeout_s: float) -> dict:
        try:
            return self._call("POST", path, json=body, timeout=timeout_s).json()
        except ValueError as exc:
            raise OwnerError(f"the load owner at {self.url} did not answer {path}: {type(exc).__name__}: {exc}") \
                from None

    def offset(self) -> tuple[float, float]:
        """(offset to add to this process's clock to get the owner's, round trip of the best ping)."""
        if self.local is not None:
            return 0.0, 0.0
        pings = []
        for _ in range(PINGS):
            a = time.perf_counter()
            try:
                answer = self._call("GET", "/clock")
                t_owner = float(answer.json()["t"])
            except (ValueError, KeyError, TypeError) as exc:
                raise OwnerError(f"the load owner at {self.url} did not answer /clock: {type(exc).__name__}: "
                                 f"{exc}") from None
            b = time.perf_counter()
            pings.append((a, t_owner, b))
        process_minus_owner, rtt = best_offset(pings)
        return -process_minus_owner, rtt

    def arrive(self, key: str) -> tuple[float, list[int]]:
        """Wait at cell ``key``'s barrier: (the common start on the owner's clock, the shares absent)."""
        if self.local is not None:
            answer = self.local.arrive(key, self.share)
        else:
            answer = self._post("/arrive", {"key": key, "share": self.share}, BARRIER_TIMEOUT_S + 30)
        try:
            return float(answer["t_go"]), [int(s) for s in answer.get("missing") or []]
        except (KeyError, TypeError, ValueError):
            raise OwnerError(f"the load owner at {self.url} answered /arrive with {str(answer)[:100]}") from None

    def leave(self) -> None:
        if self.local is not None:
            self.local.leave(self.share)
        else:
            self._post("/leave", {"share": self.share}, REQUEST_TIMEOUT_S)

    def close(self) -> None:
        self._http.close()


async def run_share(backend, prompts, point, settings):
    """This process's share of the cell (``settings.share``): the profile splits the cell's ordinals over the
    shares as it splits them over local workers; the clock offset measured, the barrier passed, the share
    sent from the common start, the offset measured again, and every time put on the owner's clock. A
    share the split leaves empty (concurrency 1 over 2 processes) still keeps the barrier."""
    import asyncio

    from .common import LoadResult
    from .workers import numbered, run_from

    share = settings.share
    shares = point.driver.shares(list(range(len(prompts))), point, settings.seed, share.of) if len(prompts) else []
    ordinals, mine, offsets = shares[share.index] if share.index < len(shares) else ([], point, None)
    offset_start, _ = await asyncio.to_thread(share.owner.offset)
    t_go_owner, missing = await asyncio.to_thread(share.owner.arrive, share.key)
    t_go = t_go_owner - offset_start
    if ordinals:
        result = await run_from(t_go, backend, [numbered(prompts, k) for k in ordinals], mine, offsets, settings)
    else:
        result = LoadResult([], t_go, t_go, offered_request_rate=point.request_rate)
    t_end_local = time.perf_counter()
    try:
        offset_end, _ = await asyncio.to_thread(share.owner.offset)
    except OwnerError as exc:  # the owner ended during the cell: this share's requests are kept all the same
        offset_end = None
        result.notes.append(f"the load owner stopped answering during the cell ({exc}): this share's requests are "
                            "put on its clock with the offset measured at the cell's start")
    clock = ClockMap(t_go, offset_start, t_end_local if offset_end is not None else None, offset_end)
    for r in result.results:
        clock.apply(r)
    result.t_start, result.t_end = t_go_owner, clock(result.t_end)
    result.offered_request_rate, result.processes = point.request_rate, share.of
    if missing:
        result.notes.append(f"load shares {', '.join(map(str, missing))} of {share.of} never reached the start "
                            f"barrier (within {BARRIER_TIMEOUT_S:g} s): their requests are not in this run")
    return result
