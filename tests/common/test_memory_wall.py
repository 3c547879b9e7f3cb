"""The CPU memory wall: real child processes in a real memory-limited cgroup, killed by the real OOM killer.

Skipped (with the reason) only where :func:`detect` says no wall can be made on this machine."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbench.backends.process import ServerProcess
from kvbench.backends.types import EngineStartError
from kvbench.common.memory_wall import MemoryWall, MemoryWallError, detect, format_bytes, oom_verdict, parse_size

MIB = 2**20
WALL = 200 * MIB

try:
    HERE = detect()
    WHY_NOT = ""
except MemoryWallError as exc:
    HERE, WHY_NOT = "", str(exc)

needs_wall = pytest.mark.skipif(not HERE, reason=f"no memory wall on this machine: {WHY_NOT}")

# grows by 20 MiB blocks whose every page is written, printing the MiB held after each; argv: target MiB,
# then "wait" to read a line from stdin before the first block (so the test can add it to the wall first)
GROWER = """
import sys, time
target = int(sys.argv[1]) * 2**20
if len(sys.argv) > 2:
    sys.stdin.readline()
blocks = []
while len(blocks) * 20 * 2**20 < target:
    blocks.append(bytearray(b"\\x01") * (20 * 2**20))
    print(len(blocks) * 20, flush=True)
time.sleep(0.2)
"""


def _gone(pid: int) -> bool:
    """The process has ended (a zombie has: only its parent's wait is missing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


@needs_wall
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["join", "add"])
def test_a_process_past_the_wall_is_killed_by_the_oom_killer(how):
    with MemoryWall(WALL, "test-oom") as wall:
        if how == "join":  # in the wall before exec, as the engine's server is put in it
            proc = subprocess.Popen([sys.executable, "-c", GROWER, "400"], stdout=subprocess.PIPE, text=True,
                                    preexec_fn=wall.join)  # noqa: PLW1509 - a single-threaded test
        else:  # added by pid before it allocates
            proc = subprocess.Popen([sys.executable, "-c", GROWER, "400", "wait"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            wall.add(proc.pid)
            assert proc.pid in wall.pids()
        out, _ = proc.communicate("go\n" if how == "add" else None, timeout=40)
        held = [int(x) for x in out.split()]
        assert proc.returncode == -signal.SIGKILL, f"not killed at the wall: exit {proc.returncode}, held {held}"
        assert held and max(held) < 200  # it got going, and never got past the wall
        assert wall.oom_kills() >= 1
        peak = wall.peak_bytes()
        assert 0.9 * WALL <= peak <= WALL, format_bytes(peak)
        assert oom_verdict(wall, proc.returncode) == f"out of memory at the 200.0 MiB wall (peak {format_bytes(peak)})"
        assert oom_verdict(wall, 137) == oom_verdict(wall, signal.SIGKILL) == oom_verdict(wall, -9)
        # a tree whose server outlived its killed child: said so
        assert oom_verdict(wall, 1).endswith("the server exited with code 1)")
        record = wall.describe()
        assert record == {"limit_bytes": WALL, "peak_bytes": peak, "oom_kills": wall.oom_kills(),
                          "cgroup": HERE, "path": str(wall.path)}
    assert not wall.path.exists()
    assert wall.describe()["oom_kills"] >= 1  # the counters outlive the group, for the run's record


@needs_wall
@pytest.mark.timeout(60)
def test_a_process_under_the_wall_survives():
    with MemoryWall(WALL, "test-under") as wall:
        proc = subprocess.Popen([sys.executable, "-c", GROWER, "60"], stdout=subprocess.PIPE, text=True,
                                preexec_fn=wall.join)  # noqa: PLW1509 - a single-threaded test
        out, _ = proc.communicate(timeout=40)
        assert proc.returncode == 0
        assert out.split()[-1] == "60"
        assert wall.oom_kills() == 0
        assert oom_verdict(wall, proc.returncode) is None
        assert 60 * MIB <= wall.peak_bytes() < WALL


# holds 40 MiB of its own and maps a 24 MiB file, every page touched; says so, then waits for a line on stdin
HOLDER = """
import mmap, sys
own = bytearray(b"\\x01") * (40 * 2**20)
with open(sys.argv[1], "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    touched = sum(mapped[i] for i in range(0, len(mapped), 4096))
print("ready", flush=True)
sys.stdin.readline()
"""


@needs_wall
@pytest.mark.timeout(60)
def test_resident_counts_the_files_a_process_maps_beside_its_own_memory(tmp_path):
    """unreclaimable_bytes: anonymous and shared memory only; resident_bytes adds the file pages the tree maps
    (a server's mmapped weights), which the kernel takes back at the wall only to read them again."""
    data = tmp_path / "weights.bin"
    with data.open("wb") as f:
        f.write(os.urandom(24 * MIB))
        f.flush()
        os.fsync(f.fileno())  # written back: clean pages, which the advice below drops
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # so they are read, and charged, inside the wall
    with MemoryWall(WALL, "test-resident") as wall:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(data)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=wall.join)  # noqa: PLW1509
        assert proc.stdout.readline().strip() == "ready"
        unreclaimable, resident = wall.unreclaimable_bytes(), wall.resident_bytes()
        proc.communicate("\n", timeout=20)
        assert 40 * MIB <= unreclaimable < 40 * MIB + 24 * MIB
        assert resident - unreclaimable >= 20 * MIB  # the mapped file, most of it charged here
        assert resident <= wall.peak_bytes()
    assert wall.resident_bytes() is None  # closed


@needs_wall
@pytest.mark.timeout(60)
def test_close_kills_the_tree_and_removes_the_group():
    wall = MemoryWall(WALL, "test-close")
    path = wall.path
    assert path.is_dir() and path.parent.name == "kvbench"
    assert str(os.getpid()) in path.name
    # a shell with two children of its own: the whole tree inherits the wall
    tree = ["sh", "-c", "sleep 60 & sleep 60 & wait"]
    proc = subprocess.Popen(tree, preexec_fn=wall.join)  # noqa: PLW1509 - a single-threaded test
    deadline = time.monotonic() + 10
    while len(wall.pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = wall.pids()
    assert proc.pid in pids and len(pids) == 3
    with pytest.raises(ValueError):
        wall.add(os.getpid())  # the harness never goes in: close() kills what is there
    started = time.monotonic()
    wall.close()
    assert time.monotonic() - started < 10
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert all(_gone(pid) for pid in pids)
    assert not path.exists() and wall.pids() == []
    wall.close()  # idempotent


@needs_wall
@pytest.mark.timeout(60)
def test_close_of_a_group_removed_already_does_not_raise():
    wall = MemoryWall(WALL, "test-gone")
    wall.path.rmdir()
    wall.close()
    wall.close()
    assert wall.describe()["oom_kills"] == 0
    with MemoryWall(WALL, "test-gone") as inner:
        inner.path.rmdir()  # __exit__ finds it gone too


@needs_wall
@pytest.mark.timeout(60)
def test_two_walls_at_once_are_two_groups():
    with MemoryWall(WALL, "same") as a, MemoryWall(WALL, "same") as b:
        assert a.path != b.path
        assert a.path.is_dir() and b.path.is_dir()
    assert not a.path.exists() and not b.path.exists()


@needs_wall
@pytest.mark.timeout(60)
def test_a_wall_needs_a_positive_size():
    for bad in (0, -1, 1.5, "200M", True):
        with pytest.raises(ValueError):
            MemoryWall(bad, "bad")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, size", [
    ("1000000", 1_000_000), ("512M", 512 * MIB), ("1.5G", 3 * 2**29), ("2GiB", 2 * 2**30),
    ("800MiB", 800 * MIB), ("64K", 65536), ("64KB", 65536), ("1T", 2**40), ("512m", 512 * MIB),
    (" 20 MiB ", 20 * MIB), ("100B", 100), ("0.5K", 512),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["", "M", "abc", "12X", "-5M", "1.5", "1e6", "5 MB B", "1..5G", "2 GiBs", None])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.timeout(60)
def test_bytes_are_shown_with_one_decimal():
    assert format_bytes(200 * MIB) == "200.0 MiB"
    assert format_bytes(511.9 * MIB) == "511.9 MiB"
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"


# --- an engine's server in the wall: kvbench.backends.process.ServerProcess -----------------------------

# a server whose child grows to argv[1] MiB (20 MiB blocks, every page written) and then waits; the server
# prints its own pid and its child's, and waits for the child (so that the child is the wall's victim)
GROWING_SERVER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\\n"
                              "blocks = [bytearray(b'\\\\x01') * (20 * 2**20) for _ in range(int(sys.argv[1]) // 20)]\\n"
                              "print('grown', flush=True); time.sleep(300)", sys.argv[1]])
    print("root", os.getpid(), flush=True)
    print("child", child.pid, flush=True)
    sys.exit(child.wait() and 1)
""")


def _tree_pids(log: Path, n: int = 2, timeout_s: float = 20.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {w[0]: int(w[1]) for w in (line.split() for line in log.read_text().splitlines())
                 if len(w) == 2 and w[0] in ("root", "child")}
        if len(found) >= n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"the server did not start its tree: {log.read_text()}")


def _all_ended(pids, timeout_s: float = 5.0) -> bool:
    """Every process has ended (a zombie has), waiting a moment for the kernel to finish the last exits."""
    deadline = time.monotonic() + timeout_s
    while not all(_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _no_walls_of_this_process() -> list[str]:
    """Walls (cgroup folders) this test process made that still exist."""
    if not HERE:
        return []
    from kvbench.common.memory_wall import _locate

    parent = _locate()[1] / "kvbench"
    return [p.name for p in parent.iterdir() if p.is_dir() and f"-{os.getpid()}-" in p.name]


@needs_wall
@pytest.mark.timeout(60)
def test_a_server_tree_in_the_wall_is_killed_at_it_and_says_so(tmp_path):
    log = tmp_path / "engine.log"
    server = ServerProcess([sys.executable, "-c", GROWING_SERVER, "400"], {}, log, memory_limit_bytes=WALL)
    server.start()
    try:
        path = server.wall.path
        assert path.is_dir()
        pids = _tree_pids(log)
        assert pids["root"] in server.wall.pids()  # joined before exec: the root and its child
        assert server.guard.pid not in server.wall.pids()  # the guard stays outside
        description = server.exit_description(wait_s=30)
        # the child was the victim; the server then exited with code 1
        assert description.startswith("out of memory at the 200.0 MiB wall (peak "), description
        assert description.endswith("the server exited with code 1)"), description
    finally:
        survivors = server.stop(grace_s=2)
    assert survivors == []
    assert not path.exists() and _no_walls_of_this_process() == []
    assert _all_ended(pids.values())
    record = server.wall_record()
    assert record["limit_bytes"] == WALL and record["oom_kills"] == 1 and record["cgroup"] == HERE
    assert 0.9 * WALL <= record["peak_bytes"] <= WALL
    assert server.exit_description() == oom_verdict(server.wall, 1)  # still said after the stop
    json.dumps(record)


@needs_wall
@pytest.mark.timeout(60)
def test_the_server_itself_killed_at_the_wall(tmp_path):
    log = tmp_path / "engine.log"
    grow = "import time\nblocks = [bytearray(b'\\x01') * (20 * 2**20) for _ in range(20)]\ntime.sleep(60)"
    server = ServerProcess([sys.executable, "-c", grow], {}, log, memory_limit_bytes=WALL)
    server.start()
    try:
        with pytest.raises(EngineStartError, match=r"server out of memory at the 200.0 MiB wall \(peak .* MiB\) "
                                                   r"before it was ready"):
            server.wait_http("http://127.0.0.1:9/health", timeout_s=30)
        assert re.fullmatch(r"out of memory at the 200.0 MiB wall \(peak \d+\.\d MiB\)", server.exit_description())
    finally:
        assert server.stop(grace_s=2) == []
    assert _no_walls_of_this_process() == []


@needs_wall
@pytest.mark.timeout(60)
def test_a_server_under_the_wall_runs_and_stop_leaves_nothing(tmp_path):
    log = tmp_path / "engine.log"
    server = ServerProcess([sys.executable, "-c", GROWING_SERVER, "60"], {}, log, memory_limit_bytes=WALL)
    server.start()
    try:
        pids = _tree_pids(log)
        deadline = time.monotonic() + 20
        while "grown" not in log.read_text().splitlines() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.alive() and server.exit_description() == ""
        assert server.wall.oom_kills() == 0 and server.wall.usage_bytes() >= 60 * MIB
        path = server.wall.path
    finally:
        survivors = server.stop(grace_s=2)
    assert survivors == []
    assert not path.exists() and _no_walls_of_this_process() == []
    assert _all_ended(pids.values())
    record = server.wall_record()
    assert record["oom_kills"] == 0 and 60 * MIB <= record["peak_bytes"] < WALL
    assert server.exit_description() == "killed by SIGTERM"


@needs_wall
@pytest.mark.timeout(60)
def test_stop_kills_what_left_the_session_but_not_the_wall(tmp_path):
    # a grandchild that leaves the session and ignores SIGTERM, started after the guard last looked:
    # the guard cannot know it; the wall holds it and its close kills it
    script = textwrap.dedent("""
        import os, subprocess, sys, time
        print("root", os.getpid(), flush=True)
        time.sleep(0.3)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"],
                                 start_new_session=True)
        print("child", child.pid, flush=True)
        os._exit(0)  # the root ends at once: the child is re-parented, outside the session
    """)
    log = tmp_path / "engine.log"
    server = ServerProcess([sys.executable, "-c", script], {}, log, memory_limit_bytes=WALL)
    server.start()
    try:
        pids = _tree_pids(log)
        assert server.exit_description(wait_s=10) == "exited with code 0"
        # the launcher (backends/launcher.py) ends it with its root at once; until then the wall holds it
        assert _all_ended([pids["child"]]) or pids["child"] in server.wall.pids()
    finally:
        survivors = server.stop(grace_s=1)
    assert survivors == []
    assert _all_ended([pids["child"]])
    assert _no_walls_of_this_process() == []


HARNESS_WITH_WALL = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvbench.backends.process import ServerProcess
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(300)"], {}, Path(sys.argv[1]),
                           memory_limit_bytes=200 * 2**20)
    server.start()
    print(server.wall.path, server.pid, flush=True)
    time.sleep(300)
""")


@needs_wall
@pytest.mark.timeout(60)
def test_a_killed_harness_leaves_no_wall_behind(tmp_path):
    harness = subprocess.Popen([sys.executable, "-c", HARNESS_WITH_WALL, str(tmp_path / "engine.log")],
                               stdout=subprocess.PIPE, text=True)
    path, pid = harness.stdout.readline().split()
    assert Path(path).is_dir()
    harness.kill()  # no finally block runs: the guard sees its pipe close, stops the tree, removes the wall
    harness.wait()
    deadline = time.monotonic() + 20
    while (Path(path).exists() or not _gone(int(pid))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(path).exists()
    assert _gone(int(pid))


@pytest.mark.timeout(60)
def test_no_wall_here_is_a_clear_start_error_and_nothing_starts(tmp_path, monkeypatch):
    from kvbench.common import memory_wall

    why = ("cannot make a memory wall: no cgroup v1 memory hierarchy mounted; cgroup v2 at /sys/fs/cgroup is "
           "mounted read-only; needs root and a writable cgroup memory controller")

    def refuse():
        raise MemoryWallError(why)

    monkeypatch.setattr(memory_wall, "_locate", refuse)
    server = ServerProcess(["sleep", "30"], {}, tmp_path / "engine.log", memory_limit_bytes=WALL)
    with pytest.raises(EngineStartError) as info:
        server.start()
    assert str(info.value) == why and "\n" not in str(info.value)
    assert server.proc is None and server.guard is None and server.wall is None
    assert server.stop() == [] and server.wall_record() is None


@pytest.mark.timeout(60)
def test_a_memory_limit_is_a_positive_number_of_bytes(tmp_path):
    for bad in (0, -5, 1.5, "512M", True):
        with pytest.raises(ValueError):
            ServerProcess(["true"], {}, tmp_path / "engine.log", memory_limit_bytes=bad)
    assert ServerProcess(["true"], {}, tmp_path / "engine.log").wall_record() is None  # no limit: no wall


@needs_wall
@pytest.mark.timeout(60)
def test_the_spec_s_limit_reaches_the_server(tmp_path):
    from kvbench.backends.base import Backend
    from kvbench.backends.types import ServerSpec

    class Sleeper(Backend):
        engine, default_version = "sleeper", "0"
        recipe = stream = kv_pool = kv_in_use = None

        def command(self, spec):
            return ["sleep", "30"], {}

    Sleeper.__abstractmethods__ = frozenset()
    backend = Sleeper("0", tmp_path)
    spec = ServerSpec(model=None, max_context=16, max_concurrency=1, kv_dtype="auto", memory_limit_bytes=WALL)
    try:
        with pytest.raises(EngineStartError, match="not ready after 1 s"):
            backend.start(spec, tmp_path / "engine.log", timeout_s=1)
        assert backend.server.wall.limit_bytes == WALL and backend.server.pid in backend.server.wall.pids()
    finally:
        survivors = backend.stop()
    assert survivors == []
    assert backend.server.wall_record()["oom_kills"] == 0 and _no_walls_of_this_process() == []
