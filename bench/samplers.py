"""Background samplers that run during a cell and return timelines.

- :class:`ProcessTreeMemorySampler`: resident memory (RSS) of the engine's whole process tree (vLLM's
  EngineCore and other children included) at ``hz``, and, when an NVIDIA GPU is present, the GPU memory
  NVML attributes to those processes plus the device's used memory. Pages shared between processes of the
  tree are counted once per process (RSS semantics).
- :class:`KVPoller`: the engine's own "KV in use" figure, polled through its adapter.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil


class NVML:
    """Thin wrapper over nvidia-ml-py (imports as ``pynvml``); ``available`` is False without a GPU."""

    def __init__(self):
        self.available = False
        self.handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self.handles)
        except Exception:  # no driver, no library, no device: CPU-only machine
            self.available = False

    def device_used_bytes(self) -> int:
        return sum(self.nv.nvmlDeviceGetMemoryInfo(h).used for h in self.handles)

    def process_bytes(self, pids: set[int]) -> int:
        total = 0
        for h in self.handles:
            for proc in self.nv.nvmlDeviceGetComputeRunningProcesses(h):
                if proc.pid in pids and proc.usedGpuMemory:
                    total += proc.usedGpuMemory
        return total


@dataclass
class MemorySample:
    t: float  # time.perf_counter()
    rss_bytes: int
    n_processes: int
    gpu_process_bytes: int | None = None
    gpu_device_used_bytes: int | None = None


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_rss(pid: int) -> tuple[int, int, set[int]]:
    total, pids = 0, set()
    for p in process_tree(pid):
        try:
            total += p.memory_info().rss
            pids.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total, len(pids), pids


class _Sampler(threading.Thread):
    def __init__(self, hz: float):
        super().__init__(daemon=True)
        self.period = 1.0 / hz
        self.stop_event = threading.Event()
        self.errors = 0

    def run(self):
        next_t = time.perf_counter()
        while not self.stop_event.is_set():
            try:
                self.sample()
            except Exception:  # the engine may be gone; the runner notices that itself
                self.errors += 1
            next_t += self.period
            self.stop_event.wait(max(0.0, next_t - time.perf_counter()))

    def sample(self):
        raise NotImplementedError

    def stop(self):
        self.stop_event.set()
        self.join(timeout=5)


class ProcessTreeMemorySampler(_Sampler):
    def __init__(self, pid: int, hz: float = 20.0, nvml: NVML | None = None):
        super().__init__(hz)
        self.pid, self.nvml = pid, nvml
        self.samples: list[MemorySample] = []

    def sample(self):
        now = time.perf_counter()
        rss, n, pids = tree_rss(self.pid)
        s = MemorySample(now, rss, n)
        if self.nvml and self.nvml.available:
            s.gpu_process_bytes = self.nvml.process_bytes(pids)
            s.gpu_device_used_bytes = self.nvml.device_used_bytes()
        self.samples.append(s)


@dataclass
class KVSample:
    t: float
    kv_bytes_in_use: float | None
    kv_tokens_in_use: float | None


class KVPoller(_Sampler):
    def __init__(self, backend, hz: float = 10.0):
        super().__init__(hz)
        self.backend = backend
        self.client = httpx.Client(timeout=2.0)
        self.samples: list[KVSample] = []
        self.source: str | None = None

    def sample(self):
        usage = self.backend.kv_in_use(self.client)
        if usage is not None:
            self.source = usage.source
            self.samples.append(KVSample(time.perf_counter(), usage.bytes, usage.tokens))

    def stop(self):
        super().stop()
        self.client.close()


@dataclass
class Timeline:
    memory: list[MemorySample] = field(default_factory=list)
    kv: list[KVSample] = field(default_factory=list)
