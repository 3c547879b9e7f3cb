"""An engine's server process: started in its own process group with its log in a file, watched, and
stopped with its whole tree. Shared by every adapter that starts a server.

With a memory limit, the whole tree runs inside a memory wall (:mod:`kvbench.common.memory_wall`: a
memory-limited cgroup, the CPU stand-in for a GPU's memory): the server joins it before it execs, so every
page of its tree counts; the guard stays outside. When the wall's OOM killer ended the server,
:meth:`ServerProcess.exit_description` says so; :meth:`ServerProcess.stop` closes the wall."""
from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from kvbench.common import outside
from kvbench.common.memory_wall import MemoryWall, MemoryWallError, cleanup_stale, oom_verdict

from .guard import describe, running, terminate
from .types import LOCALHOST, EngineStartError
from .untimed import bounded_client

GUARD_SCRIPT = Path(__file__).with_name("guard.py")  # run as a script: it imports only psutil
LAUNCHER_SCRIPT = Path(__file__).with_name("launcher.py")  # run as a script: the standard library only
# An environment value an adapter gives for a folder of the server's own (e.g. TMPDIR): made at start, short
# (unix socket paths end at 108 bytes), and removed once the server has stopped or kvbench has died
PRIVATE_TMP = "{kvbench:private-tmp}"
MAX_GUARD_RESTARTS = 5  # a guard that dies this often is not started again (it would fail the same way)
LAUNCHER_FOLLOWS_S = 5.0  # a launcher whose server is gone kills what is left (no grace) and exits
# A server started through a container CLI publishes its port through the runtime (docker-proxy, root's, or
# no process at all with iptables): such a listener, or none, is the container's, never in the tree
CONTAINER_CLIS = frozenset({"docker", "podman", "nerdctl"})
CONTAINER_PROXIES = frozenset({"docker-proxy", "rootlessport", "rootlesskit", "slirp4netns", "pasta", "conmon"})
CMDLINE_HEAD = 100  # characters of a stranger's command line in the one line that refuses it


def free_port(host: str = LOCALHOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        # PR_SET_PDEATHSIG: a harness killed before the launcher has set its own parent-death signal (it
        # then has no child yet) takes the launcher with it
        libc.prctl(1, signal.SIGKILL)
    except OSError:
        pass


def run_in_own_group(argv: list[str], **popen_kwargs) -> int:
    """Run ``argv`` to its end, in a process group of its own that goes with this process: killed (SIGKILL,
    the whole group) when this call ends early (KeyboardInterrupt, including a SIGTERM the caller turns into
    one), and its root killed by the kernel when this process dies (PR_SET_PDEATHSIG). For one-off tools
    such as a model converter, which otherwise ran on for seconds after `kvbench setup` was stopped."""
    proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent, **popen_kwargs)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _is_error_line(line: str) -> bool:
    # llama.cpp marks its errors " E "; Python engines print "...Error: ..." and tracebacks
    return " E " in line or "error" in line.lower() or line.startswith("Traceback")


def last_error_line(log_tail: str) -> str:
    """An engine's own last error line in a log tail, to say in one line why it did not start."""
    lines = [line for line in log_tail.splitlines() if _is_error_line(line)]
    return lines[-1].strip()[-300:] if lines else ""


EXCERPT_HEAD_BYTES = 8 << 20  # of a log, where its first error line is looked for
EXCERPT_TAIL_BYTES = 1 << 20  # and where its last lines are read


def log_excerpt(path: Path, offset: int = 0, lines: int = 40, context: int = 3) -> str:
    """What a log says since byte ``offset``: its first error line with a few lines around it (vLLM names
    the cause of a failed start ~90 lines above the end of its log, under the traceback of every process
    that then gave up) and its last ``lines`` lines. Bounded: the first error is looked for in the first
    8 MiB, the last lines in the last 1 MiB, and each line kept is cut to 2,000 characters, the cut said (a
    64 MiB line was copied whole into the failed rows and run.json)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            if size - offset <= EXCERPT_HEAD_BYTES + EXCERPT_TAIL_BYTES:
                head = tail = f.read(EXCERPT_HEAD_BYTES + EXCERPT_TAIL_BYTES).decode(errors="replace")
            else:
                head = f.read(EXCERPT_HEAD_BYTES).decode(errors="replace")
                f.seek(size - EXCERPT_TAIL_BYTES)
                tail = f.read(EXCERPT_TAIL_BYTES).decode(errors="replace")
    except OSError:
        return ""
    whole = head is tail
    head_lines, tail_lines = head.splitlines(), tail.splitlines()
    last = [outside.cut(line, outside.LINE_MAX_CHARS) for line in tail_lines[-lines:]]
    first = next((i for i, line in enumerate(head_lines) if _is_error_line(line)), None)
    if first is None or (whole and first >= len(head_lines) - lines):
        return "\n".join(last)
    around = [outside.cut(line, outside.LINE_MAX_CHARS)
              for line in head_lines[max(0, first - context):first + context + 1]]
    return "\n".join(["[first error in the log]", *around, "[...]", "[last lines]", *last])


LOG_READ_BYTES = 16 << 20  # of a log read for its figures: this much of its start and of its end


def read_log(path: Path) -> str:
    """An engine's log as text for the parsers of its figures, bounded: its first and last 16 MiB where it is
    longer (the startup figures are at the start, a reload's at the end; a log of one 64 MiB line was read
    whole, every poll). "" where it cannot be read."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= 2 * LOG_READ_BYTES:
                return f.read().decode(errors="replace")
            head = f.read(LOG_READ_BYTES).decode(errors="replace")
            f.seek(size - LOG_READ_BYTES)
            tail = f.read(LOG_READ_BYTES).decode(errors="replace")
    except OSError:
        return ""
    return f"{head}\n[... {size - 2 * LOG_READ_BYTES:,} bytes of the log not read]\n{tail}"


def _reaches(listen_ip: str, host: str | None) -> bool:
    """Whether a socket listening at ``listen_ip`` takes connections made to ``host``: the same address or
    a wildcard one (any address where ``host`` is a name or not given)."""
    try:
        listening, target = ipaddress.ip_address(listen_ip), ipaddress.ip_address(host or "")
    except ValueError:
        return True
    return listening.is_unspecified or listening == target or getattr(listening, "ipv4_mapped", None) == target


def listeners_of(port: int, host: str | None = None) -> list[int | None]:
    """The pids of the processes listening on ``port`` where connections to ``host`` arrive; None for a
    socket whose process this user may not see (another user's, when kvbench is not root)."""
    try:
        sockets = psutil.net_connections(kind="inet")
    except psutil.AccessDenied:  # macOS without root (Linux lets every user list them): nothing to tell
        return []
    return list(dict.fromkeys(c.pid for c in sockets if c.status == psutil.CONN_LISTEN and c.laddr
                              and c.laddr.port == port and _reaches(c.laddr.ip, host)))


def in_tree(pid: int, root: int) -> bool:
    """Whether ``pid`` is of the process tree rooted at ``root`` (the launcher): it, a descendant (the
    launcher is a subreaper, so orphans of the tree stay its descendants), or in its session."""
    if pid == root:
        return True
    try:
        return any(p.pid == root for p in psutil.Process(pid).parents()) or os.getsid(pid) == root
    except (psutil.Error, OSError):  # gone: it serves nothing
        return False


def process_line(pid: int | None) -> str:
    """A process in a few words for a one-line error: "pid 4242 python3 -m http.server 38123"."""
    if pid is None:
        return "another user's, which kvbench may not see"
    try:
        p = psutil.Process(pid)
        words = [p.name(), *p.cmdline()[1:]]
    except psutil.Error:
        return f"pid {pid}"
    return f"pid {pid} " + " ".join(" ".join(words).split())[:CMDLINE_HEAD]  # one line, whatever its arguments hold


def stranger_line(port: int, pid: int | None) -> str:
    return f"port {port} is served by another process ({process_line(pid)}), not the engine kvbench started"


def port_taken(port: int, host: str | None = None) -> str:
    """Right before an engine is spawned on ``port``: the line naming whatever already listens there (it
    would answer the engine's health checks and be benchmarked in its place); empty when nothing does."""
    pids = listeners_of(port, host)
    return stranger_line(port, pids[0]) if pids else ""


class NotReady(Exception):
    def __init__(self, last: str, why: str = ""):
        super().__init__(why or last)
        self.last, self.why = last, why  # what the URL answered last; why waiting stopped early


def wait_http(url: str, timeout_s: float, gone: Callable[[], str] | None = None, interval_s: float = 0.25) -> None:
    """GET ``url`` until it answers 200. :class:`NotReady` after ``timeout_s`` (with what it answered last),
    or at once when ``gone()`` says why waiting is pointless (e.g. the server died)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with bounded_client(2.0) as client:  # a health answer that trickles or never ends is no answer
        while time.monotonic() < deadline:
            if gone and (why := gone()):
                raise NotReady(last, why)
            try:
                response = client.get(url)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(interval_s)
    raise NotReady(last)


class ServerProcess:
    """A server started in a session of its own, logging to a file, with a guard (:mod:`.guard`) that
    records its whole process tree and stops it when told to or when the harness dies.

    ``memory_limit_bytes``: run the whole tree inside a memory wall of that size, made by :meth:`start`
    and removed by :meth:`stop` (this object owns it; :attr:`wall` while it exists, :meth:`wall_record`
    for the run's record). Where no wall can be made, :meth:`start` raises an EngineStartError that says
    why in one line, and nothing is started."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, memory_limit_bytes: int | None = None):
        if memory_limit_bytes is not None and (not isinstance(memory_limit_bytes, int)
                                               or isinstance(memory_limit_bytes, bool) or memory_limit_bytes <= 0):
            raise ValueError(f"a memory limit is a positive number of bytes, not {memory_limit_bytes!r}")
        self.argv, self.env, self.log_path = argv, env, log_path
        self.memory_limit_bytes = memory_limit_bytes
        self.wall: MemoryWall | None = None
        self.wall_error = ""  # why the wall could not be removed at stop() (normally empty)
        self.proc: subprocess.Popen | None = None
        self.guard: subprocess.Popen | None = None
        self.log_offset = 0  # where this start's part of the log begins
        self.survivors: list[dict] = []  # processes of the tree that outlived stop() (normally none)
        self.server_pid: int | None = None  # the server itself, the launcher's child
        self.private_tmp: Path | None = None  # the server's own folder (PRIVATE_TMP), while it exists
        self.guard_restarts: list[dict] = []  # guards that died while the engine ran, each replaced
        self._guard_lock = threading.Lock()
        self._stopping = False

    def _make_wall(self) -> None:
        cleanup_stale()  # the empty walls of harnesses that died (the guard removes them; this is a second net)
        try:
            self.wall = MemoryWall(self.memory_limit_bytes, Path(self.argv[0]).name if self.argv else "server")
        except MemoryWallError as exc:
            raise EngineStartError(str(exc)) from None

    def _preexec(self) -> Callable[[], None]:
        wall = self.wall
        if wall is None:
            return _die_with_parent

        def join_then_die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
            wall.join()  # before exec: every page the server and its children touch is charged to the wall
            _die_with_parent()
        return join_then_die_with_parent

    def start(self) -> None:
        if self.memory_limit_bytes is not None:
            self._make_wall()
        try:
            self._start()
        except BaseException:
            self._close_wall()
            raise

    def _start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.log_offset = log.tell()
        log.write(("$ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        env = {**os.environ, **self.env}
        if PRIVATE_TMP in env.values():
            base = tempfile.gettempdir()
            self.private_tmp = Path(tempfile.mkdtemp(prefix="kvbench-", dir=base if len(base) <= 40 else "/tmp"))
            env = {k: str(self.private_tmp) if v == PRIVATE_TMP else v for k, v in env.items()}
        tmp = ["--tmp", str(self.private_tmp)] if self.private_tmp else []
        pid_read, pid_write = os.pipe()
        try:
            # its own session: Ctrl-C in the terminal reaches the harness only, which then stops it. The root
            # is the launcher (.launcher), which starts the server and takes its tree along when kvbench dies;
            # -I -S: the standard library only, no site-packages (and the script's folder not on sys.path)
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(LAUNCHER_SCRIPT), str(os.getpid()),
                                          str(pid_write), *tmp, "--", *self.argv], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True, preexec_fn=self._preexec(), pass_fds=(pid_write,))
        except (OSError, subprocess.SubprocessError) as exc:  # SubprocessError: the wall refused it before exec
            os.close(pid_read)
            self._remove_private_tmp()
            raise EngineStartError(f"could not start {self.argv[0]}: {exc}") from None
        finally:
            os.close(pid_write)
            log.close()
        with os.fdopen(pid_read) as f:  # written at once after the fork; end of file if the launcher failed
            line = f.readline().strip()
        self.server_pid = int(line) if line.isdigit() else self.proc.pid
        with self._guard_lock:
            self.guard = self._start_guard()
        threading.Thread(target=self._watch_guard, name="kvbench-guard-watch", daemon=True).start()

    def _start_guard(self) -> subprocess.Popen:
        # the guard is in a session of its own too, so that stopping the engine's session spares it; it is
        # outside the wall, and removes the wall when the harness dies
        wall = ["--wall", str(self.wall.path)] if self.wall else []
        # -P: the script's folder is not put on sys.path, where backends/types.py would shadow the standard
        # library's types module (the guard then died at its first import, and guarded nothing)
        return subprocess.Popen([sys.executable, "-P", str(GUARD_SCRIPT), str(self.proc.pid), *wall],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True, text=True)

    def _watch_guard(self) -> None:
        """A guard that dies while the engine runs (killed, out of memory) is replaced at once and recorded
        (:attr:`guard_restarts`). Restarted rather than failing the engine's cells: the guard measures
        nothing, the engine is unharmed, and in the gap the launcher still takes the tree along if the
        harness dies too; a new guard brings back the graceful stop when the harness dies."""
        while True:
            guard = self.guard
            code = guard.wait()
            with self._guard_lock:
                if self._stopping or guard is not self.guard or not self.alive():
                    return  # told to stop, or it ended because the engine did: nothing to restart
                restart = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "guard_pid": guard.pid,
                           "guard_exit": _describe_exit(code)}
                if len(self.guard_restarts) >= MAX_GUARD_RESTARTS:  # a guard that cannot run: the launcher remains
                    self.guard_restarts.append({**restart, "replaced": False})
                    return
                # replaced, then recorded: a restart on record has its new guard in place (recorded first, a
                # reader once saw the restart with the dead guard still there)
                self.guard = self._start_guard()
                self.guard_restarts.append(restart)

    @property
    def pid(self) -> int | None:
        """The server's own process (the launcher's child): its tree is the engine's figures."""
        return self.server_pid if self.proc else None

    def alive(self) -> bool:
        return bool(self.proc and self.proc.poll() is None)

    def log_tail(self, lines: int = 40) -> str:
        """This start's first error line (with context) and its last ``lines`` lines."""
        return log_excerpt(self.log_path, self.log_offset, lines)

    def exit_description(self, wait_s: float = 0.0) -> str:
        if self.proc and self.proc.poll() is None and self.server_pid != self.proc.pid \
                and not _pid_running(self.server_pid):
            # the server is gone and its launcher is ending the rest of the tree: its exit, with the
            # server's status, follows within moments (a cell started in that gap read a vanished pid)
            wait_s = max(wait_s, LAUNCHER_FOLLOWS_S)
        if self.proc and wait_s > 0:
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll() if self.proc else None
        if code is None:
            return ""
        if self.wall and (verdict := oom_verdict(self.wall, code)):
            return verdict  # "out of memory at the 512.0 MiB wall (peak 511.9 MiB)"
        return _describe_exit(code)

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Until ``url`` answers 200; an EngineStartError with the log excerpt when the server dies first, is
        not ready in ``timeout_s``, or what answered is another process than this server (:meth:`stranger_at`)."""
        def gone() -> str:
            return "" if self.alive() else f"server {self.exit_description() or 'not started'} before it was ready"
        try:
            wait_http(url, timeout_s, gone)
        except NotReady as exc:
            raise EngineStartError(exc.why or f"server not ready after {timeout_s:.0f} s ({url}: {exc.last})",
                                   self.log_tail()) from None
        if refusal := self.stranger_at(url):
            raise EngineStartError(refusal, self.log_tail())

    def stranger_at(self, url: str) -> str:
        """Why what answered at ``url`` is not this server (empty when it is): a 200 proves only that
        something listens on the port, so its socket must belong to this server's own tree."""
        parts = urlsplit(url)
        if parts.port is None or self.proc is None:
            return ""
        pids = listeners_of(parts.port, parts.hostname)
        if strangers := [pid for pid in pids if not self._owns(pid)]:
            return stranger_line(parts.port, strangers[0])
        if not pids and not self._in_container():
            return f"port {parts.port} answered, but no process kvbench can see listens on it"
        return ""

    def _in_container(self) -> bool:
        return bool(self.argv) and Path(self.argv[0]).name in CONTAINER_CLIS

    def _owns(self, pid: int | None) -> bool:
        """Whether a listener's process is this server's: of its tree, or its container runtime's proxy
        (root's, unseen when kvbench is not root)."""
        if self._in_container() and (pid is None or _process_name(pid) in CONTAINER_PROXIES):
            return True
        return pid is not None and in_tree(pid, self.proc.pid)

    def wall_record(self) -> dict | None:
        """The memory wall for the run's record (None without one): ``{"limit_bytes", "peak_bytes",
        "oom_kills", "cgroup": "v1"|"v2", "path"}``, plus ``"error"`` where stop() could not remove it. Its
        counters stay readable after stop()."""
        if self.wall is None:
            return None
        record = self.wall.describe()
        if self.wall_error:
            record["error"] = self.wall_error
        return record

    def _close_wall(self) -> list[int]:
        """Kill what is left in the wall and remove it; the pids still in it where it could not be removed."""
        if self.wall is None:
            return []
        try:
            self.wall.close()
            return []
        except MemoryWallError as exc:
            self.wall_error = str(exc)
            return self.wall.pids()

    def _remove_private_tmp(self) -> None:
        if self.private_tmp is not None:
            shutil.rmtree(self.private_tmp, ignore_errors=True)
            self.private_tmp = None

    def stop(self, grace_s: float = 15.0) -> list[dict]:
        """SIGTERM the whole tree, SIGKILL what is left after ``grace_s``; then check that nothing of it
        runs. With a memory wall, then close it: SIGKILL whatever is still in it, remove the group.
        Returns the processes that survived (normally none; also kept in ``survivors``)."""
        if not self.proc:
            self._close_wall()
            return []
        survivors = None
        with self._guard_lock:
            self._stopping = True  # the guard ends now: not to be replaced
        if self.guard and self.guard.poll() is None:
            try:
                out, _ = self.guard.communicate(f"stop {grace_s}\n", timeout=grace_s + 30)
                survivors = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
            except (subprocess.TimeoutExpired, ValueError, OSError):
                self.guard.kill()
        if survivors is None:  # no guard to ask (it died): stop the session from here
            survivors = terminate(self.proc.pid, {}, grace_s)
        try:
            self.proc.wait(timeout=5)  # reap the root (a zombie until its parent, the harness, waits)
        except subprocess.TimeoutExpired:
            pass
        self._remove_private_tmp()
        if self.wall is not None:
            stuck = self._close_wall()
            # the wall killed what the guard could not, unless the wall itself could not be emptied
            survivors = [p for p in survivors if p["pid"] in stuck or _pid_running(p["pid"])]
            known = {p["pid"] for p in survivors}
            survivors += [_describe_pid(pid) for pid in stuck if pid not in known and _pid_running(pid)]
        self.survivors = survivors
        return survivors


def _describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _pid_running(pid: int) -> bool:
    try:
        return running(psutil.Process(pid))
    except psutil.Error:
        return False


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def _describe_pid(pid: int) -> dict:
    try:
        return describe(psutil.Process(pid))
    except psutil.Error:
        return {"pid": pid, "name": "?", "cmdline": ""}
