"""A memory wall for an engine's process tree: a memory-limited cgroup, the CPU stand-in for a GPU's memory.

A process tree put in the wall is charged for every page it touches (its children inherit the group);
past the limit the kernel's OOM killer kills a process of the tree by SIGKILL, and the group's counters
say so (``oom_kill``) and how high it got (the peak). Swap is closed to the group, so swapping does not
hide the wall. Needs root (or a delegated group) and a writable memory controller: cgroup v1's
``memory`` hierarchy or cgroup v2 with ``memory`` enabled for its children; :func:`detect` says which,
or why no wall can be made here (:class:`MemoryWallError`).

Pure standard library: the harness and the guard can both import it.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import signal
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Self

__all__ = ["MemoryWall", "MemoryWallError", "cleanup_stale", "detect", "format_bytes", "oom_verdict",
           "parse_size"]

PARENT = "kvbench"  # every wall's group is made under this folder of the hierarchy
MIB = 2**20
GIB = 2**30
CLOSE_KILL_S = 10.0  # close(): how long to wait for the group's processes to end
RMDIR_RETRY_S = 2.0  # close(): how long to retry an rmdir the kernel answers EBUSY (exit still in progress)


class MemoryWallError(Exception):
    """No memory wall can be made here (or a wall could not be removed); the message says why, in one line."""


# --- sizes ----------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(?:i?B)?|B)?\s*$", re.IGNORECASE)
_UNIT = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str) -> int:
    """Bytes in ``text``: "1000000", "512M", "1.5G", "2GiB", "800MiB", "64KB". Units are binary
    (K, M, G, T = 1024**n) with or without "iB"/"B"; a bare number is bytes (and must be whole)."""
    m = _SIZE.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"not a size: {text!r} (want bytes, or a number with K, M, G or T, "
                         f"e.g. 1000000, 512M, 1.5G, 2GiB, 800MiB)")
    number, unit = m.group(1), (m.group(2) or "").upper()
    try:
        value = Decimal(number) * (1024 ** _UNIT[unit])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"not a size: {text!r}") from None
    if value != value.to_integral_value() and not unit:
        raise ValueError(f"not a size: {text!r} (a number of bytes must be whole)")
    return int(value)


def format_bytes(n: float) -> str:
    """"200.0 MiB" below 1 GiB, "1.5 GiB" from there: one decimal, binary units, as every wall message."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


# --- finding a hierarchy --------------------------------------------------------------------------
def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, options) of every cgroup mount this process sees."""
    found = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                    # the kernel writes a space in a mount point as \040
                    found.append((parts[1].replace("\\040", " "), parts[2], set(parts[3].split(","))))
    except OSError:
        pass
    return found


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: Path, value: str) -> None:
    # one write(2) of the whole value: cgroup files take a value per write
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _make_parent(base: Path) -> Path:
    parent = base / PARENT
    try:
        parent.mkdir(exist_ok=True)
    except OSError as exc:
        who = "" if os.geteuid() == 0 else f" (not root: uid {os.geteuid()})"
        raise MemoryWallError(f"cannot make a memory wall: mkdir {parent} failed{who}: {exc.strerror}; "
                              f"needs root or a cgroup delegated to this user") from None
    if not os.access(parent, os.W_OK | os.X_OK):  # made earlier, by someone else
        raise MemoryWallError(f"cannot make a memory wall: {parent} is not writable by uid {os.geteuid()}; "
                              f"needs root or a cgroup delegated to this user")
    return parent


def _v2_ready(base: Path) -> str:
    """Empty when a memory-limited group can be made under ``base`` (cgroup v2), else what is missing."""
    try:
        controllers = _read(base / "cgroup.controllers").split()
        enabled = _read(base / "cgroup.subtree_control").split()
    except OSError as exc:
        return f"cgroup v2 at {base} unreadable ({exc.strerror})"
    if "memory" not in controllers:
        return (f"cgroup v2 at {base} has no memory controller (controllers: {' '.join(controllers) or 'none'}; "
                f"it is held by cgroup v1 or not available)")
    if "memory" not in enabled:
        return (f"cgroup v2 at {base} has memory but not in its cgroup.subtree_control "
                f"(enable it: echo +memory > {base / 'cgroup.subtree_control'})")
    return ""


def _locate() -> tuple[str, Path]:
    """("v1"|"v2", the mount point a wall's parent folder goes under), or MemoryWallError."""
    found: list[str] = []
    candidates: list[tuple[str, Path]] = []
    mounts = _mounts()
    for point, fstype, opts in mounts:
        if fstype != "cgroup2":
            continue
        base = Path(point)
        if "ro" in opts:
            found.append(f"cgroup v2 at {base} is mounted read-only")
        elif why := _v2_ready(base):
            found.append(why)
        else:
            candidates.append(("v2", base))
    for point, fstype, opts in mounts:
        if fstype != "cgroup" or "memory" not in opts:
            continue
        base = Path(point)
        if "ro" in opts:
            found.append(f"cgroup v1 memory at {base} is mounted read-only")
        elif not (base / "memory.limit_in_bytes").exists():
            found.append(f"cgroup v1 memory at {base} has no memory.limit_in_bytes")
        else:
            candidates.append(("v1", base))
    if not any(fstype == "cgroup" and "memory" in opts for _, fstype, opts in mounts):
        found.append("no cgroup v1 memory hierarchy mounted")
    if not any(fstype == "cgroup2" for _, fstype, _ in mounts):
        found.append("no cgroup v2 hierarchy mounted")
    if not candidates:
        raise MemoryWallError("cannot make a memory wall: " + "; ".join(found) +
                              "; needs root and a writable cgroup memory controller "
                              "(v1 memory hierarchy, or v2 with +memory in cgroup.subtree_control)")
    last: MemoryWallError | None = None
    for kind, base in candidates:
        try:
            parent = _make_parent(base)
            # v2: the parent holds no process, so its children may have the controller
            if kind == "v2" and "memory" not in _read(parent / "cgroup.subtree_control").split():
                _write(parent / "cgroup.subtree_control", "+memory")
            return kind, base
        except MemoryWallError as exc:
            last = exc
        except OSError as exc:
            last = MemoryWallError(f"cannot make a memory wall: enabling memory in {base / PARENT} failed: "
                                   f"{exc.strerror}")
    assert last is not None
    raise last


def detect() -> str:
    """"v1" or "v2": the cgroup hierarchy that makes a memory-limited group here (its "kvbench" parent
    folder is made if missing). MemoryWallError, saying what was found and what is needed, where none can."""
    return _locate()[0]


# --- the wall -------------------------------------------------------------------------------------
def _signalled_kill(code) -> bool:
    """Whether an exit status is death by SIGKILL: Popen's -9, a shell's 137, or signal.SIGKILL itself."""
    if isinstance(code, signal.Signals):
        return code == signal.SIGKILL
    return isinstance(code, int) and code in (-signal.SIGKILL, 128 + signal.SIGKILL)


class MemoryWall:
    """A uniquely named memory-limited group: ``with MemoryWall(parse_size("512M"), "vllm") as wall``,
    then put the server in it (:meth:`join` as its ``preexec_fn``, or :meth:`add` with its pid before it
    allocates). :meth:`close` kills what is left in it and removes it."""

    def __init__(self, limit_bytes: int, name: str = "wall"):
        if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes <= 0:
            raise ValueError(f"a memory wall needs a positive number of bytes, not {limit_bytes!r}")
        self.kind, base = _locate()
        self.limit_bytes = limit_bytes
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] or "wall"
        self.path = base / PARENT / f"{safe}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.path.mkdir()  # never exist_ok: two walls never share a group
        except OSError as exc:
            raise MemoryWallError(f"cannot make a memory wall: mkdir {self.path} failed: {exc.strerror}") from None
        self._procs = os.fsencode(self.path / "cgroup.procs")
        self._closed = False
        self._sampled = 0
        self._final: dict | None = None  # the counters as close() last read them
        try:
            self._configure()
            self._oom_base = self._read_oom_kills()
        except BaseException:
            try:
                self._remove()
            except OSError:
                pass
            raise

    def _configure(self) -> None:
        p, limit = self.path, str(self.limit_bytes)
        try:
            if self.kind == "v1":
                _write(p / "memory.limit_in_bytes", limit)
                if (p / "memory.memsw.limit_in_bytes").exists():  # memory+swap: swapping is no way round it
                    _write(p / "memory.memsw.limit_in_bytes", limit)
                elif (p / "memory.swappiness").exists():  # no swap accounting: keep the group off swap
                    _write(p / "memory.swappiness", "0")
                # inherited from the parent: with it set, the tree would hang at the wall instead of dying
                if re.search(r"^oom_kill_disable 1$", _read(p / "memory.oom_control"), re.MULTILINE):
                    _write(p / "memory.oom_control", "0")
                set_to = int(_read(p / "memory.limit_in_bytes"))
            else:
                _write(p / "memory.max", limit)
                if (p / "memory.swap.max").exists():
                    _write(p / "memory.swap.max", "0")
                # one OOM kill of the process that grew, as in v1; close() stops the rest of the tree
                if (p / "memory.oom.group").exists() and _read(p / "memory.oom.group").strip() != "0":
                    _write(p / "memory.oom.group", "0")
                raw = _read(p / "memory.max").strip()
                set_to = 2**63 if raw == "max" else int(raw)
        except OSError as exc:
            raise MemoryWallError(f"cannot set a {format_bytes(self.limit_bytes)} memory limit on {p}: "
                                  f"{exc.strerror or exc}") from None
        if set_to > self.limit_bytes:  # the kernel rounds down to whole pages, never up
            raise MemoryWallError(f"memory limit on {p} reads {set_to} bytes after writing {self.limit_bytes}")

    # --- membership -------------------------------------------------------------------------------
    def add(self, pid: int) -> None:
        """Put process ``pid`` in the wall; the processes it starts from now on are in it too. Memory it
        already holds stays charged where it was, so add the server before it allocates."""
        if pid == os.getpid():
            raise ValueError("the harness itself must stay outside the wall (close() kills what is in it)")
        self._check_open()
        try:
            _write(self.path / "cgroup.procs", str(pid))
        except ProcessLookupError:
            raise
        except OSError as exc:
            raise MemoryWallError(f"cannot put pid {pid} in {self.path}: {exc.strerror or exc}") from None

    def join(self) -> None:
        """Put the calling process in the wall: for ``subprocess.Popen(preexec_fn=wall.join)``, so the
        server is in it before exec and every page of its tree counts. Only system calls: fit for a
        forked child."""
        fd = os.open(self._procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")  # 0: the writing process
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        """The processes in the wall now."""
        if self._closed:
            return []
        try:
            return [int(x) for x in _read(self.path / "cgroup.procs").split()]
        except FileNotFoundError:
            return []

    # --- counters ---------------------------------------------------------------------------------
    def _read_int(self, name: str) -> int | None:
        try:
            return int(_read(self.path / name).strip())
        except (OSError, ValueError):
            return None

    def _read_oom_kills(self) -> int:
        name, key = ("memory.oom_control", "oom_kill") if self.kind == "v1" else ("memory.events", "oom_kill")
        try:
            text = _read(self.path / name)
        except OSError:
            return 0
        m = re.search(rf"^{key} (\d+)$", text, re.MULTILINE)
        return int(m.group(1)) if m else 0

    def usage_bytes(self) -> int:
        """Memory charged to the wall now (0 once closed)."""
        if self._closed:
            return 0
        return self._read_int("memory.usage_in_bytes" if self.kind == "v1" else "memory.current") or 0

    def unreclaimable_bytes(self) -> int | None:
        """What the wall holds now that the kernel cannot reclaim without swap: anonymous memory and shared
        memory (memory.stat: v1 total_rss + total_shmem, v2 anon + shmem); the rest (file pages: the
        weights a server mmaps, its libraries) is given back at the wall. None once closed or unreadable."""
        return self._stat_sum(("total_rss", "total_shmem") if self.kind == "v1" else ("anon", "shmem"))

    def resident_bytes(self) -> int | None:
        """What the wall's processes hold and use now: :meth:`unreclaimable_bytes` plus the file pages they map
        (memory.stat: v1 total_mapped_file, v2 file_mapped; a server's mmapped weights, its libraries), which
        the kernel can take back at the wall only by reading them again on the next touch. The page cache of
        files read and closed is left out. None once closed or unreadable."""
        return self._stat_sum(("total_rss", "total_shmem", "total_mapped_file") if self.kind == "v1"
                              else ("anon", "shmem", "file_mapped"))

    def _stat_sum(self, keys: tuple[str, ...]) -> int | None:
        """The sum of ``keys`` in the wall's memory.stat (None once closed or unreadable)."""
        if self._closed:
            return None
        try:
            stat = dict(line.split() for line in _read(self.path / "memory.stat").splitlines() if " " in line)
        except OSError:
            return None
        return sum(int(stat.get(k, 0)) for k in keys)

    def sample(self) -> int:
        """Read the usage now and keep its maximum: the peak where the kernel keeps none (v2 before 5.19).
        Harmless to call where it does."""
        used = self.usage_bytes()
        self._sampled = max(self._sampled, used)
        return used

    def peak_bytes(self) -> int:
        """The most memory the wall's processes held at once since it was made."""
        if self._final is not None:
            return self._final["peak_bytes"]
        kept = self._read_int("memory.max_usage_in_bytes" if self.kind == "v1" else "memory.peak")
        if kept is not None:
            return kept
        return max(self._sampled, self.sample())

    def oom_kills(self) -> int:
        """How many processes the OOM killer killed in the wall since it was made."""
        if self._final is not None:
            return self._final["oom_kills"]
        return self._read_oom_kills() - self._oom_base

    def describe(self) -> dict:
        """The wall for the run's record."""
        return {"limit_bytes": self.limit_bytes, "peak_bytes": self.peak_bytes(), "oom_kills": self.oom_kills(),
                "cgroup": self.kind, "path": str(self.path)}

    # --- the end ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MemoryWallError(f"the memory wall {self.path} is closed")

    def _remove(self) -> None:
        deadline = time.monotonic() + RMDIR_RETRY_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        """SIGKILL every process still in the wall, wait (up to 10 s) until it is empty, and remove the
        group. The counters stay readable afterwards. Idempotent; a group already removed is no error."""
        if self._closed:
            return
        if not self.path.exists():  # removed behind our back: nothing left to read or kill
            if self._final is None:
                self._final = {"peak_bytes": self._sampled, "oom_kills": 0}
            self._closed = True
            return
        self.sample()
        try:
            _write(self.path / "cgroup.kill", "1")  # v2 since 5.14: the whole group at once, forks included
        except OSError:
            pass
        deadline = time.monotonic() + CLOSE_KILL_S
        left = self.pids()
        while left and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.02)
            left = self.pids()
        self._final = None  # read the kernel's counters, not an earlier close()'s
        self._final = {"peak_bytes": self.peak_bytes(), "oom_kills": self.oom_kills()}
        try:
            self._remove()
            self._closed = True
        except OSError as exc:  # left open: close() may be tried again
            raise MemoryWallError(f"cannot remove the memory wall {self.path}: {exc.strerror or exc}"
                                  + (f" (pids still in it: {' '.join(map(str, left))})" if left else "")) from None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except MemoryWallError:
            if exc_type is None:
                raise  # else the error that ended the block is the one to see

    def __repr__(self) -> str:
        return f"MemoryWall({format_bytes(self.limit_bytes)}, {self.kind}, {self.path})"


def oom_verdict(wall: MemoryWall, exit_code_or_signal=None) -> str | None:
    """Why the server ended, when the wall ended it: "out of memory at the 512.0 MiB wall (peak 511.9 MiB)"
    when the OOM killer killed a process in the wall, else None. ``exit_code_or_signal`` is the server's
    exit (Popen's returncode, -9 for SIGKILL; a shell's 137; a signal.Signals; None while it runs): when
    the victim was not the server itself, the text says how the server ended."""
    kills = wall.oom_kills()
    if kills <= 0:
        return None
    text = f"out of memory at the {format_bytes(wall.limit_bytes)} wall (peak {format_bytes(wall.peak_bytes())}"
    code = exit_code_or_signal
    if _signalled_kill(code):
        return text + ")"
    if code is None:
        how = "still running"
    elif isinstance(code, signal.Signals):
        how = f"killed by {code.name}"
    elif code < 0:
        how = f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"ended {code}"
    else:
        how = f"exited with code {code}"
    victims = f"{kills} process{'es' if kills > 1 else ''}"
    return text + f"; the OOM killer killed {victims} of the tree, the server {how})"

def cleanup_stale() -> list[str]:
    """Remove the empty walls left by harnesses that died (their pid, in the name, no longer runs); the
    paths removed. A wall whose processes still run is left alone."""
    try:
        _, base = _locate()
    except MemoryWallError:
        return []
    removed = []
    for group in (base / PARENT).iterdir():
        m = re.search(r"-(\d+)-[0-9a-f]{8}$", group.name)
        if not m or not group.is_dir() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        try:
            if not _read(group / "cgroup.procs").split():
                group.rmdir()
                removed.append(str(group))
        except OSError:
            continue
    return removed
