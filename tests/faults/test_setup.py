"""The third fault matrix's setup (docs/fault-matrix.md, "Setup"): a SIGKILLed `kvbench setup` leaves no half
environment and no installer the next setup trips on; two setups of one environment or one model at once: one
waits for the other, neither crashes; `sglang:python=PATH` installs nothing; a KVBENCH_HOME that is a file or
cannot be written is one line, exit 2, with no run folder left "running". No real engine is installed: the
recipes are bash one-liners, the model converter a function."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from kvbench.common import envs, models
from kvbench.common.envs import InstallStep, Recipe, ensure_env, env_dir, is_installed
from tests.helpers import REPO

ENSURE = """
import json, sys
from kvbench.common.envs import InstallStep, Recipe, ensure_env
name, script = json.loads(sys.argv[1])
print(ensure_env(Recipe(name, "1", (InstallStep(("bash", "-c", script)),), venv=False),
                 log=lambda line: print(line, flush=True)), flush=True)
"""


def start_setup(home: Path, name: str, script: str) -> subprocess.Popen:
    """A process installing a one-step recipe, as `kvbench setup` installs each of its recipes."""
    return subprocess.Popen([sys.executable, "-c", ENSURE, json.dumps([name, script])], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "KVBENCH_HOME": str(home), "PYTHONPATH": str(REPO)})


@pytest.fixture(autouse=True)
def installs_allowed():
    """As `kvbench setup` starts: an earlier test's stop_installs() (an interrupted setup) holds no more."""
    envs.allow_installs()


def recipe(name: str, script: str) -> Recipe:
    return Recipe(name, "1", (InstallStep(("bash", "-c", script)),), venv=False)


def poll(condition, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("watcher", ["alive", "killed too"])
def test_a_sigkilled_setup_leaves_no_installer_and_no_half_environment(tmp_path, monkeypatch, watcher):
    """The installer (here a writer that keeps adding files to the environment, as pip does, and a sleeper)
    is ended when setup is SIGKILLed: its watcher sees setup's pipe close. Should the watcher be killed too,
    the next setup ends the recorded process group before removing the unfinished folder (the orphaned
    writer made that fail "Directory not empty"). Either way the next setup installs afresh."""
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    marker, flag = f"kvbench-test-setup-{os.getpid()}", tmp_path / "hang"
    flag.touch()
    script = (f"if [ -e {flag} ]; then (while :; do touch {{env}}/junk-$RANDOM; sleep 0.005; done) & "
              f"exec -a {marker} sleep 60; fi; echo ok > {{env}}/done")
    setup = start_setup(tmp_path, "dummy", script)
    builds = tmp_path / "envs" / ".builds"
    poll(lambda: any(builds.glob("dummy-1-*/junk-*")), what="the installer writing")
    # the watcher is started once the installer's group exists, so it may come a moment after its writes
    def find_watchers() -> list[psutil.Process]:
        return [p for p in psutil.Process(setup.pid).children() if "killpg" in " ".join(p.cmdline())]
    poll(find_watchers, 10, "the installer's watcher")
    watchers = find_watchers()
    assert len(watchers) == 1
    if watcher == "killed too":
        watchers[0].kill()
        poll(lambda: watchers[0].status() == psutil.STATUS_ZOMBIE, 5, "the watcher to die")  # setup reaps it not
    setup.kill()
    setup.wait()
    try:
        if watcher == "alive":
            poll(lambda: not processes(marker), 5, "the watcher to end the installer")
        else:
            assert processes(marker), "nothing could end the installer: the next setup must"
        assert not env_dir(recipe("dummy", script)).exists()  # no half environment under the name
        flag.unlink()
        path = ensure_env(recipe("dummy", script), log=lambda line: None)
        assert (path / "done").read_text() == "ok\n" and is_installed(recipe("dummy", script))
        assert not list(path.glob("junk-*"))  # a fresh folder, not the killed one's
        assert [p.name for p in builds.iterdir()] == [path.resolve().name]
        poll(lambda: not processes(marker), 5, "the left-over installer to end")
    finally:
        for p in processes(marker):
            p.kill()


def test_two_setups_of_one_environment_at_once_one_waits_neither_crashes(tmp_path):
    flag, runs = tmp_path / "hold", tmp_path / "runs.log"
    flag.touch()
    script = f"echo $$ >> {runs}; while [ -e {flag} ]; do sleep 0.02; done"
    first = start_setup(tmp_path, "dummy", script)
    poll(runs.exists, what="the first install to start")
    second = start_setup(tmp_path, "dummy", script)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(second.stdout), daemon=True)
    reader.start()
    poll(lambda: any("waiting for another kvbench installing dummy-1" in line for line in lines),
         what="the second setup to say it waits")
    flag.unlink()
    out_first, _ = first.communicate(timeout=30)
    second.wait(timeout=30)
    reader.join(5)
    assert first.returncode == 0 and second.returncode == 0, out_first + "".join(lines)
    assert len(runs.read_text().splitlines()) == 1  # installed once: the second found it done
    assert lines[-1].strip() == out_first.splitlines()[-1].strip() == str(tmp_path / "envs" / "dummy-1")


def test_two_preparations_of_one_model_at_once_one_waits_and_a_killed_ones_staging_is_cleared(tmp_path,
                                                                                               monkeypatch):
    real = models.hf_copy_dir(models.embedded_gguf("smollm2"))
    if not (real / "config.json").exists():
        pytest.skip("the embedded model's HF copy is made by `make test` (kvbench setup)")
    assert models.max_context_known(real)  # the config reader's lazy imports made here, not in two threads at once
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    gguf = models.embedded_gguf("smollm2")
    staging = models.hf_copy_dir(gguf).with_name("hf.partial")
    staging.mkdir(parents=True)
    (staging / "config.json").write_text("{half")  # what a conversion killed mid-way leaves
    calls, release = [], threading.Event()

    def convert(src: Path, out: Path, log_file: Path) -> None:
        calls.append(out)
        assert release.wait(30)
        out.mkdir()
        for name in ("config.json", "tokenizer.json"):
            shutil.copy(real / name, out / name)

    results, logs = {}, {"a": [], "b": []}

    def prepare(key):
        results[key] = models.resolve(str(gguf), convert, log=logs[key].append)

    a = threading.Thread(target=prepare, args=("a",))
    a.start()
    poll(lambda: calls, what="the first conversion")
    b = threading.Thread(target=prepare, args=("b",))
    b.start()
    poll(lambda: any("waiting for another kvbench preparing" in line for line in logs["b"]), what="the wait")
    release.set()
    a.join(30)
    b.join(30)
    assert len(calls) == 1 and results["a"].hf_dir == results["b"].hf_dir == models.hf_copy_dir(gguf)
    assert json.loads((results["a"].hf_dir / "config.json").read_text()) and not staging.exists()


def kvbench(home: Path | str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "KVBENCH_HOME": str(home), "COLUMNS": "300"})


def unwritable_home(tmp_path: Path, kind: str) -> Path:
    if kind == "a file":
        (tmp_path / "home").write_text("")
        return tmp_path / "home"
    if os.geteuid() != 0:
        (tmp_path / "home").mkdir(mode=0o555)
        return tmp_path / "home"
    try:  # root writes through permissions: a filesystem that refuses a folder instead
        os.mkdir("/sys/kvbench-home")
    except OSError:
        return Path("/sys/kvbench-home")
    os.rmdir("/sys/kvbench-home")
    pytest.skip("no folder here that root cannot write")


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    return lines[0]


@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_a_home_that_cannot_be_written_is_one_line_for_setup_and_run(tmp_path, kind):
    home = unwritable_home(tmp_path, kind)
    line = one_line(kvbench(home, "setup", "-b", "llamacpp"))
    assert f"KVBENCH_HOME {home} cannot be written: " in line and "needed for llamacpp-0.3.36" in line, line
    assert ("a file, not a folder" in line) == (kind == "a file")
    line = one_line(kvbench(home, "run", "-b", "openai:url=http://127.0.0.1:9", "--workload", "smoke",
                            "--results-dir", str(tmp_path / "runs"), "--run-id", "r"))
    assert f"KVBENCH_HOME {home} cannot be written" in line and "the HF-format copy of" in line, line
    assert not (tmp_path / "runs").exists()  # refused before a run folder (and its run.json "running") exists


def test_a_home_lost_mid_run_fails_the_run_it_does_not_leave_it_running(tmp_path, monkeypatch):
    """The model's copy cannot be made after the run folder exists (KVBENCH_HOME replaced by a file since the
    check): the run is "failed" with the one line, never left "running"."""
    from rich.console import Console

    from kvbench.run.backend_config import BackendConfig
    from kvbench.run.runner import Runner, RunOptions
    from kvbench.store.readers import load_run_info
    from kvbench.workloads import load

    (tmp_path / "home").write_text("")
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    options = RunOptions(backends=[BackendConfig.parse("openai:url=http://127.0.0.1:9")], workload=load("smoke"),
                         results_dir=tmp_path / "runs", run_id="r", command=["kvbench", "run"])
    with pytest.raises(models.ModelError, match=f"KVBENCH_HOME {tmp_path / 'home'} cannot be written"):
        Runner(options, Console(file=open(os.devnull, "w"))).run()
    info = load_run_info(tmp_path / "runs" / "r")
    assert info["status"] == "failed" and "cannot be written" in info["error"]


def test_sglang_python_path_installs_nothing_in_setup_or_run(tmp_path, monkeypatch):
    home = tmp_path / "home"
    real = models.hf_copy_dir(models.embedded_gguf("smollm2"))
    if not (real / "config.json").exists():
        pytest.skip("the embedded model's HF copy is made by `make test` (kvbench setup)")
    model = tmp_path / "model"  # an HF folder: nothing to prepare in KVBENCH_HOME either
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(real / name, model / name)
    done = kvbench(home, "setup", "-b", f"sglang:python={sys.executable}", "--model", str(model))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"nothing to install (it runs from python={sys.executable})" in done.stdout
    assert not (home / "envs").exists()  # SGLang's environment was not installed first

    from kvbench.backends import REGISTRY
    from kvbench.run import start
    from kvbench.run.backend_config import BackendConfig

    def no_install(*args, **kwargs):
        raise AssertionError("installed")

    monkeypatch.setattr(start, "ensure_env", no_install)
    cfg = BackendConfig.parse(f"sglang:python={sys.executable}")
    session = SimpleNamespace(cfg=cfg)
    backend = start.make_backend(session, REGISTRY["sglang"])
    assert backend.env_path is None and backend.options["python"] == sys.executable
