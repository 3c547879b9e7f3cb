"""Crash-safe file writes for the results folder.

A rewritten file (run.json, a timeline, a Parquet copy, a report) goes to a temporary file in the same
folder, is fsynced and then renamed over the old one: a crash or a full disk leaves the old file or the
new one, never a truncated mix. An appended line (cells.jsonl, requests.jsonl) goes out in one write and
is fsynced; if the write fails the file is cut back to its previous size, so a failed append leaves no
partial line behind.
"""
from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

# letters, digits, '.', '_', '-', not starting with '.': a name that stays one folder or file name
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
PLAIN_NAME_MAX = 200  # well under the 255-byte file-name limit, with room for suffixes such as ".csv"


class PlainNameError(ValueError):
    """A run id, workload name or similar is not a plain folder/file name."""


def check_plain_name(value: str, what: str) -> str:
    """``value`` when it is a plain name (letters, digits, '.', '_', '-', not starting with '.', at most
    200 characters); else :class:`PlainNameError` naming ``what``. Such a name cannot leave the folder it
    is joined to: no '/', no '..', not absolute."""
    if not isinstance(value, str) or not _PLAIN_NAME.fullmatch(value) or len(value) > PLAIN_NAME_MAX:
        raise PlainNameError(f"{what} {value!r} is not a plain name: use letters, digits, '.', '_' and '-' "
                             f"(at most {PLAIN_NAME_MAX}, not starting with '.')")
    return value


def _read_umask() -> int:
    """The process umask, read once at import: setting it to read it back is not thread-safe."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK = _read_umask()


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: some filesystems cannot fsync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same folder, fsync, ``os.replace``.
    On any error the old file (if any) is untouched and the temp file is removed; the OSError propagates."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # keep the old file's permissions (mkstemp makes 0600)
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """:func:`atomic_write_bytes` for text."""
    atomic_write_bytes(path, text.encode(encoding))


def append_line(path: str | Path, line: str) -> None:
    """Append one line (``line`` without its newline) in one ``write`` and fdatasync it.

    If the file ends in a torn line (a crash cut the last append short), a newline goes first so that the
    new line stays whole and the torn one stays a separate (skipped) line. If writing fails (disk full,
    quota) the file is truncated back to its previous size and the OSError propagates."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        data = line.encode() + b"\n"
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        try:
            written = os.write(fd, data)
            while written < len(data):  # a short write: the disk filled up mid-line; the next write says why
                n = os.write(fd, data[written:])
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += n
            os.fdatasync(fd)
        except OSError:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)

