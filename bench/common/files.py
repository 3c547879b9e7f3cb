"""Crash-safe file writes for the results folder.

A rewritten file (run.json, a timeline, a Parquet copy, a report) goes to a temporary file in the same
folder, is fsynced and then renamed over the old one: a crash or a full disk leaves the old file or the
new one, never a truncated mix. An appended line (cells.jsonl, requests.jsonl) goes out in one write and
is fsynced; if the write fails the file is cut back to its previous size, so a failed append leaves no
partial line behind.

An output at a path the user gave (``kvbench report -o``, ``--html``, ``compare -o``/``--json``/``--html``,
``validate --into``) is written only as a new regular file or over a file kvbench made, recognised by its
first bytes (:func:`check_output`): never through a symbolic link, never onto a FIFO, device or socket
(as root, ``-o /dev/null`` once replaced the machine's /dev/null), never over someone else's file.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Callable

from kvbench.kv.bounded import file_kind

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
NEW_FILE_MODE = 0o666 & ~_UMASK  # what open() gives a new file; mkstemp's 0600 is changed to this


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


class OutputRefused(ValueError):
    """An output path kvbench will not write (a symbolic link, a special file, a folder, a file it did not
    make): one line that says which and why; nothing was written."""


HEAD_BYTES = 4096  # what is read of an existing file to tell whether kvbench made it

def kvbench_markdown(head: bytes) -> bool:
    """A report or comparison kvbench wrote: its first line is "# kvbench run(s) ..." or "# kvbench compare: ..."."""
    return head.startswith((b"# kvbench run", b"# kvbench compare"))


def kvbench_html(head: bytes) -> bool:
    """A kvbench page: its head carries the ``kvbench-tables`` meta tag (bench/reports/html.py)."""
    return b'<meta name="kvbench-tables"' in head


def kvbench_png(head: bytes) -> bool:
    """A plot kvbench drew: a PNG whose metadata names matplotlib (its tEXt chunk follows the header)."""
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"Matplotlib" in head


def kvbench_json(head: bytes) -> bool:
    """A comparison's JSON (``kvbench compare --json``): its first key names kvbench's compare schema."""
    return head.lstrip().startswith(b"{") and b'"schema": "kvbench.compare/' in head[:200]


def kvbench_jsonl(head: bytes) -> bool:
    """A table of ``kvbench validate`` (kv_validation.jsonl, kv_families.jsonl): rows led by the engine."""
    return head.startswith(b'{"engine": ')


def check_output(path: str | Path, made_by_kvbench: Callable[[bytes], bool], what: str = "output") -> None:
    """Nothing when ``path`` may be written: it does not exist, or it is a regular file that is empty or
    whose first bytes ``made_by_kvbench`` recognises. Else :class:`OutputRefused`: a symbolic link (not
    followed), a FIFO, device, socket or folder, or another program's file. Only reads (a FIFO is never
    opened)."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputRefused(f"{what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise OutputRefused(f"{what} {path} is a symbolic link: kvbench writes no file through one "
                            f"(give the path it points to, or a new one)")
    if not stat.S_ISREG(mode):
        raise OutputRefused(f"{what} {path} is {file_kind(mode)}, not a regular file: kvbench writes only new "
                            f"files or its own (give a file path)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            head = os.read(fd, HEAD_BYTES)
        finally:
            os.close(fd)
    except OSError as exc:
        raise OutputRefused(f"{what} {path}: {exc.strerror}") from None
    if head and not made_by_kvbench(head):  # an empty file holds nothing to lose
        raise OutputRefused(f"{what} {path} exists and kvbench did not write it: give a new path, or remove it "
                            f"first")


def check_output_folder(folder: str | Path, what: str = "output folder",
                        files: dict[str, Callable[[bytes], bool]] | None = None) -> None:
    """Nothing when ``folder`` may hold outputs: absent, or a folder (a link to one is followed: results on
    another disk are common); and each of ``files`` ({name: recogniser}) in it absent or kvbench's
    (:func:`check_output`). Else :class:`OutputRefused`."""
    folder = Path(folder)
    try:
        mode = os.stat(folder).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputRefused(f"{what} {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(mode):
        raise OutputRefused(f"{what} {folder} is {file_kind(mode)}, not a folder")
    for name, recognise in (files or {}).items():
        check_output(folder / name, recognise, "output")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same folder, fsync, ``os.replace``.
    On any error the old file (if any) is untouched and the temp file is removed; the OSError propagates.
    A symbolic link or special file (FIFO, device, socket) at ``path`` is never replaced: OSError
    (EEXIST), nothing written."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise OSError(errno.EEXIST, f"{os.strerror(errno.EEXIST)}: {file_kind(mode)} there, not replaced", str(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # keep the old file's permissions (mkstemp makes 0600)
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, NEW_FILE_MODE)
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

