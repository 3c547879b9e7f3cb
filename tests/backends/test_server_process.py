"""The engine server process: how its end is read."""
import time

import pytest

from kvbench.backends.process import ServerProcess
from kvbench.backends.types import EngineStartError


def test_exit_is_waited_for_when_asked(tmp_path):
    # a killed engine closes its sockets a moment before its exit can be read: the runner waits for it
    server = ServerProcess(["sh", "-c", "sleep 0.5; kill -9 $$"], {}, tmp_path / "engine.log")
    server.start()
    try:
        assert server.exit_description() == ""  # still running
        assert server.exit_description(wait_s=10) == "killed by SIGKILL"
    finally:
        server.stop()


def test_waiting_on_a_live_server_gives_up_after_the_wait(tmp_path):
    server = ServerProcess(["sleep", "30"], {}, tmp_path / "engine.log")
    server.start()
    try:
        t0 = time.monotonic()
        assert server.exit_description(wait_s=0.3) == ""
        assert 0.3 <= time.monotonic() - t0 < 5
        assert server.alive()
    finally:
        server.stop()
    assert server.exit_description() == "killed by SIGTERM"


def test_exit_code_is_named(tmp_path):
    server = ServerProcess(["sh", "-c", "exit 3"], {}, tmp_path / "engine.log")
    server.start()
    assert server.exit_description(wait_s=10) == "exited with code 3"


def test_a_server_that_dies_while_starting_says_how(tmp_path):
    server = ServerProcess(["sh", "-c", "echo loading; kill -9 $$"], {}, tmp_path / "engine.log")
    server.start()
    with pytest.raises(EngineStartError, match="server killed by SIGKILL before it was ready") as info:
        server.wait_http("http://127.0.0.1:9/health", timeout_s=30)
    assert "loading" in info.value.log_tail


# --- the whole tree stops, also when the harness dies ---------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import psutil  # noqa: E402

# A server whose tree is like vLLM's: a child in its session and a grandchild that leaves the session
# (setsid) and ignores SIGTERM; every process writes its pid to the log.
TREE_SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if "--ignore-sigterm" in sys.argv:  # as vLLM while it starts up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("root", os.getpid(), flush=True)
    subprocess.Popen([sys.executable, "-c", "import os,time; print('child', os.getpid(), flush=True); time.sleep(300)"])
    if "--ignore-sigterm" not in sys.argv:
        subprocess.Popen([sys.executable, "-c", "import os,signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('escaped', os.getpid(), flush=True); time.sleep(300)"], start_new_session=True)
    time.sleep(300)
""")


def _pids(log, n=3, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {w[0]: int(w[1]) for w in (line.split() for line in log.read_text().splitlines())
                 if len(w) == 2 and w[0] in ("root", "child", "escaped")}
        if len(found) == n:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the server did not start its tree: {log.read_text()}")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # also one that ended between two looks
        return False


def _gone(pids, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def test_stop_ends_the_whole_tree_including_a_process_that_left_the_session(tmp_path):
    log = tmp_path / "engine.log"
    server = ServerProcess([sys.executable, "-c", TREE_SERVER], {}, log)
    server.start()
    pids = _pids(log)
    time.sleep(1.0)  # the guard records the tree every 0.5 s
    assert os.getsid(pids["escaped"]) != pids["root"]  # it did leave the session
    assert server.stop(grace_s=1.0) == []
    assert _gone(pids.values(), timeout_s=1.0) == []
    assert server.exit_description() == "killed by SIGTERM"


def test_an_engine_killed_mid_run_leaves_no_orphans_after_stop(tmp_path):
    # what SIGKILL of vLLM's API server did: its EngineCore and workers went on, re-parented to PID 1
    log = tmp_path / "engine.log"
    server = ServerProcess([sys.executable, "-c", TREE_SERVER], {}, log)
    server.start()
    pids = _pids(log)
    time.sleep(1.0)
    os.kill(pids["root"], signal.SIGKILL)
    assert server.exit_description(wait_s=10) == "killed by SIGKILL"
    # the launcher ends what is left of a dead server's tree at once (it once went on, re-parented to PID 1)
    assert _gone([pids["child"], pids["escaped"]], timeout_s=5) == []
    assert server.stop(grace_s=1.0) == []
    assert _gone(pids.values(), timeout_s=1.0) == []


HARNESS = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvbench.backends.process import ServerProcess
    server = ServerProcess([sys.executable, "-c", sys.argv[1], *sys.argv[3:]], {}, Path(sys.argv[2]))
    server.start()
    print("started", flush=True)
    time.sleep(300)
""")


@pytest.mark.parametrize("starting_up", [False, True], ids=["running", "starting-up"])
def test_a_killed_harness_takes_its_engine_tree_with_it(tmp_path, starting_up):
    # SIGKILL of kvbench: no finally block runs; the guard sees its pipe close and stops the tree,
    # including a process that left the session once the guard has seen it. Starting up, the root ignores
    # SIGTERM (as vLLM does then; its processes stay in its session) and the harness dies as soon as they
    # exist, perhaps before the guard's first look.
    log = tmp_path / "engine.log"
    extra = ["--ignore-sigterm"] if starting_up else []
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, TREE_SERVER, str(log), *extra],
                               stdout=subprocess.PIPE, text=True)
    assert harness.stdout.readline().strip() == "started"
    pids = _pids(log, n=2 if starting_up else 3)
    if not starting_up:
        time.sleep(1.0)
    harness.kill()
    harness.wait()
    assert _gone(pids.values()) == [], open(log).read()


def test_the_log_excerpt_keeps_the_first_error_far_above_the_end(tmp_path):
    log = tmp_path / "engine.log"
    body = ["INFO loading"] * 5 + ["ValueError: max_model_len 4096 exceeds the KV cache (1000 tokens)"] + \
           [f"INFO worker {i} exiting" for i in range(90)]
    script = "import sys; print(open(sys.argv[1]).read()); sys.exit(1)"
    (tmp_path / "body.txt").write_text("\n".join(body))
    server = ServerProcess([sys.executable, "-c", script, str(tmp_path / "body.txt")], {}, log)
    server.start()
    with pytest.raises(EngineStartError) as info:
        server.wait_http("http://127.0.0.1:9/health", timeout_s=30)
    assert "max_model_len 4096 exceeds" in info.value.log_tail
    assert "worker 89 exiting" in info.value.log_tail
    server.stop()
    json.dumps(server.survivors)


def test_busy_threads_counts_the_threads_that_computed():
    from kvbench.run.samplers import busy_threads

    # one thread spins until it has used 1 s of CPU (its own CPU clock, not the wall clock: on a loaded
    # machine a wall-clock second of spinning may get well under half a second of CPU), two others only sleep
    code = ("import threading, time\n"
            "for _ in range(2): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "while time.thread_time() < 1.0: pass\n"
            "print('done', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"
        threads = busy_threads(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert threads["busy_threads"] == 1 and threads["threads"] == 3 and threads["busiest_thread_cpu_s"] >= 0.9


def test_busy_threads_of_an_engine_that_has_ended_is_unknown():
    # asked of an engine that failed to start: it used to raise, and the backend's rows were written twice
    from kvbench.run.samplers import busy_threads

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert busy_threads(proc.pid) is None


def test_a_server_gone_before_its_launcher_is_read_as_ended(tmp_path):
    # the launcher reaps its server, then kills what is left and exits with the server's status: a cell
    # that looked in between saw a live launcher and a vanished server pid ("backend failed: NoSuchProcess")
    import subprocess

    server = ServerProcess(["sleep", "30"], {}, tmp_path / "engine.log")
    server.start()
    launcher = server.proc
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        server.proc = subprocess.Popen(["sh", "-c", "sleep 0.5; kill -9 $$"])  # the launcher, ending as its server
        server.server_pid = gone.pid
        t0 = time.monotonic()
        assert server.exit_description() == "killed by SIGKILL"
        assert time.monotonic() - t0 < 5
    finally:
        server.proc = launcher
        server.stop()
