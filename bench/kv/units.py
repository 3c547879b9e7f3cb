"""Byte units, written once: memory is shown in MiB (GiB for whole-GPU sizes), 2 decimals, binary prefixes."""
from __future__ import annotations

import math

MIB = 2**20
GIB = 2**30


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt_bytes(x, missing: str = "-") -> str:
    """``1,234.56 MiB``; ``missing`` for None/NaN."""
    return missing if _missing(x) else f"{x / MIB:,.2f} MiB"


def fmt_gib(x, missing: str = "-") -> str:
    """``12.34 GiB``, for GPU-sized figures (a card, weights, a plan); ``missing`` for None/NaN."""
    return missing if _missing(x) else f"{x / GIB:,.2f} GiB"
