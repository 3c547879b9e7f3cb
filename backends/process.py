"""An engine's server process: started in its own process group with its log in a file, watched, and
stopped with its whole tree. Shared by every adapter that starts a server."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from kvbench.envs import tail

from .types import LOCALHOST, EngineStartError


def free_port(host: str = LOCALHOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()  # own process group: Ctrl-C in the terminal reaches the harness only, which cleans up
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a killed harness does not orphan the server
    except OSError:
        pass


def last_error_line(log_tail: str) -> str:
    """An engine's own last error line in a log tail (llama.cpp marks them " E ", Python engines print
    the exception), to say in one line why it did not start."""
    lines = [line for line in log_tail.splitlines() if " E " in line or "error" in line.lower()]
    return lines[-1].strip()[-300:] if lines else ""


class NotReady(Exception):
    def __init__(self, last: str, why: str = ""):
        super().__init__(why or last)
        self.last, self.why = last, why  # what the URL answered last; why waiting stopped early


def wait_http(url: str, timeout_s: float, gone: Callable[[], str] | None = None, interval_s: float = 0.25) -> None:
    """GET ``url`` until it answers 200. :class:`NotReady` after ``timeout_s`` (with what it answered last),
    or at once when ``gone()`` says why waiting is pointless (e.g. the server died)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
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
    """A server started in its own process group, logging to a file, stopped with its whole tree."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(("$ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise EngineStartError(f"could not start {self.argv[0]}: {exc}") from None
        finally:
            log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return bool(self.proc and self.proc.poll() is None)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def exit_description(self, wait_s: float = 0.0) -> str:
        if self.proc and wait_s > 0:
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll() if self.proc else None
        if code is None:
            return ""
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Until ``url`` answers 200; an EngineStartError with the log tail when the server dies first or
        is not ready in ``timeout_s``."""
        def gone() -> str:
            return "" if self.alive() else f"server {self.exit_description() or 'not started'} before it was ready"
        try:
            wait_http(url, timeout_s, gone)
        except NotReady as exc:
            raise EngineStartError(exc.why or f"server not ready after {timeout_s:.0f} s ({url}: {exc.last})",
                                   self.log_tail()) from None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole tree, SIGKILL what is left after ``grace_s``."""
        if not self.proc:
            return
        root = None
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in tree:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(tree, timeout=grace_s if sig == signal.SIGTERM else 5)
            if not alive:
                break
            tree = alive
        if self.proc.returncode is None and root is not None and root.returncode is not None:
            # psutil reaped the root, so Popen can no longer read how it ended: keep what psutil read
            self.proc.returncode = root.returncode
        self.proc.wait(timeout=5)
