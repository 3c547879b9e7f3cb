"""Background samplers that run during a cell and return timelines.

- :class:`ProcessTreeMemorySampler`: resident memory (RSS) of the engine's whole process tree (vLLM's
  EngineCore and other children included) at ``hz``, and, when an NVIDIA GPU is present, the GPU memory
  NVML attributes to those processes plus the device's used memory. Pages shared between processes of the
  tree are counted once per process (RSS semantics).
- :class:`EnginePoller`: the engine's own "KV in use" figure and queue, polled through its adapter.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil


# NVML error codes (the values pynvml uses) for the cases handled here.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13


@dataclass
class DeviceMemory:
    """One device as NVML sees it. ``used`` is total - free (NVML v1's "used": allocations plus the memory
    the driver and firmware reserve), the same figure whichever API answered; ``reserved`` is that
    driver/firmware share alone, known only through nvmlDeviceGetMemoryInfo_v2 (None through v1)."""

    index: int
    total: int
    used: int
    free: int
    reserved: int | None = None


@dataclass
class ProcessGpuMemory:
    """GPU memory NVML attributes to a set of pids, over every device.

    ``bytes`` is None when no process of the set is listed with a known figure (NVML lists the process
    but reports its usedGpuMemory as not available, or lists none of them). ``pids_found`` are the pids of
    the set NVML listed; ``pids_listed`` every pid NVML listed on the devices (a container whose pid
    namespace differs from the host's sees host pids here and none of its own)."""

    bytes: int | None
    pids_found: set[int] = field(default_factory=set)
    pids_listed: set[int] = field(default_factory=set)
    pids_unknown_bytes: set[int] = field(default_factory=set)


@dataclass
class GPUBaseline:
    """Device memory before an engine starts: what the engine's figures are measured against."""

    t: float  # time.perf_counter()
    device_used_bytes: list[int]  # per device, the lowest of ``readings`` readings
    device_total_bytes: list[int]
    device_reserved_bytes: list[int | None]
    names: list[str]
    readings: int
    process_bytes: dict[int, int | None] = field(default_factory=dict)  # pid -> bytes of processes already there

    @property
    def used_bytes(self) -> int:
        return sum(self.device_used_bytes)

    def to_dict(self) -> dict:
        return {"device_used_bytes": self.device_used_bytes, "device_total_bytes": self.device_total_bytes,
                "device_reserved_bytes": self.device_reserved_bytes, "names": self.names,
                "readings": self.readings, "used_bytes": self.used_bytes,
                "process_bytes": {str(k): v for k, v in self.process_bytes.items()}}


class NVML:
    """Thin wrapper over nvidia-ml-py (imports as ``pynvml``); ``available`` is False without a GPU.

    ``module`` replaces the ``pynvml`` import (tests pass a fake with the same functions). ``error`` says
    why NVML is not available (no library, no driver, no device).
    """

    def __init__(self, module=None):
        self.available = False
        self.handles = []
        self.nv = None
        self.error: str | None = None
        self.memory_api: str | None = None  # "v2" or "v1", once a device was read
        self._v2 = True
        try:
            if module is None:
                import pynvml as module  # nvidia-ml-py (never the deprecated `pynvml` PyPI package)

            module.nvmlInit()
            self.nv = module
            self.handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(module.nvmlDeviceGetCount())]
            self.available = bool(self.handles)
            if not self.handles:
                self.error = "NVML found no device"
        except Exception as exc:  # no driver, no library, no device: CPU-only machine
            self.available = False
            self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    # --- devices ---------------------------------------------------------------------------------
    def _memory(self, handle):
        if self._v2:
            try:
                info = self.nv.nvmlDeviceGetMemoryInfo(handle, version=self.nv.nvmlMemory_v2)
                self.memory_api = "v2"
                return info, True
            except Exception as exc:  # old driver (no _v2 symbol), old binding (no version=), not supported
                if not _is_unsupported(exc):
                    raise
                self._v2 = False
        self.memory_api = "v1"
        return self.nv.nvmlDeviceGetMemoryInfo(handle), False

    def device_memory(self) -> list[DeviceMemory]:
        """Every device's memory, v2 (with the reserved share) where the driver has it, else v1."""
        out = []
        for i, h in enumerate(self.handles):
            info, v2 = self._memory(h)
            out.append(DeviceMemory(index=i, total=int(info.total), used=int(info.total) - int(info.free),
                                    free=int(info.free), reserved=int(info.reserved) if v2 else None))
        return out

    def device_used_bytes(self) -> int:
        return sum(d.used for d in self.device_memory())

    def device_names(self) -> list[str]:
        names = []
        for h in self.handles:
            name = self.nv.nvmlDeviceGetName(h)
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names

    def devices(self) -> list[dict]:
        """Name and memory of every device (for run.json's environment)."""
        return [{"index": d.index, "name": n, "memory_bytes": d.total, "reserved_bytes": d.reserved}
                for d, n in zip(self.device_memory(), self.device_names())]

    # --- processes -------------------------------------------------------------------------------
    def _processes(self, handle) -> dict[int, int | None]:
        """pid -> usedGpuMemory on one device, compute and graphics processes together, each pid once."""
        listed: dict[int, int | None] = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            get = getattr(self.nv, fn, None)
            if get is None:
                continue
            try:
                procs = get(handle)
            except Exception as exc:
                if _is_unsupported(exc):  # e.g. graphics processes on a compute-only device
                    continue
                raise
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                # A process with compute and graphics contexts is listed twice with the same figure.
                if p.pid in listed and listed[p.pid] is not None:
                    used = max(listed[p.pid], used) if used is not None else listed[p.pid]
                listed[p.pid] = used
        return listed

    def process_memory(self, pids: set[int]) -> ProcessGpuMemory:
        total, known = 0, False
        result = ProcessGpuMemory(bytes=None)
        for h in self.handles:
            for pid, used in self._processes(h).items():
                result.pids_listed.add(pid)
                if pid not in pids:
                    continue
                result.pids_found.add(pid)
                if used is None:
                    result.pids_unknown_bytes.add(pid)
                else:
                    total += used
                    known = True
        result.bytes = total if known else (0 if not result.pids_found else None)
        return result

    def process_bytes(self, pids: set[int]) -> int | None:
        """GPU bytes of the processes in ``pids`` over every device (0 when NVML lists none of them;
        None when it lists them without a figure)."""
        return self.process_memory(pids).bytes

    # --- baseline --------------------------------------------------------------------------------
    def idle_baseline(self, readings: int = 5, interval_s: float = 0.05) -> GPUBaseline | None:
        """Device memory before an engine starts: per device the lowest of ``readings`` readings.
        None without a GPU."""
        if not self.available:
            return None
        lowest: list[DeviceMemory] = []
        for k in range(readings):
            mem = self.device_memory()
            lowest = mem if not lowest else [a if a.used <= b.used else b for a, b in zip(lowest, mem)]
            if k + 1 < readings:
                time.sleep(interval_s)
        procs: dict[int, int | None] = {}
        for h in self.handles:
            for pid, used in self._processes(h).items():
                procs[pid] = (procs.get(pid) or 0) + used if used is not None else procs.get(pid)
        return GPUBaseline(t=time.perf_counter(), device_used_bytes=[d.used for d in lowest],
                           device_total_bytes=[d.total for d in lowest],
                           device_reserved_bytes=[d.reserved for d in lowest], names=self.device_names(),
                           readings=readings, process_bytes=procs)


def _is_unsupported(exc: Exception) -> bool:
    """NVML says the call does not exist or is not supported here (or the binding is too old for it)."""
    if isinstance(exc, (TypeError, AttributeError)):
        return True
    return getattr(exc, "value", None) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)


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


class _Sampler(threading.Thread):
    def __init__(self, hz: float):
        super().__init__(daemon=True)
        self.period = 1.0 / hz
        self.stop_event = threading.Event()
        self.errors = 0

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
        except Exception:  # the engine may be gone; the runner notices that itself
            self.errors += 1

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
            s.gpu_process_bytes = self.nvml.process_bytes(pids)
            devices = self.nvml.device_memory()
            s.gpu_device_used_bytes = sum(d.used for d in devices)
            s.gpu_device_total_bytes = sum(d.total for d in devices)
            if all(d.reserved is not None for d in devices):
                s.gpu_device_reserved_bytes = sum(d.reserved for d in devices)
            if self.baseline is not None:
                s.gpu_device_over_baseline_bytes = s.gpu_device_used_bytes - self.baseline.used_bytes
        self.samples.append(s)


@dataclass
class KVSample:
    t: float
    kv_bytes_in_use: float | None
    kv_tokens_in_use: float | None


@dataclass
class QueueSample:
    t: float
    waiting: float | None
    running: float | None
    preemptions: float | None  # the engine's cumulative counter


class EnginePoller(_Sampler):
    """The engine's own figures, polled through its adapter (``Backend.poll``) over its own HTTP client:
    KV in use, and its queue (requests waiting, running, preempted: the evidence of the KV boundary)."""

    def __init__(self, backend, hz: float = 10.0):
        super().__init__(hz)
        self.backend = backend
        self.client = httpx.Client(timeout=2.0)
        self.kv_samples: list[KVSample] = []
        self.queue_samples: list[QueueSample] = []
        self.kv_source: str | None = None
        self.queue_source: str | None = None

    def sample(self):
        state = self.backend.poll(self.client)
        now = time.perf_counter()
        if state.kv is not None:
            self.kv_source = state.kv.source
            self.kv_samples.append(KVSample(now, state.kv.bytes, state.kv.tokens))
        if state.queue:
            self.queue_source = state.queue.get("source")
            self.queue_samples.append(QueueSample(now, state.queue.get("waiting"), state.queue.get("running"),
                                                  state.queue.get("preemptions")))

    def stop(self):
        super().stop()
        self.client.close()
