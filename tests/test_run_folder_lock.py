"""A run folder has one owner: a live harness holds a lock on it that the OS releases when the process ends,
so a second `kvbench run` into it (the same --run-id, a --resume or --overwrite of a run still running) is
refused in one line before it touches anything, a killed owner leaves no stale lock, and default run ids
started in the same second do not collide."""
import subprocess
import sys
import time

import pytest

from kvbench.store.errors import RunFolderError
from kvbench.store.writer import RunFolderLock

from .test_cli import kvbench

HOLD = """
import sys, time
from kvbench.store.writer import RunFolderLock
lock = RunFolderLock(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def held(tmp_path):
    """A run folder locked by another process, with a file of its run in it."""
    folder = tmp_path / "runs" / "busy"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    (folder / "cells.jsonl").write_text("")
    (folder / "run.json").write_text('{"run_id": "busy", "status": "running"}')
    yield folder, proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("mode", [[], ["--overwrite"], ["--resume"]])
def test_a_second_harness_is_refused_and_touches_nothing(held, mode):
    folder, proc = held
    before = sorted(p.name for p in folder.iterdir())
    out = kvbench("run", "--results-dir", str(folder.parent), "--run-id", "busy", "--workload", "smoke",
                  "-b", "llamacpp", *mode, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"in use by another kvbench (pid {proc.pid})" in " ".join((out.stdout + out.stderr).split())
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_killed_owner_leaves_no_stale_lock(held):
    folder, proc = held
    with pytest.raises(RunFolderError, match="in use"):
        RunFolderLock(folder)
    proc.kill()
    proc.wait()
    lock = RunFolderLock(folder)  # the OS released the dead owner's lock
    lock.release()
    RunFolderLock(folder).release()


def test_one_process_cannot_own_a_folder_twice(tmp_path):
    lock = RunFolderLock(tmp_path / "r")
    with pytest.raises(RunFolderError, match="in use by another kvbench"):
        RunFolderLock(tmp_path / "r")
    lock.release()
    RunFolderLock(tmp_path / "r").release()


def test_default_run_ids_started_in_the_same_second_differ():
    code = "from kvbench.run.runner import new_run_id; print(new_run_id('smoke'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    start = time.time()
    ids = [p.communicate()[0].strip() for p in procs]
    assert len(set(ids)) == 2 and all(i.split("-")[2] == "smoke" for i in ids), ids
    assert time.time() - start < 60
