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

from tests.test_cli import kvbench

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


# --- what a run folder holds is one run: resumed as started, one label per setting, one id per cell -----

def started_run(tmp_path, backends=("llamacpp",)):
    """A run folder as `kvbench run` leaves it (its run.json), without running an engine."""
    from kvbench.run.backend_config import BackendConfig
    from kvbench.store.writer import RunWriter
    from kvbench.workloads import load

    writer = RunWriter(tmp_path / "runs" / "r")
    configs = [BackendConfig.parse(b) for b in backends]
    writer.write_run_info({"run_id": "r", "status": "interrupted", "workload": load("smoke").model_dump(),
                           "kv_dtype": "auto", "backends": [c.model_dump() | {"label": c.label} for c in configs]})
    (writer.root / "cells.jsonl").write_text("")
    return writer.root


@pytest.mark.parametrize("args, says", [
    (["--workload", "long_context_ladder", "-b", "llamacpp"], "another workload (concurrency, description, name"),
    (["--workload", "smoke", "-b", "vllm"], "another backends (llamacpp-0.3.36 then, vllm-0.32.0 now)"),
    (["--workload", "smoke", "-b", "llamacpp:threads=2"], "options differ"),
    (["--workload", "smoke", "-b", "llamacpp", "--kv-dtype", "q8_0"], "--kv-dtype (auto then, q8_0 now)"),
])
def test_resume_refuses_another_workload_backend_or_dtype(tmp_path, args, says):
    root = started_run(tmp_path)
    before = (root / "run.json").read_text()
    out = kvbench("run", "--results-dir", str(root.parent), "--run-id", "r", "--resume", *args, timeout=120)
    assert out.returncode == 2 and says in " ".join((out.stdout + out.stderr).split()), out.stdout + out.stderr
    assert (root / "run.json").read_text() == before  # nothing rewritten


def test_two_settings_of_one_engine_get_a_label_each_and_the_same_one_twice_is_refused():
    from kvbench.run.backend_config import BackendConfig, ConfigError, distinct_labels

    labels = [c.label for c in distinct_labels([BackendConfig.parse("llamacpp"),
                                                BackendConfig.parse("llamacpp:threads=2")])]
    assert labels == ["llamacpp-0.3.36+default", "llamacpp-0.3.36+threads=2"]
    assert [c.label for c in distinct_labels([BackendConfig.parse("vllm"), BackendConfig.parse("llamacpp")])] == \
        ["vllm-0.32.0", "llamacpp-0.3.36"]  # nothing to tell apart: the labels of every earlier run
    with pytest.raises(ConfigError, match="given twice with the same settings"):
        distinct_labels([BackendConfig.parse("llamacpp:threads=2"), BackendConfig.parse("llamacpp:threads=2")])


@pytest.mark.parametrize("line, says", [
    ("concurrency = [1, 1]", "concurrency lists 1 more than once"),
    ("concurrency = [2]\nprompt_tokens = [64, 64]", "prompt_tokens lists 64 more than once"),
])
def test_a_workload_that_would_give_two_cells_one_id_is_refused(tmp_path, line, says):
    path = tmp_path / "w.toml"
    first = "" if "prompt_tokens" in line else "prompt_tokens = [64]\n"
    path.write_text(f'name = "w"\nseed = 1\noutput_tokens = 4\n{first}{line}\n')
    out = kvbench("run", "--results-dir", str(tmp_path / "runs"), "--workload", str(path), timeout=120)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists()
