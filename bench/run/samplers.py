"""Background samplers that run during a cell and return timelines.

- :class:`ProcessTreeMemorySampler`: resident memory (RSS) of the engine's whole process tree (vLLM's
  EngineCore and other children included) at ``hz``, and, when an NVIDIA GPU is present, the GPU memory
  NVML attributes to those processes plus the device's used memory. Pages shared between processes of the
  tree are counted once per process (RSS semantics).
- :class:`EnginePoller`: the engine's own "KV in use" figure and queue, polled through its adapter.

The GPU side reads NVML through :class:`kvbench.common.hardware.NVML`.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import psutil

from kvbench.backends.prometheus import describe_dropped, take_dropped
from kvbench.backends.types import KVSample, QueueSample, record_poll  # shared with deployments
from kvbench.common.hardware import NVML, GPUBaseline


@dataclass
class MemorySample:
    t: float  # time.perf_counter()
    rss_bytes: int
    n_processes: int
    gpu_process_bytes: int | None = None  # NVML: the process tree's GPU memory, all devices
    gpu_device_used_bytes: int | None = None  # NVML: total - free, all devices
    gpu_device_reserved_bytes: int | None = None  # NVML v2: driver/firmware reserve, all devices
    gpu_device_total_bytes: int | None = None
    gpu_device_over_baseline_bytes: int | None = None  # used minus the idle baseline (given one)
    # the same per device, in NVML's index order (None without NVML): several GPUs (tensor parallel) differ
    gpu_per_device: list[dict] | None = None


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_rss(pid: int, tree: list[psutil.Process] | None = None) -> tuple[int, int, set[int]]:
    """(RSS bytes, processes, pids) of ``pid``'s process tree (or of ``tree``, one listed before)."""
    total, pids = 0, set()
    for p in process_tree(pid) if tree is None else tree:
        try:
            total += p.memory_info().rss
            pids.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total, len(pids), pids


def busy_threads(pid: int, share: float = 0.1, min_cpu_s: float = 0.5) -> dict | None:
    """The threads of ``pid``'s process tree that computed: those whose CPU time (user + system) reached
    ``share`` of the busiest thread's and at least ``min_cpu_s``. What an engine really used, whatever its
    flags say (llama.cpp's -t/-tb, vLLM's OpenMP binding, torch's intra-op pool); None when unreadable."""
    times = []
    try:
        tree = process_tree(pid)
    except psutil.Error:  # the engine has ended (and been reaped)
        return None
    for p in tree:
        try:
            times += [t.user_time + t.system_time for t in p.threads()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if not times:
        return None
    floor = max(min_cpu_s, share * max(times))
    return {"busy_threads": sum(t >= floor for t in times), "threads": len(times),
            "busiest_thread_cpu_s": round(max(times), 1)}


class _Sampler(threading.Thread):
    def __init__(self, hz: float):
        super().__init__(daemon=True)
        self.period = 1.0 / hz
        self.stop_event = threading.Event()
        self.errors = 0
        self.error_reasons: dict[str, int] = {}  # each failure's type and words, and how often

    def start(self):
        """Take the first sample in the caller's thread, then the rest at ``hz`` in the background. The
        first is the state before the load, and whatever it sets up (a connection, a first read of the
        engine's configuration, a process listing) is done before the load starts, not inside it."""
        self._first = time.perf_counter()
        self._sample()
        super().start()

    def run(self):
        next_t = self._first
        while True:
            next_t += self.period
            if self.stop_event.wait(max(0.0, next_t - time.perf_counter())):
                return
            self._sample()

    def _sample(self):
        try:
            self.sample()
        except Exception as exc:  # noqa: BLE001 - the engine may be gone (the runner notices that itself);
            self.errors += 1  # a sampler's failure is never the cell's
            reason = f"{type(exc).__name__}: {str(exc)[:160]}"
            self.error_reasons[reason] = self.error_reasons.get(reason, 0) + 1

    def sample(self):
        raise NotImplementedError

    def stop(self):
        self.stop_event.set()
        self.join(timeout=5)


class ProcessTreeMemorySampler(_Sampler):
    """RSS of the process tree at ``hz`` and, with NVML, its GPU memory and the devices' (see MemorySample).
    ``baseline`` (NVML.idle_baseline(), taken before the engine started) gives the device delta."""

    # Listing the tree reads every process's /proc entry (~4 ms with 80 processes); reading the RSS of the
    # tree's few processes takes ~0.1 ms. So the tree is listed again only this often, or when one of its
    # processes is gone.
    TREE_REFRESH_S = 0.5

    def __init__(self, pid: int, hz: float = 20.0, nvml: NVML | None = None, baseline: GPUBaseline | None = None):
        super().__init__(hz)
        self.pid, self.nvml, self.baseline = pid, nvml, baseline
        self.samples: list[MemorySample] = []
        self._tree: list[psutil.Process] = []
        self._tree_listed = float("-inf")

    def sample(self):
        now = time.perf_counter()
        if now - self._tree_listed > self.TREE_REFRESH_S:
            self._tree, self._tree_listed = process_tree(self.pid), now
        rss, n, pids = tree_rss(self.pid, self._tree)
        if n < len(self._tree):  # a process ended: list the tree again now
            self._tree, self._tree_listed = process_tree(self.pid), now
            rss, n, pids = tree_rss(self.pid, self._tree)
        s = MemorySample(now, rss, n)
        if self.nvml and self.nvml.available:
            processes = self.nvml.process_memory(pids)
            s.gpu_process_bytes, per_process = processes.bytes, processes.per_device
            devices = self.nvml.device_memory()
            base = self.baseline.device_used_bytes if self.baseline is not None else None
            s.gpu_per_device = [{"index": d.index, "used_bytes": d.used, "total_bytes": d.total,
                                 "process_bytes": per_process[i] if i < len(per_process) else None,
                                 "over_baseline_bytes": d.used - base[i] if base and i < len(base) else None}
                                for i, d in enumerate(devices)]
            s.gpu_device_used_bytes = sum(d.used for d in devices)
            s.gpu_device_total_bytes = sum(d.total for d in devices)
            if all(d.reserved is not None for d in devices):
                s.gpu_device_reserved_bytes = sum(d.reserved for d in devices)
            if self.baseline is not None:
                s.gpu_device_over_baseline_bytes = s.gpu_device_used_bytes - self.baseline.used_bytes
        self.samples.append(s)


class EnginePoller(_Sampler):
    """The engine's own figures, polled through its adapter (``Backend.poll``) over its own HTTP client:
    KV in use, and its queue (requests waiting, running, preempted: the evidence of the KV boundary)."""

    def __init__(self, backend, hz: float = 10.0):
        super().__init__(hz)
        self.backend = backend
        self.client = backend.http_client(2.0)  # with the credentials and CA bundle of its untimed calls
        self.kv_samples: list[KVSample] = []
        self.queue_samples: list[QueueSample] = []
        self.kv_source: str | None = None
        self.queue_source: str | None = None
        self.dropped: Counter = Counter()  # samples dropped while parsing, {(metric, reason): count}
        self.polls_ok = 0

    def start(self):
        take_dropped()  # the first poll runs in the caller's thread: its earlier reads are not this cell's polls
        super().start()

    def sample(self):
        try:
            record_poll(self, self.backend.poll(self.client), time.perf_counter())
        finally:
            self.dropped.update(take_dropped())  # counted in this thread by the adapter's parsing
        self.polls_ok += 1

    def stop(self):
        super().stop()
        self.client.close()
        note = self.problems()
        if note:  # said once, in the row's sources; an unread figure says why
            self.kv_source = f"{self.kv_source}; {note}" if self.kv_source else f"not measured: {note}"
            self.queue_source = f"{self.queue_source}; {note}" if self.queue_source else None

    def problems(self) -> str:
        """What went wrong with the polls of this cell, in one line ("" for nothing): samples dropped (a
        value that is not a number, NaN, infinite) and polls that failed, with the reasons."""
        parts = []
        if self.dropped:
            parts.append(f"{describe_dropped(self.dropped)} in {self.errors + self.polls_ok} polls")
        if self.errors:
            reasons = "; ".join(f"{n} x {reason}" if n > 1 else reason
                                for reason, n in sorted(self.error_reasons.items(), key=lambda kv: -kv[1])[:3])
            parts.append(f"{self.errors} of {self.errors + self.polls_ok} polls failed ({reasons})")
        return "; ".join(parts)


def _counters(backend, group):
    """One capability group's cumulative counters now, or None: the engine keeps none, or they cannot be read
    ("not reported", never a failed cell)."""
    try:
        return group.counters(backend, backend.http)
    except (httpx.HTTPError, ValueError):
        return None


def engine_counters(backend) -> tuple:
    """The engine's cumulative counters read around a cell: (prefix cache, speculation, bytes a step), each
    None where none."""
    caps = backend.capabilities
    return tuple(_counters(backend, group) for group in (caps.prefix_cache, caps.speculation, caps.step_bytes))
