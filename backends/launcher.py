"""The root of an engine's process tree: a small process that starts the engine's server as its child and
takes the whole tree with it when kvbench is gone, whatever of kvbench died and in whatever order.

Why, beside the guard (:mod:`.guard`): the guard stops the tree when the harness dies, but when the guard
was killed first, or both at once, nothing did (the server's parent-death signal reaches the server only;
vLLM's EngineCore, workers and resource_tracker went on under PID 1). The launcher is

- a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process of the tree whose parent dies is re-parented
  to the launcher, not to PID 1, so every process the server ever started stays a descendant of it (also
  one that left the session with setsid);
- tied to the harness by ``PR_SET_PDEATHSIG``: when the harness dies (SIGKILL included), it stops every
  descendant (SIGTERM, SIGKILL after GRACE_S) and exits;
- the end of the server: when the server ends, the launcher kills what is left of its tree at once (an
  engine whose server died is dead; its remnants would only hold memory) and ends as the server did (the
  same exit code, or killed by the same signal), so the harness reads the server's own end.

SIGTERM and SIGINT (the guard's stop of the session) are the server's to act on: the launcher ignores
them and waits for the server. The server itself gets a parent-death SIGKILL tied to the launcher.

Usage: ``launcher.py HARNESS_PID PID_FD [--tmp DIR] -- ARGV...``: the server's pid is written to the
descriptor PID_FD (then closed); DIR, the server's own temp folder, is removed when the launcher ends. Standard library only (run with ``python -I -S``: it starts in a few tens of milliseconds).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
HARNESS_GONE = signal.SIGUSR1  # the launcher's parent-death signal (catchable, unlike SIGKILL)
GRACE_S = 5.0


class HarnessGone(Exception):
    pass


def prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def descendants() -> list[int]:
    """Every live (not zombie) descendant of this process, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    zombies = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
        except (OSError, ValueError):
            continue
        children.setdefault(int(ppid), []).append(int(name))
        if state == b"Z":
            zombies.add(int(name))
    found, frontier = [], [os.getpid()]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return [pid for pid in found if pid not in zombies]


def reap() -> list[tuple[int, int]]:
    """Wait for every child that has ended (as a subreaper, orphans of the tree are children too)."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, status))


def stop_tree(grace_s: float) -> None:
    """SIGTERM every descendant, SIGKILL what is left after ``grace_s`` (0: SIGKILL at once)."""
    steps = ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)) if grace_s > 0 else ((signal.SIGKILL, 5.0),)
    for sig, wait_s in steps:
        for pid in descendants():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while True:
            reap()
            if not descendants() or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not descendants():
            return


def start(argv: list[str]) -> int:
    pid = os.fork()
    if pid == 0:  # the server: default signals, dies with the launcher
        try:
            for sig in (signal.SIGTERM, signal.SIGINT, HARNESS_GONE):
                signal.signal(sig, signal.SIG_DFL)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            os.execvp(argv[0], argv)
        except BaseException as exc:  # noqa: BLE001 - said in the engine's log
            os.write(2, f"kvbench launcher: could not start {argv[0]}: {exc}\n".encode())
        os._exit(127)
    return pid


def end_as(status: int) -> None:
    """Exit as the server did: its code, or killed by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1)  # a signal that does not end a process by default (SIGCHLD...): fall through
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str]) -> None:
    harness, pid_fd = int(argv[0]), int(argv[1])
    split = argv.index("--")
    options, command = argv[2:split], argv[split + 1:]
    tmp = options[options.index("--tmp") + 1] if "--tmp" in options else None

    def harness_gone(signum, frame):
        signal.signal(HARNESS_GONE, signal.SIG_IGN)
        raise HarnessGone

    prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(HARNESS_GONE, harness_gone)
    prctl(PR_SET_PDEATHSIG, HARNESS_GONE)
    try:
        server = start(command)
        os.write(pid_fd, f"{server}\n".encode())
        os.close(pid_fd)
        if os.getppid() != harness:  # the harness died before the parent-death signal was set
            raise HarnessGone
        while True:  # a parent-death signal interrupts the wait (its handler raises)
            pid, status = os.waitpid(-1, 0)
            if pid == server:
                stop_tree(0)
                if tmp:
                    shutil.rmtree(tmp, ignore_errors=True)
                end_as(status)
    except HarnessGone:
        stop_tree(GRACE_S)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
