"""The guard of one engine's process tree: a small process beside the harness that records every process
of the engine's tree while it runs and stops them all when told to, or when the harness dies.

Why a process of its own: the engine's server is started in a session of its own (so Ctrl-C in the
terminal reaches the harness only), and a parent-death signal reaches only the server's root process:
vLLM's EngineCore and workers, and any process re-parented to PID 1 after its parent died, would outlive
a killed harness. The guard reads its stdin from a pipe the harness holds; when the harness dies, for any
reason (SIGKILL included), the pipe closes and the guard stops the tree.

The guard's sid is the launcher's pid (:mod:`.launcher`, the root of the tree, which takes the tree along
when the harness dies even if this guard was killed first); a guard that dies while the harness lives is
replaced by the harness (:class:`~kvbench.backends.process.ServerProcess`) and recorded.

A process belongs to the tree when it is in the engine's session (the session id is the server's pid), or
when it was ever seen as a descendant of the server (a process that left the session with setsid is still
recorded). Recorded processes are matched by pid *and* start time, so a reused pid is never signalled.

Protocol on stdin: ``stop GRACE_S`` stops the tree (SIGTERM, SIGKILL after GRACE_S) and prints one JSON
line: the processes that survived (normally none). End of input does the same with a 5 s grace.
``--wall PATH`` (the tree runs in a memory wall, a cgroup the guard itself is outside of): at end of input
the guard also kills what is left in that group and removes it, as the dead harness no longer can (on
``stop`` the harness removes it itself, after reading its counters).
Imports only the standard library and psutil: it starts in a fraction of a second.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import psutil

Recorded = dict[int, float]  # pid -> create_time


def running(p: psutil.Process) -> bool:
    try:
        # a zombie has ended: only its parent's wait() is missing (the harness reaps the server's root)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def session_members(sid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) == sid:
                members.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def record(sid: int, recorded: Recorded) -> None:
    """Add the server's descendants and its session's members to ``recorded``."""
    found = session_members(sid)
    try:
        found += psutil.Process(sid).children(recursive=True)
    except psutil.Error:
        pass
    for p in found:
        try:
            recorded.setdefault(p.pid, p.create_time())
        except psutil.Error:
            continue


def tree(sid: int, recorded: Recorded) -> list[psutil.Process]:
    """Every live process of the tree: the session's members and the recorded processes still running."""
    procs = {p.pid: p for p in session_members(sid)}
    for pid, created in recorded.items():
        if pid in procs:
            continue
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01:  # the same process, not a reused pid
                procs[pid] = p
        except psutil.Error:
            continue
    return [p for p in procs.values() if running(p)]


def describe(p: psutil.Process) -> dict:
    try:
        return {"pid": p.pid, "name": p.name(), "cmdline": " ".join(p.cmdline())[:200]}
    except psutil.Error:
        return {"pid": p.pid, "name": "?", "cmdline": ""}


def terminate(sid: int, recorded: Recorded, grace_s: float, poll_s: float = 0.05) -> list[dict]:
    """SIGTERM the session's process group and every process of the tree, SIGKILL what is left after
    ``grace_s``; the processes still running after that (normally none), described."""
    record(sid, recorded)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(sid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in tree(sid, recorded):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait_s
        while (alive := tree(sid, recorded)) and time.monotonic() < deadline:
            time.sleep(poll_s)
        if not alive:
            return []
    return [describe(p) for p in tree(sid, recorded)]


def remove_wall(path: str, wait_s: float = 10.0, poll_s: float = 0.05) -> bool:
    """SIGKILL every process in the cgroup at ``path`` until it is empty, then remove the group (retrying
    while the kernel still says EBUSY); whether it is gone. Standard library only, as the wall itself."""
    procs = os.path.join(path, "cgroup.procs")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(procs) as f:
                pids = [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not pids:
            try:
                os.rmdir(path)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                pass  # EBUSY: an exit still in progress
        time.sleep(poll_s)
    return not os.path.exists(path)


def main(argv: list[str]) -> int:
    wall = ""
    if "--wall" in argv:
        i = argv.index("--wall")
        wall, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    sid, interval_s = int(argv[0]), float(argv[1]) if len(argv) > 1 else 0.5
    try:
        root = psutil.Process(sid)
    except psutil.NoSuchProcess:
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the harness's to handle; it then says "stop"
    recorded: Recorded = {}
    command: list[str] = []
    done = threading.Event()

    def read_stdin():
        command.append(sys.stdin.readline())  # "" at end of input: the harness is gone
        done.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    started = time.monotonic()
    record(sid, recorded)
    # every 0.1 s while the engine starts up (when it spawns its processes), then every interval_s
    while not done.wait(0.1 if time.monotonic() - started < 10 else interval_s):
        record(sid, recorded)
        if not running(root) and not tree(sid, recorded):
            return 0  # the engine ended and left nothing behind: nothing to guard (stop() then finds it gone)
    words = command[0].split()
    grace_s = float(words[1]) if len(words) == 2 and words[0] == "stop" else 5.0
    survivors = terminate(sid, recorded, grace_s)
    if wall and not command[0]:  # the harness is gone: nobody else will remove its wall
        remove_wall(wall)
    try:
        print(json.dumps(survivors), flush=True)
    except OSError:  # nobody reads: the harness is gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
