"""What the GPU checks share: the checkout they run from, the agreement tolerances, the table cells, the time
budget and the embedded model."""
from __future__ import annotations

import time
from pathlib import Path

from kvbench.kv.units import MIB

# The checkout: results/gpu/ and tests/data/configs are under it, and `kvbench run` runs in it.
ROOT = Path(__file__).resolve().parents[2]
# Agreement: the allocator holds the cache tensors rounded up to 512-byte blocks; NVML sees whole
# segments the caching allocator reserved (2 MiB granularity, 20 MiB for large blocks, fragmentation).
ALLOCATOR_REL, ALLOCATOR_ABS = 0.01, 4 * MIB
NVML_REL, NVML_ABS = 0.05, 64 * MIB


def within(measured: float | None, expected: float | None, rel: float, abs_: float) -> bool | None:
    if measured is None or expected is None:
        return None
    return abs(measured - expected) <= max(rel * abs(expected), abs_)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def fmt_ok(x: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "-"}[x]


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def embedded_hf_dir(python: str) -> Path:
    """The embedded model's HF-format folder; the CUDA torch interpreter ``python`` converts the GGUF once if
    needed (offline: a local conversion). Raises kvbench.common.models.ModelError."""
    from kvbench.common import models
    from kvbench.selfcheck.engines import transformers_adapter

    return models.resolve("smollm2", transformers_adapter().gguf_converter(python=Path(python)), log=print).hf_dir
