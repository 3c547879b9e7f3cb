"""The engine tree outlives no supervisor (issue 22): whatever of kvbench dies (the guard, the harness, both,
in any order), no process of the engine survives, and a guard that dies while the harness lives is noticed,
replaced and recorded. The stand-in engine is tests/backends/test_server_process.py's TREE_SERVER (a child in its
session, a grandchild that left the session and ignores SIGTERM); the real vLLM case is
test_a_killed_guard_is_replaced_then_a_killed_harness_leaves_no_vllm_process (marked engine)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvbench.backends.process import ServerProcess
from tests.backends.test_server_process import HARNESS, TREE_SERVER, _gone, _pids
from tests.helpers import REPO


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_killed_guard_is_replaced_at_once_and_recorded(tmp_path):
    log = tmp_path / "engine.log"
    server = ServerProcess([sys.executable, "-c", TREE_SERVER], {}, log)
    server.start()
    try:
        pids = _pids(log)
        first = server.guard
        os.kill(first.pid, signal.SIGKILL)
        assert _wait_for(lambda: server.guard_restarts, 3.0), "the dead guard went unnoticed"
        assert server.guard is not first and server.guard.poll() is None
        (restart,) = server.guard_restarts
        assert restart["guard_pid"] == first.pid and restart["guard_exit"] == "killed by SIGKILL"
        assert server.alive()  # the engine was not touched
        time.sleep(1.0)  # the new guard records the tree (every 0.1 s at first)
    finally:
        survivors = server.stop(grace_s=1.0)
    assert survivors == []
    assert _gone(pids.values(), timeout_s=2.0) == []
    assert len(server.guard_restarts) == 1  # the guard's own end at stop() is not a death


def test_a_guard_that_ends_with_its_engine_is_not_replaced(tmp_path):
    server = ServerProcess(["sh", "-c", "sleep 0.3; exit 3"], {}, tmp_path / "engine.log")
    server.start()
    assert server.exit_description(wait_s=10) == "exited with code 3"
    assert _wait_for(lambda: server.guard.poll() is not None, 5.0)
    time.sleep(0.3)
    assert server.guard_restarts == []
    server.stop()


def _harness(tmp_path, *extra):
    """A harness process (a ServerProcess started, then asleep) and its engine's pids and its guard's."""
    log = tmp_path / "engine.log"
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, TREE_SERVER, str(log), *extra],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert harness.stdout.readline().strip() == "started"
    pids = _pids(log, n=2 if extra else 3)
    kids = psutil.Process(harness.pid).children()
    guard = next(p for p in kids if "guard.py" in " ".join(p.cmdline()))
    launcher = next(p for p in kids if "launcher.py" in " ".join(p.cmdline()))
    return harness, guard, [launcher.pid, *pids.values()]


ORDERS = {"guard-then-harness": ["guard", "harness"], "harness-then-guard": ["harness", "guard"],
          "both-at-once": ["both"], "guard-only-then-harness-much-later": ["guard", "sleep", "harness"]}


@pytest.mark.parametrize("order, starting_up", [(order, False) for order in ORDERS] + [("both-at-once", True),
                                                                                   ("guard-then-harness", True)],
                         ids=[*ORDERS, "both-at-once-starting-up", "guard-then-harness-starting-up"])
def test_whatever_of_kvbench_dies_no_engine_process_survives(tmp_path, order, starting_up):
    """SIGKILL of the guard and of the harness in every order: the launcher (the tree's root, a subreaper
    tied to the harness) or the guard stops the tree, within its 5 s grace for a process that ignores
    SIGTERM. Starting up, the server ignores SIGTERM (as vLLM then) and has a child in its session."""
    harness, guard, tree = _harness(tmp_path, *(["--ignore-sigterm"] if starting_up else []))
    try:
        for step in ORDERS[order]:
            if step == "sleep":
                time.sleep(1.0)  # the harness has replaced its guard by now
            for who in (("guard", "harness") if step == "both" else (step,) if step != "sleep" else ()):
                os.kill(guard.pid if who == "guard" else harness.pid, signal.SIGKILL)
        harness.wait(10)
        assert _gone(tree, timeout_s=12.0) == [], (tmp_path / "engine.log").read_text()
    finally:
        if harness.poll() is None:
            harness.kill()
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_server_pid_is_the_engine_and_the_launcher_is_its_parent(tmp_path):
    """The samplers measure the server's own tree (the launcher's few MB are not the engine's)."""
    server = ServerProcess(["sleep", "30"], {}, tmp_path / "engine.log")
    server.start()
    try:
        engine = psutil.Process(server.pid)
        assert _wait_for(lambda: engine.name() == "sleep")  # exec'd by the launcher's child
        assert engine.ppid() == server.proc.pid
        assert os.getsid(server.pid) == server.proc.pid  # the launcher leads the engine's session
    finally:
        server.stop(grace_s=1.0)
    assert not psutil.pid_exists(server.pid) or psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE


# --- the server's own temp folder -------------------------------------------------------------------------

SOCKET_SERVER = """
import os, socket, sys, tempfile, time
path = os.path.join(tempfile.gettempdir(), "vllm_dist_" + "0" * 32)
open(path, "w").close()
sock = socket.socket(socket.AF_UNIX)
sock.bind(os.path.join(os.environ["RPC_BASE"], "0" * 36))  # a ZMQ ipc:// socket's name: a uuid4
print("ready", tempfile.gettempdir(), flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["stop", "harness-killed", "server-died"])
def test_the_server_s_temp_files_and_sockets_are_confined_and_removed(tmp_path, how):
    from kvbench.backends.process import PRIVATE_TMP

    log = tmp_path / "engine.log"
    server = ServerProcess([sys.executable, "-c", SOCKET_SERVER], {"TMPDIR": PRIVATE_TMP, "RPC_BASE": PRIVATE_TMP}, log)
    if how == "harness-killed":
        harness = subprocess.Popen([sys.executable, "-c", HARNESS_TMP, str(log)], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO)})
        folder = Path(harness.stdout.readline().split()[1])
    else:
        server.start()
        folder = server.private_tmp
    assert _wait_for(lambda: f"ready {folder}" in log.read_text(), 20.0), log.read_text()  # its tempfile.gettempdir()
    assert str(folder).startswith("/tmp/kvbench-")
    assert len(str(folder)) + 1 + 36 < 108  # a unix socket's path fits
    assert sorted(p.name for p in folder.iterdir()) == ["0" * 36, "vllm_dist_" + "0" * 32]
    if how == "stop":
        server.stop(grace_s=1.0)
    elif how == "server-died":
        os.kill(server.pid, signal.SIGKILL)
        assert server.exit_description(wait_s=10) == "killed by SIGKILL"
    else:
        harness.kill()
        harness.wait()
    assert _wait_for(lambda: not folder.exists(), 10.0), "the server's temp folder is still there"
    if how == "server-died":
        server.stop(grace_s=1.0)


HARNESS_TMP = f"""
import sys, time
from pathlib import Path
from kvbench.backends.process import PRIVATE_TMP, ServerProcess
server = ServerProcess([sys.executable, "-c", {SOCKET_SERVER!r}], {{"TMPDIR": PRIVATE_TMP, "RPC_BASE": PRIVATE_TMP}},
                       Path(sys.argv[1]))
server.start()
print("started", server.private_tmp, flush=True)
time.sleep(300)
"""


def test_vllm_gets_its_own_temp_folder_and_keeps_its_compile_cache(tmp_path):
    from kvbench.backends.process import PRIVATE_TMP
    from kvbench.backends.vllm.adapter import VLLMBackend
    from tests.backends.test_engine_modes import spec

    _, env = VLLMBackend("0.32.0", tmp_path / "env", {}).command(spec(tmp_path))
    assert env["TMPDIR"] == PRIVATE_TMP and env["VLLM_RPC_BASE_PATH"] == PRIVATE_TMP
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/") and PRIVATE_TMP not in env["TORCHINDUCTOR_CACHE_DIR"]


# --- the real engine: one vLLM start -------------------------------------------------------------------


def _vllm_tmp_dirs(harness_pid: int, vllm_env: Path) -> list[str]:
    """The TMPDIR the harness's vLLM processes run with."""
    found = []
    for p in psutil.Process(harness_pid).children(recursive=True):
        try:
            if str(vllm_env) not in " ".join(p.cmdline()):
                continue
            tmp = p.environ().get("TMPDIR")
        except psutil.Error:
            continue
        if tmp:
            found.append(tmp)
    return sorted(set(found))


# --- `kvbench setup` interrupted while it converts the model -------------------------------------------

def _converters() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if "hf_convert_gguf.py" in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
            found.append(p)
    return found
