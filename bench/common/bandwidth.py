"""Decode against the memory-bandwidth limit. A decode step reads every weight once and the cached K/V of every
token each running sequence attends to, so no step is faster than those bytes over the memory's read bandwidth:
that time is the floor of the inter-token latency (ITL). :func:`read_bandwidth` measures the bandwidth on this
machine (recorded in run.json at a run's start); :func:`decode_bound` is the floor for one cell; the report sets
it beside the measured ITL (bench/reports/bandwidth.py; docs/metrics.md defines each term).

The probe is hand-written rather than a library's (STREAM is C, and numpy's own reductions are what can run in
this process): a sum over an array well past the last-level cache, split over the threads the engines get,
best of a few rounds. Read-only, because decode reads and writes almost nothing.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
#: the probe's array: 8 x the last-level cache, at least 256 MiB and at most 1 GiB (memory, not cache, is read)
MIN_ARRAY, MAX_ARRAY = 256 * MIB, 1024 * MIB


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache level's size from sysfs (None where it does not say)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def read_bandwidth(threads: int | None = None, rounds: int = 5) -> dict:
    """This machine's memory read bandwidth (bytes/s): the best of ``rounds`` sums over an array past the
    last-level cache, split over ``threads`` (default: the CPUs this process may run on, as the engines get)."""
    import numpy as np

    threads = max(1, threads or len(os.sched_getaffinity(0)))
    llc = last_level_cache_bytes()
    size = min(MAX_ARRAY, max(MIN_ARRAY, 8 * (llc or 0)))
    data = np.ones(size // 8, dtype=np.float64)
    parts = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):  # numpy's reductions release the GIL: the threads read in parallel
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return {"bytes_per_s": data.nbytes / best, "threads": threads, "array_bytes": int(data.nbytes),
            "last_level_cache_bytes": llc, "rounds": rounds,
            "method": "numpy sum over an array past the last-level cache, split over the threads, best round"}


@dataclass(frozen=True)
class DecodeBound:
    step_bytes: float  # read per decode step: the weights once, and the K/V every running sequence attends to
    kv_bytes: float  # of which the KV
    itl_s: float  # the step's bytes over the bandwidth: the fastest an inter-token latency can be

    @property
    def kv_share(self) -> float:
        return self.kv_bytes / self.step_bytes if self.step_bytes else 0.0


def decode_bound(weights_bytes: float, kv_bytes_per_sequence: float, sequences: int, bandwidth: float) -> DecodeBound:
    """The floor of one decode step of ``sequences`` running at once, each reading ``kv_bytes_per_sequence`` of
    cached K/V, the weights read once for all of them, at ``bandwidth`` bytes/s."""
    if not bandwidth > 0 or not weights_bytes >= 0 or not kv_bytes_per_sequence >= 0 or sequences < 1:
        raise ValueError("decode_bound: non-negative sizes, a positive bandwidth and at least one sequence")
    kv = kv_bytes_per_sequence * sequences
    step = weights_bytes + kv
    return DecodeBound(step, kv, step / bandwidth)


#: The environment variable that switches the probe off ("off"): the test suite's many short runs
PROBE_SWITCH = "KVBENCH_BANDWIDTH_PROBE"


def run_probe(environment: dict, gpu_probe=None) -> dict:
    """What run.json records as ``memory_bandwidth`` at a run's start: this CPU's, measured; on a GPU machine
    what ``gpu_probe()`` says (bench/run/device_bandwidth.py: the card's specification and a device read)."""
    if os.environ.get(PROBE_SWITCH, "").lower() == "off":
        return {"not_measured": f"the probe was switched off ({PROBE_SWITCH}=off)"}
    if environment.get("gpus"):
        return gpu_probe() if gpu_probe else {"not_measured": "a GPU machine, and no GPU probe was given"}
    figures = read_bandwidth()
    return {"device": "cpu", **figures, "label": f"{figures.get('threads', '?')} threads, measured at the run's start"}
