"""Engines that fail to install, start, crash or are interrupted: failed rows, nothing left running."""
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells, load_run_info
from kvbench.workloads import load

from tests.helpers import REPO, engine_env

pytestmark = pytest.mark.engine


def processes_of(env_path: Path) -> list[psutil.Process]:
    """Live processes started from an engine environment (its python or its binary)."""
    found = []
    for p in psutil.process_iter(["cmdline", "exe"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["exe"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(env_path) in text and p.pid != os.getpid():
            found.append(p)
    return found


def run(tmp_path, *backends, **options):
    opts = RunOptions(model="smollm2", workload=load("smoke"), backends=[BackendConfig.parse(b) for b in backends],
                      results_dir=tmp_path, run_id="run", request_timeout_s=120, **options)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir)


def test_engine_that_cannot_start_gives_failed_rows_and_others_still_run(tmp_path):
    llama_env = engine_env("llamacpp")
    engine_env("hf")
    run_dir, cells = run(tmp_path, "llamacpp:extra_args=--no-such-flag", "hf", start_timeout_s=60)
    bad = cells[cells.engine == "llamacpp"]
    good = cells[cells.engine == "hf"]
    assert len(bad) == len(good) == 4
    assert (bad.status == "failed").all()
    assert bad.error.str.contains("failed to start").all()
    assert bad.log_tail.str.contains("no-such-flag").all()  # the engine's own words reach the row
    assert (good.status == "ok").all()
    assert not processes_of(llama_env)


def test_start_timeout_kills_the_whole_tree(tmp_path):
    vllm_env = engine_env("vllm")
    run_dir, cells = run(tmp_path, "vllm", start_timeout_s=8)
    assert (cells.status == "failed").all()
    assert cells.error.str.contains("not ready after 8 s").all()
    assert not processes_of(vllm_env)  # EngineCore children included


def test_install_failure_gives_failed_rows(tmp_path):
    engine_env("hf")  # prepares the model; the run below asks for a transformers release that does not exist
    from kvbench.backends import REGISTRY
    from kvbench.common.envs import env_dir

    broken = env_dir(REGISTRY["hf"].recipe("0.0.0rc999"))
    try:
        run_dir, cells = run(tmp_path, "hf@0.0.0rc999")
    finally:
        shutil.rmtree(broken, ignore_errors=True)
        for build in broken.parent.glob(f".builds/{broken.name}-*"):  # the failed install's folder, its log
            shutil.rmtree(build, ignore_errors=True)
    assert len(cells) == 4 and (cells.status == "failed").all()
    assert cells.error.str.contains("install failed").all()
    assert cells.log_tail.str.contains("0.0.0rc999").all()


def _default_sigint():  # a runner started in the background inherits SIGINT ignored; a user's terminal does not
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kvbench(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "kvbench.cli", "run", *args], cwd=REPO, preexec_fn=_default_sigint,
                            **popen)


def _wait_for_cells(run_dir: Path, n: int, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "cells.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, "kvbench ended early"
        time.sleep(0.2)
    raise AssertionError(f"no {n} cells after {timeout} s")


def _llama_smoke_run_past_its_first_cell(tmp_path) -> subprocess.Popen:
    proc = _kvbench("-b", "llamacpp", "--workload", "smoke", "--results-dir", str(tmp_path), "--run-id", "run",
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_cells(tmp_path / "run", 1, proc)
    except BaseException:
        proc.kill()
        raise
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_keeps_finished_cells_and_leaves_no_server(tmp_path, sig):
    llama_env = engine_env("llamacpp")
    proc = _llama_smoke_run_past_its_first_cell(tmp_path)
    try:
        assert processes_of(llama_env)  # the server is up mid-run
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert not processes_of(llama_env)
    cells = load_cells(tmp_path / "run")
    assert len(cells) >= 1 and (cells.status == "ok").all()
    info = load_run_info(tmp_path / "run")
    assert info["status"] == "interrupted"
    assert list(info["engine_stops"].values())[0]["reason"] == "interrupted"


def _gone(env_path: Path, timeout_s: float = 30.0) -> list[psutil.Process]:
    """The engine's processes still running after ``timeout_s`` (the guard needs a moment)."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(env_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _report(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.cli", "report", str(run_dir), "-o", str(run_dir / "rep" / "report.md")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_killed_harness_leaves_no_server_and_resume_finishes_the_run(tmp_path):
    llama_env = engine_env("llamacpp")
    proc = _llama_smoke_run_past_its_first_cell(tmp_path)
    proc.kill()  # SIGKILL: no finally block of kvbench runs
    proc.wait()
    assert _gone(llama_env) == []
    run_dir = tmp_path / "run"
    report = _report(run_dir)
    assert report.returncode == 0, report.stderr
    assert "harness gone" in (run_dir / "rep" / "report.md").read_text()
    finished = len(load_cells(run_dir))
    assert 1 <= finished < 4
    resumed = _kvbench("-b", "llamacpp", "--workload", "smoke", "--results-dir", str(tmp_path), "--run-id", "run",
                       "--resume", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert resumed.wait(timeout=600) == 0
    cells = load_cells(run_dir)
    assert len(cells) == 4 and cells.cell_id.is_unique and (cells.status == "ok").all()
    info = load_run_info(run_dir)
    assert info["status"] == "finished" and len(info["invocations"]) == 2
    assert not processes_of(llama_env)


def _vllm_children(kvbench: subprocess.Popen, vllm_env: Path) -> list[psutil.Process]:
    """vLLM's API server: the child of the tree's root, kvbench's launcher (backends/launcher.py)."""
    launchers = [p for p in psutil.Process(kvbench.pid).children() if "launcher.py" in " ".join(p.cmdline())]
    return [p for launcher in launchers for p in launcher.children() if p in processes_of(vllm_env)]


def test_vllm_api_server_killed_mid_run_leaves_no_engine_core(tmp_path):
    # SIGKILL of vLLM's API server used to leave its EngineCore and workers running, re-parented to PID 1
    vllm_env = engine_env("vllm")
    proc = _kvbench("-b", "vllm", "--workload", "smoke", "--results-dir", str(tmp_path), "--run-id", "run",
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_cells(tmp_path / "run", 1, proc, timeout=600)
        tree = processes_of(vllm_env)
        assert len(tree) >= 2  # the API server and its EngineCore
        for p in _vllm_children(proc, vllm_env):
            p.kill()  # the API server only
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert _gone(vllm_env, timeout_s=5) == []
    cells = load_cells(tmp_path / "run")
    assert len(cells) == 4 and (cells.status == "ok").sum() >= 1
    assert cells[cells.status == "failed"].error.str.contains("SIGKILL").all()
    info = load_run_info(tmp_path / "run")
    stop = list(info["engine_stops"].values())[0]
    assert "SIGKILL" in stop["reason"] and stop["survivors"] == []


def test_a_harness_killed_while_vllm_starts_takes_the_vllm_tree_with_it(tmp_path):
    # vLLM ignores SIGTERM (and so a parent-death SIGTERM) while it starts up
    vllm_env = engine_env("vllm")
    proc = _kvbench("-b", "vllm", "--workload", "smoke", "--results-dir", str(tmp_path), "--run-id", "run",
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(processes_of(vllm_env)) < 2 and time.monotonic() < deadline:  # EngineCore is up
            assert proc.poll() is None
            time.sleep(0.2)
        assert len(processes_of(vllm_env)) >= 2
        assert not (tmp_path / "run" / "cells.jsonl").exists()  # still starting
    finally:
        proc.kill()
        proc.wait()
    assert _gone(vllm_env) == []
    report = _report(tmp_path / "run")
    assert report.returncode in (0, 2), report.stderr  # a run with no cell: read, and said so
    assert "Traceback" not in report.stderr


def test_engine_crash_mid_run_fails_the_remaining_cells(tmp_path):
    llama_env = engine_env("llamacpp")
    proc = _llama_smoke_run_past_its_first_cell(tmp_path)
    try:
        for p in processes_of(llama_env):
            p.kill()  # the engine dies under the harness
        proc.wait(timeout=120)
    finally:
        proc.kill()
    cells = load_cells(tmp_path / "run")
    assert len(cells) == 4  # every cell has a row
    assert (cells.status == "ok").sum() >= 1
    failed = cells[cells.status == "failed"]
    assert len(failed) >= 1
    assert failed.error.str.contains("engine killed by SIGKILL").all()
    assert failed.log_tail.notna().all() and (failed.log_tail.str.len() > 0).all()
    assert load_run_info(tmp_path / "run")["status"] == "finished"
    assert not processes_of(llama_env)


def test_engine_dead_at_a_cell_counter_reset_fails_the_remaining_cells(tmp_path, monkeypatch):
    # the harness's own call to the engine between cells (hf resets its peak counters) meets a dead engine
    hf_env = engine_env("hf")
    from kvbench.backends.hf.adapter import HFBackend

    reset, calls = HFBackend.reset_cell, []

    def reset_after_a_crash(self):
        calls.append(1)
        if len(calls) == 2:
            os.kill(self.pid, signal.SIGKILL)  # the server; its launcher then ends the rest
        return reset(self)

    monkeypatch.setattr(HFBackend, "reset_cell", reset_after_a_crash)
    run_dir, cells = run(tmp_path, "hf")
    assert len(cells) == 4 and cells.status.tolist() == ["ok", "failed", "failed", "failed"]
    assert cells.error[1:].str.startswith("engine killed by SIGKILL during the run: ").all()
    assert cells.error[1:].str.contains("Error").all()  # the failed call's own words, e.g. ReadError
    assert load_run_info(run_dir)["status"] == "finished"
    assert not processes_of(hf_env)
