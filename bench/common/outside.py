"""What comes from outside kvbench (a server's answers, the environment, a log) made safe to keep: text that
encodes (no lone surrogate: a JSON ``"\\ud800"`` or a byte the environment could not decode), cut to a bound
with a marker of what was cut, and counts within a bound. Every writer (JSON, YAML, Parquet, Markdown) then
takes it as it takes any other text.

Near the bottom of ``kvbench.common``: it imports only ``kvbench.common.redact``."""
from __future__ import annotations

import codecs
import math
import re

from kvbench.common import redact

TEXT_MAX_CHARS = 4_096  # a version, a model name, a message: more is not one of these
LINE_MAX_CHARS = 2_000  # a log line kept in a record
_SURROGATE = re.compile("[\ud800-\udfff]")


def _as_bytes_or_replacement(err: UnicodeEncodeError):
    """A lone surrogate as UTF-8: the byte it stands for where it is one (``surrogateescape``: the environment's
    and a file name's undecodable bytes, decoded again below), else U+FFFD."""
    out = bytearray()
    for ch in err.object[err.start:err.end]:
        code = ord(ch)
        out += bytes([code - 0xDC00]) if 0xDC80 <= code <= 0xDCFF else "\ufffd".encode()
    return bytes(out), err.end


codecs.register_error("kvbench-outside", _as_bytes_or_replacement)


def text(value, limit: int | None = TEXT_MAX_CHARS) -> str:
    """``value`` as text every writer takes: a lone surrogate (from a JSON escape or an undecodable byte) is the
    byte it stands for when that makes UTF-8, else U+FFFD; cut to ``limit`` characters (:func:`cut`)."""
    value = value if isinstance(value, str) else str(value)
    if _SURROGATE.search(value):
        value = value.encode("utf-8", "kvbench-outside").decode("utf-8", "replace")
    return cut(value, limit) if limit is not None else value


def optional_text(value, limit: int | None = TEXT_MAX_CHARS) -> str | None:
    return None if value is None else text(value, limit)


def cut(value: str, limit: int) -> str:
    """``value`` within ``limit`` characters, the cut said: ``... [1,234,567 characters cut]``. Held credentials
    are masked first: a cut through one would leave a prefix the writers' masking no longer recognises."""
    if len(value) <= limit:
        return value
    value = redact.scrub(value)
    if len(value) <= limit:
        return value
    keep = limit - len(f" [... {len(value):,} characters cut]")  # the marker's longest: within the limit
    if keep <= 0:
        return value[:limit]
    return f"{value[:keep]} [... {len(value) - keep:,} characters cut]"


def cut_lines(value: str, limit: int = LINE_MAX_CHARS) -> str:
    """Each line of ``value`` within ``limit`` characters (:func:`cut`)."""
    if len(value) <= limit:
        return value
    return "\n".join(cut(line, limit) for line in value.split("\n"))


def count(value, limit: int) -> int | None:
    """A count or size from outside as an int in 0..``limit``; None for anything else (not a whole number,
    negative, NaN, beyond ``limit``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            return None
        value = int(value)
    if not isinstance(value, int):
        return None
    return value if 0 <= value <= limit else None


def texts(value, limit: int | None = None):
    """``value`` (parsed JSON: dicts, lists, strings, numbers) with every string made :func:`text`."""
    if isinstance(value, str):
        return text(value, limit)
    if isinstance(value, dict):
        return {texts(k, limit): texts(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [texts(v, limit) for v in value]
    return value
