"""The client measured at a run's start, before it measures an engine: how many streamed events a second
kvbench's own client (backends/streaming.py, the SSE reader every OpenAI-style adapter uses) reads on this
machine, and how late it stamps a first token and the gaps between tokens, against a stand-in on loopback in
this process (docs/client.md, "Every run measures its own client").

The stand-in shares the client's event loop and core, as an engine on the same machine shares its cores:
the ceiling is the client's and the stand-in's cost together, a lower bound on the client's alone. A cell
whose event rate comes near it is flagged (:func:`cell_columns`): its TTFT and ITL then hold client time.
"""
from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from kvbench.backends.streaming import open_client, stream_sse
from kvbench.backends.types import RequestResult

from .common import run_async

#: The environment variable that switches the probe off ("off"): the test suite's many short runs
PROBE_SWITCH = "KVBENCH_CLIENT_PROBE"
#: A cell reading events at this share of the ceiling or more is flagged: past it, a busier cell would
#: queue events in the client (the ceiling is measured with the stand-in's cost inside it)
NEAR_LIMIT = 0.5
CEILING = {"concurrency": 16, "requests": 64, "events": 256}  # ~16K events: 0.1-0.3 s on one core
# Programmed answers: the first event after FIRST_S, then one every GAP_S; at 1 and 16 requests in flight
TIMED = {"first_s": 0.005, "gap_s": 0.002, "events": 16, "requests": 16, "concurrency": (1, 16)}
_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
_ID = re.compile(rb'"id":(\d+)')
_EVENT = b"data: {\"t\":1}\n\n"
_LAST = b"data: {\"t\":1,\"done\":1}\n\ndata: [DONE]\n\n"
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _StandIn(asyncio.Protocol):
    """Answers every POST with an event stream of ``events`` events, the first after ``first_s`` and then one
    every ``gap_s`` (0: at once, each in a loop pass of its own), noting when it really wrote each."""

    def __init__(self, events: int, first_s: float, gap_s: float, sent: dict):
        self.events, self.first_s, self.gap_s, self.sent = events, first_s, gap_s, sent
        self.buf = bytearray()
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            found = _LENGTH.search(self.buf, 0, end)
            body_end = end + 4 + (int(found.group(1)) if found else 0)
            if len(self.buf) < body_end:
                return
            found = _ID.search(self.buf, end + 4, body_end)
            request = int(found.group(1)) if found else -1  # before the buffer it points into is cut
            del self.buf[:body_end]
            self._answer(request)

    def _answer(self, request: int) -> None:
        self.transport.write(_HEAD)
        loop = asyncio.get_running_loop()
        times = self.sent[request] = []
        loop.call_at(loop.time() + self.first_s, self._send, 0, times, loop.time() + self.first_s)

    def _send(self, i: int, times: list, due: float) -> None:
        """Event ``i``, then the next one scheduled: each in a write of its own, read by the client in a read
        of its own as an engine's tokens are (events written in one loop pass would arrive as one read)."""
        if self.transport.is_closing():
            return
        times.append(time.perf_counter())
        last = i == self.events - 1
        self.transport.write(_chunk(_LAST if last else _EVENT) + (b"0\r\n\r\n" if last else b""))
        if not last:
            loop = asyncio.get_running_loop()
            if self.gap_s:
                loop.call_at(due + self.gap_s, self._send, i + 1, times, due + self.gap_s)
            else:
                loop.call_soon(self._send, i + 1, times, due)


@dataclass
class _Prompt:  # what stream_sse reads of a prompt
    request_id: str
    prompt_tokens: int = 1
    output_tokens: int = 1


def _handle(event, now: float, result: RequestResult) -> None:
    result.add_chunk(now, 1)
    if event.get("done"):
        result.output_tokens_reported = len(result.chunk_times)


async def _drive(events: int, first_s: float, gap_s: float, requests: int, concurrency: int):
    """(the results, the stand-in's write times per request, wall seconds) of ``requests`` requests,
    ``concurrency`` at a time, each on its own keep-alive connection."""
    sent: dict[int, list[float]] = {}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _StandIn(events, first_s, gap_s, sent), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    queue = list(range(requests))
    results: list[RequestResult] = []
    try:
        async with open_client(concurrency, 30.0) as client:
            async def stream():
                while queue:
                    i = queue.pop()
                    results.append(await stream_sse(client, url, {"n": events, "id": i},
                                                    _Prompt(str(i), 1, events), _handle))
            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(stream() for _ in range(concurrency))), 30.0)
            wall = time.perf_counter() - t0
    finally:
        server.close()
    return results, sent, wall


def _ceiling() -> dict:
    c = CEILING
    cpu0 = time.process_time()
    results, _, wall = run_async(_drive(c["events"], 0.0, 0.0, c["requests"], c["concurrency"]), signals=False)
    cpu = time.process_time() - cpu0
    events = sum(len(r.chunk_times) for r in results if r.error is None)
    if not events or wall <= 0:
        raise RuntimeError("the stand-in's events did not arrive: " + next((r.error for r in results if r.error), "?"))
    return {"events_per_s": events / wall, "cpu_s_per_event": cpu / events, "events": events, "wall_s": wall}


def _timed(concurrency: int) -> dict:
    """Reported minus the stand-in's own write time: the first event (TTFT) and the gaps after it (ITL), s."""
    t = TIMED
    results, sent, _ = run_async(_drive(t["events"], t["first_s"], t["gap_s"], t["requests"], concurrency),
                                 signals=False)
    ttft, itl = [], []
    for r in results:
        writes = sent.get(int(r.request_id), [])
        if r.error is not None or len(r.chunk_times) != t["events"] or len(writes) != t["events"]:
            continue
        late = np.asarray(r.chunk_times) - np.asarray(writes)
        ttft.append(late[0])
        itl += list(np.diff(r.chunk_times) - np.diff(writes))
    if not ttft:
        raise RuntimeError("no timed request could be matched to the stand-in's writes")
    return {"concurrency": concurrency, "ttft_s_p50": float(np.median(ttft)), "ttft_s_p99": float(np.quantile(ttft, 0.99)),
            "itl_s_p50": float(np.median(itl)), "itl_s_p99": float(np.quantile(itl, 0.99)), "requests": len(ttft)}


def run_probe() -> dict:
    """What run.json records as ``client_limit``: the ceiling (events a second on this machine, CPU a
    event) and the client's lateness at 1 and 16 requests in flight; ``not_measured`` where switched off or
    where the probe itself failed (a run never fails for it)."""
    if os.environ.get(PROBE_SWITCH, "").lower() == "off":
        return {"not_measured": f"the probe was switched off ({PROBE_SWITCH}=off)"}
    try:
        t0 = time.perf_counter()
        out = {"ceiling": _ceiling(), "overhead": [_timed(c) for c in TIMED["concurrency"]],
               "stand_in": "in-process SSE stand-in on 127.0.0.1 (bench/load/self_probe.py)",
               "near_limit_share": NEAR_LIMIT}
        out["probe_s"] = time.perf_counter() - t0
        return out
    except (OSError, RuntimeError, asyncio.TimeoutError, ValueError) as exc:
        return {"not_measured": f"the client probe failed: {type(exc).__name__}: {exc}"}


def cell_columns(results: list[RequestResult], wall_s: float | None, concurrency: int | None,
                 limit: dict | None, processes: int = 1) -> dict:
    """A cell's client columns: the streamed events it read a second, that over the run's ceiling (one per
    load process: ``--load-workers``), and the probe's TTFT lateness at the nearest concurrency probed (what
    the client alone adds at that load)."""
    events = sum(len(r.chunk_times) for r in results)
    rate = events / wall_s if wall_s and wall_s > 0 else None
    out = {"client_events_per_s": rate, "client_limit_share": None, "client_ttft_overhead_s": None}
    if not limit or "ceiling" not in limit:
        return out
    if rate is not None:
        out["client_limit_share"] = rate / (limit["ceiling"]["events_per_s"] * max(1, processes))
    probed = limit.get("overhead") or []
    if probed:
        nearest = min(probed, key=lambda o: abs(np.log(max(1, concurrency or 1) / o["concurrency"])))
        out["client_ttft_overhead_s"] = nearest["ttft_s_p50"]
    return out


def near_limit_flag(share: float | None) -> str | None:
    """The flag of a cell that read events at NEAR_LIMIT of the client's ceiling or more."""
    if share is None or share < NEAR_LIMIT:
        return None
    return (f"client near its limit: the cell read streamed events at {share:.0%} of the client's ceiling "
            "measured at the run's start: its TTFT and ITL hold client time")
