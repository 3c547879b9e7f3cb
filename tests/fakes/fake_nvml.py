"""A stand-in for nvidia-ml-py's ``pynvml`` module: the functions kvbench calls, the same struct shapes
(c_nvmlMemory_t: total/free/used; c_nvmlMemory_v2_t: version/total/reserved/free/used; process info
objects with pid/usedGpuMemory, None where NVML says "not available"), NVMLError with ``.value``, and
device memory and processes programmable over time.

    nv = FakeNVML([FakeDevice("NVIDIA H200", total=141 * GiB, used=lambda t: GiB + (4 * GiB if t > 1 else 0))])
    nv.devices[0].compute[1234] = 2 * GiB      # pid -> bytes, or a function of t, or None
    NVML(module=nv)

``t`` is seconds since the fake was made (or whatever ``clock`` returns). An ``init_error`` makes
nvmlInit raise, as on a machine without the driver or library.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Union

GiB = 1 << 30

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
nvmlMemory_v2 = 0x02000028

_STRINGS = {NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
            NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument"}


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return _STRINGS.get(self.value, f"Unknown Error {self.value}")


Value = Union[int, None, Callable[[float], Union[int, None]]]


def _at(value: Value, t: float):
    return value(t) if callable(value) else value


@dataclass
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass
class c_nvmlMemory_v2_t:
    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass
class ProcessInfo:  # what nvmlStructToFriendlyObject(c_nvmlProcessInfo_v3_t) gives
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeDevice:
    name: str = "NVIDIA H200"
    total: int = 143771 * 1024 * 1024
    used: Value = 0  # allocated bytes (v2 "used"); v1's used = this + reserved
    reserved: int = 512 * 1024 * 1024
    compute: dict[int, Value] = field(default_factory=dict)  # pid -> usedGpuMemory
    graphics: dict[int, Value] = field(default_factory=dict)
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"


class FakeNVML:
    """Module-shaped: pass it where ``pynvml`` would be imported."""

    NVMLError = NVMLError
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    nvmlMemory_v2 = nvmlMemory_v2
    c_nvmlMemory_t = c_nvmlMemory_t
    c_nvmlMemory_v2_t = c_nvmlMemory_v2_t

    def __init__(self, devices: list[FakeDevice] | None = None, *, init_error: int | None = None,
                 v2: str = "ok", graphics: str = "ok", clock: Callable[[], float] | None = None):
        """``v2``: "ok", "not_supported" (driver says so), "missing" (no _v2 symbol) or "old_binding"
        (nvmlDeviceGetMemoryInfo takes no version). ``graphics``: "ok" or "not_supported"."""
        self.devices = devices if devices is not None else [FakeDevice()]
        self.init_error, self.v2, self.graphics = init_error, v2, graphics
        start = time.perf_counter()
        self.clock = clock or (lambda: time.perf_counter() - start)
        self.initialized = False
        self.calls: dict[str, int] = {}

    def _count(self, name: str):
        self.calls[name] = self.calls.get(name, 0) + 1

    def _device(self, handle) -> FakeDevice:
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return self.devices[handle]

    def nvmlInit(self):
        self._count("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self):
        self.initialized = False

    def nvmlSystemGetDriverVersion(self):
        return "570.124.06"

    def nvmlDeviceGetCount(self):
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int):
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetName(self, handle):
        return self._device(handle).name

    def nvmlDeviceGetUUID(self, handle):
        return self._device(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle, version=None, **kwargs):
        if kwargs or (version is not None and self.v2 == "old_binding"):
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'")
        d = self._device(handle)
        used = int(_at(d.used, self.clock()))
        if not version:
            self._count("v1")
            return c_nvmlMemory_t(total=d.total, free=d.total - used - d.reserved, used=used + d.reserved)
        if self.v2 == "missing":
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if self.v2 == "not_supported":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        self._count("v2")
        return c_nvmlMemory_v2_t(version=version, total=d.total, reserved=d.reserved,
                                 free=d.total - used - d.reserved, used=used)

    def _procs(self, table: dict[int, Value]) -> list[ProcessInfo]:
        t = self.clock()
        return [ProcessInfo(pid, None if (v := _at(b, t)) is None else int(v)) for pid, b in table.items()]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._count("compute")
        return self._procs(self._device(handle).compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        self._count("graphics")
        if self.graphics == "not_supported":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self._procs(self._device(handle).graphics)
