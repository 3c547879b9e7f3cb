"""The engine tree outlives no supervisor, with real engines: a killed guard and harness leave no vLLM
process; an interrupted `kvbench setup` stops its model converter (the stand-in cases: tests/faults/test_guard_death.py).

Tests that start a real engine live in modules named *_engines.py: tests/conftest.py runs them on one xdist
worker, one after another."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.faults.test_guard_death import _converters, _vllm_tmp_dirs, _wait_for
from tests.helpers import REPO


@pytest.mark.engine
def test_a_killed_guard_is_replaced_then_a_killed_harness_leaves_no_vllm_process(tmp_path):
    """vLLM: kill -9 of its guard mid-run is noticed (a new guard at once) and the engine runs on; kill -9
    of the replacement and of the harness at once then leaves no process of vLLM's (API server, EngineCore,
    resource_tracker: they once ran on under PID 1) and removes its temp folder, where its vllm_dist_*
    rendezvous file was (not in /tmp)."""
    from tests.faults.test_failures_engines import _gone as vllm_gone
    from tests.faults.test_failures_engines import _kvbench, _wait_for_cells, processes_of
    from tests.helpers import engine_env

    vllm_env = engine_env("vllm")
    run_dir = tmp_path / "run"
    proc = _kvbench("-b", "vllm", "--workload", "smoke", "--results-dir", str(tmp_path), "--run-id", "run",
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_cells(run_dir, 1, proc, timeout=600)
        def guards():
            found = []
            for p in psutil.Process(proc.pid).children():
                try:
                    if "guard.py" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                        found.append(p)
                except psutil.Error:
                    continue
            return found

        (first,) = guards()
        first.kill()
        assert _wait_for(lambda: [g for g in guards() if g.pid != first.pid], 5.0), "no new guard"
        assert len(processes_of(vllm_env)) >= 2  # the engine runs on
        (second,) = [g for g in guards() if g.pid != first.pid]
        tmp_dirs = _vllm_tmp_dirs(proc.pid, vllm_env)
        assert tmp_dirs and all(d.startswith("/tmp/kvbench-") for d in tmp_dirs), tmp_dirs
        assert any(n.startswith("vllm_dist_") for d in tmp_dirs for n in os.listdir(d)), "no rendezvous file there"
        second.kill()
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert vllm_gone(vllm_env, timeout_s=15) == []
    assert _wait_for(lambda: not any(Path(d).exists() for d in tmp_dirs), 10.0), "vLLM's temp folder was left"
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "running"  # the harness was killed: nobody wrote its end


@pytest.mark.engine
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["sigterm", "sigint", "sigkill"])
def test_an_interrupted_setup_stops_its_model_converter(tmp_path, sig):
    """The converter used to run on for about 12 s after SIGTERM of `kvbench setup`. A KVBENCH_HOME of its
    own (the installed environments linked in, no models) makes setup convert the embedded GGUF again."""
    from tests.helpers import engine_env

    engine_env("hf")
    home = tmp_path / "home"
    home.mkdir()
    (home / "envs").symlink_to(Path(os.environ.get("KVBENCH_HOME", Path.home() / ".cache" / "kvbench")) / "envs")
    setup = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "setup", "-b", "hf"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "KVBENCH_HOME": str(home), "PYTHONPATH": str(REPO)})
    try:
        assert _wait_for(lambda: any(p.ppid() == setup.pid for p in _converters()), 60.0), "no conversion started"
        (converter,) = [p for p in _converters() if p.ppid() == setup.pid]
        t0 = time.monotonic()
        setup.send_signal(sig)
        out, err = setup.communicate(timeout=30)
        took = time.monotonic() - t0
        assert _wait_for(lambda: not converter.is_running() or converter.status() == psutil.STATUS_ZOMBIE, 3.0), \
            "the converter outlived setup"
    finally:
        if setup.poll() is None:
            setup.kill()
            setup.communicate()
    if sig != signal.SIGKILL:
        assert setup.returncode == 130 and took < 3.0, (setup.returncode, took, out + err)
        assert "setup interrupted" in out and "Traceback" not in out + err
