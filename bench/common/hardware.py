"""The machine: its CPU (model, the instruction sets that change engine speed), its NVIDIA GPUs through NVML
(nvidia-ml-py; ``nvidia-smi`` as a fallback for detection), and the environment record every run keeps.

The engines' recipes ask :func:`has_nvidia_gpu` / :func:`has_nvcc` to choose their CUDA builds;
``KVBENCH_GPU=0`` / ``=1`` overrides the detection (the Makefile sets it from DEVICE).
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import kvbench

# Instruction sets whose presence changes CPU inference speed by several times (bf16 prefill was 10x slower
# on an AVX2-only machine than with AVX-512): recorded with every run, since figures compare only within one.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The :data:`SPEED_FLAGS` this CPU has (empty where /proc/cpuinfo cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in SPEED_FLAGS if f in have]
    except OSError:
        pass
    return []


@dataclass(frozen=True)
class GPUInfo:
    name: str
    memory_bytes: int


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
    # per device (index order), by the same rule: bytes of the set's processes on it, 0 where none is listed,
    # None where they are listed without a figure
    per_device: list[int | None] = field(default_factory=list)


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

    def _ask(self, fn: str, *args):
        """One NVML query, None where the driver, the device or the binding does not answer it."""
        get = getattr(self.nv, fn, None)
        if get is None:
            return None
        try:
            value = get(*args)
        except Exception:
            return None
        return value.decode() if isinstance(value, bytes) else value

    def driver(self) -> dict:
        """The driver's version and the CUDA version it supports, where NVML gives them."""
        cuda = self._ask("nvmlSystemGetCudaDriverVersion")
        return {"driver_version": self._ask("nvmlSystemGetDriverVersion"),
                "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None}

    def clocks(self) -> list[dict]:
        """Per device: SM and memory clocks now and at most (MHz), the power limit (W) and persistence mode,
        where NVML gives them (a clock held low or a lower power cap changes every figure)."""
        out = []
        for h in self.handles:
            sm, mem, gr = (getattr(self.nv, n, None) for n in ("NVML_CLOCK_SM", "NVML_CLOCK_MEM",
                                                                "NVML_CLOCK_GRAPHICS"))
            power = self._ask("nvmlDeviceGetEnforcedPowerLimit", h)
            out.append({"sm_clock_mhz": self._ask("nvmlDeviceGetClockInfo", h, sm) if sm is not None else None,
                        "sm_clock_max_mhz": self._ask("nvmlDeviceGetMaxClockInfo", h, sm) if sm is not None else None,
                        "graphics_clock_mhz": self._ask("nvmlDeviceGetClockInfo", h, gr) if gr is not None else None,
                        "memory_clock_mhz": self._ask("nvmlDeviceGetClockInfo", h, mem) if mem is not None else None,
                        "memory_clock_max_mhz": (self._ask("nvmlDeviceGetMaxClockInfo", h, mem)
                                                 if mem is not None else None),
                        "power_limit_w": power / 1000 if isinstance(power, (int, float)) else None,
                        "persistence_mode": self._ask("nvmlDeviceGetPersistenceMode", h)})
        return out

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
            here, here_known, here_found = 0, False, False
            for pid, used in self._processes(h).items():
                result.pids_listed.add(pid)
                if pid not in pids:
                    continue
                result.pids_found.add(pid)
                here_found = True
                if used is None:
                    result.pids_unknown_bytes.add(pid)
                else:
                    total += used
                    here += used
                    known = here_known = True
            result.per_device.append(here if here_known else (None if here_found else 0))
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


def detect_gpus(nvml=None) -> list[GPUInfo]:
    """The NVIDIA GPUs of this machine: NVML first, else `nvidia-smi`; [] without one."""
    nvml = nvml if nvml is not None else NVML()
    if nvml.available:
        return [GPUInfo(d["name"], d["memory_bytes"]) for d in nvml.devices()]
    if nvml.nv is not None or shutil.which("nvidia-smi") is None:  # NVML answered (no device), or no tool
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    if out.returncode == 0:
        for line in out.stdout.splitlines():
            name, _, mib = line.rpartition(",")
            if name.strip() and mib.strip().isdigit():
                gpus.append(GPUInfo(name.strip(), int(mib) * 2**20))
    return gpus


@functools.lru_cache(maxsize=1)
def _gpu_detected() -> bool:
    return bool(detect_gpus())


def has_nvidia_gpu() -> bool:
    """True on a machine with an NVIDIA GPU: the engines' recipes then install their CUDA builds.
    KVBENCH_GPU=1/0 overrides the detection (read on every call; the detection runs once)."""
    forced = os.environ.get("KVBENCH_GPU", "").strip().lower()
    if forced in ("1", "yes", "true", "gpu"):
        return True
    if forced in ("0", "no", "false", "cpu"):
        return False
    return _gpu_detected()


def has_nvcc() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


#: Environment variables that set how many threads the engines' math libraries and runtimes use.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                    "VLLM_CPU_KVCACHE_SPACE", "LLAMA_ARG_THREADS", "TORCH_NUM_THREADS")


def threads_info() -> dict:
    """The threads this process may use: the CPUs it is allowed to run on (affinity, e.g. a container's
    quota or taskset) and the thread-count variables that the engines inherit (unset: None)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = None
    return {"cpus_allowed": allowed, **{v: os.environ.get(v) for v in THREAD_VARIABLES}}


def gpu_info(nvml: NVML) -> list[dict]:
    """run.json's ``gpus``: per device name, memory, driver, CUDA version and clocks, where NVML gives them."""
    if not nvml.available:
        return []
    driver = nvml.driver()
    return [{**d, **driver, **c} for d, c in zip(nvml.devices(), nvml.clocks())]


def hardware_key(env: dict) -> dict:
    """What two runs must share to be compared as "the same hardware": the CPU model, its speed flags (where
    the run recorded them), its core count and the CPUs the run could use, and each GPU's name (the
    driver is software: :func:`driver_differences`). Fields a run did not record are left out."""
    key = {"cpu": env.get("cpu"), "cpu_count": env.get("cpu_count"),
           "gpus": [g.get("name") for g in env.get("gpus") or []]}
    if "cpu_flags" in env:
        key["cpu_flags"] = sorted(env["cpu_flags"])
    if (env.get("threads") or {}).get("cpus_allowed") is not None:
        key["cpus_allowed"] = env["threads"]["cpus_allowed"]
    return key


def driver_differences(a: dict, b: dict) -> list[str]:
    """The GPU driver versions of two environment records, where both recorded them and they differ (a
    driver upgrade is a change one may mean to measure, so compare warns about it and does not refuse)."""
    def drivers(env):
        return sorted({g.get("driver_version") for g in env.get("gpus") or [] if g.get("driver_version")})

    da, db = drivers(a), drivers(b)
    return [f"GPU driver: {da} vs {db}"] if da and db and da != db else []


def hardware_differences(a: dict, b: dict) -> list[str]:
    """How the machines of two environment records differ ("" when they look alike), one line per field
    that both recorded; a field only one of them recorded is named as not comparable."""
    ka, kb = hardware_key(a), hardware_key(b)
    out = []
    for field_ in dict.fromkeys([*ka, *kb]):
        if field_ in ka and field_ in kb:
            if ka[field_] != kb[field_]:
                out.append(f"{field_}: {ka[field_]} vs {kb[field_]}")
    return out


def hardware_line(env: dict) -> str:
    """One line for a caption: CPU, cores, its speed flags, threads allowed, RAM, GPUs with driver and clock."""
    flags = env.get("cpu_flags")
    flag_text = ("flags " + " ".join(flags) if flags else "no AVX2/AVX-512/AMX") if flags is not None \
        else "flags not recorded"
    allowed = (env.get("threads") or {}).get("cpus_allowed")
    cores = f"{env.get('cpu_count', '?')} cores" + (f" ({allowed} allowed)" if allowed and allowed != env.get(
        "cpu_count") else "")
    gpus = []
    for g in env.get("gpus") or []:
        extra = ", ".join(x for x in (f"driver {g['driver_version']}" if g.get("driver_version") else "",
                                      f"SM {g['sm_clock_max_mhz']} MHz max" if g.get("sm_clock_max_mhz") else "")
                          if x)
        gpus.append(g.get("name", "?") + (f" ({extra})" if extra else ""))
    return (f"{env.get('cpu', '?')}, {cores}, {flag_text}, {(env.get('memory_bytes') or 0) / 2**30:.0f} GiB RAM, "
            f"GPU: {', '.join(gpus) or 'none'}")


def environment_info() -> dict:
    """What a run records about the machine and the harness (run.json's ``environment``): the CPU with the
    instruction-set flags that change engine speed (:data:`SPEED_FLAGS`), the threads it could use, the
    GPUs with their driver and clocks."""
    nvml = NVML()
    gpus = gpu_info(nvml)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return {"kvbench_version": kvbench.__version__, "kvbench_commit": commit, "python": platform.python_version(),
            "os": platform.platform(), "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "threads": threads_info(), "gpus": gpus,
            "nvml": nvml.error or "ok"}


