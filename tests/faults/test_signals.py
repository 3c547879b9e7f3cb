"""Ctrl-C and SIGTERM under load (issue 22): a `kvbench run` against a server that answers at once
(selfcheck/mock_server.py in instant mode, the fastest stand-in), concurrency 8, one output token, tens of
thousands of requests planned, is signalled once some hundreds are done. It must end within a few seconds
of the signal with exit 130, run.json "interrupted", and no traceback: in the closed loop, the open loops
and with several load workers, for SIGINT, SIGTERM and two SIGINTs in a row.

Progress is read from the server (GET /mock/records: the requests it has read since the last call)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvbench.backends.process import free_port
from tests.helpers import REPO

DONE_BEFORE_SIGNAL = 300  # requests the server has read before the signal: the load is in full flow
END_WITHIN_S = 3.0  # the issue: "within a second"; generous for a shared 2-core machine

CLOSED = """name = "sigload"
seed = 1
prompt_tokens = [32]
output_tokens = 1
concurrency = [8]
requests = 50000
warmup_requests = 0
"""
OPEN = CLOSED.replace('name = "sigload"', 'name = "sigopen"').replace(
    "concurrency = [8]", 'concurrency = [8]\nload_profile = "PROFILE"\nrequest_rates = [5000]')


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.selfcheck.mock_server", "--port", str(port),
                             "--ttft-ms", "0", "--itl-ms", "0", "--no-record-sends"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert "mock server on" in proc.stdout.readline()
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def requests_read(client: httpx.Client, url: str) -> int:
    return len(client.get(f"{url}/mock/records").json()["records"])


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def interrupted_run(tmp_path: Path, url: str, workload: str, signals: list[int], *args: str,
                    sigint_ignored: bool = False) -> tuple:
    """Start `kvbench run` (``sigint_ignored``: with SIGINT ignored, as a shell starts a job with `&`),
    signal it (``signals``, 0.1 s apart) once the server has read DONE_BEFORE_SIGNAL requests; its completed
    process, the seconds from the first signal to its exit, and its run.json."""
    path = tmp_path / "w.toml"
    path.write_text(workload)
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "run", "-b", f"openai:url={url}", "--model", "smollm2",
                             "--allow-model-mismatch", "--workload", str(path), "--results-dir", str(tmp_path),
                             "--run-id", "r", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                            preexec_fn=_ignore_sigint if sigint_ignored else None)
    try:
        with httpx.Client() as client:
            requests_read(client, url)  # what an earlier test left
            seen, deadline = 0, time.monotonic() + 60
            while seen < DONE_BEFORE_SIGNAL and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
                seen += requests_read(client, url)
        assert seen >= DONE_BEFORE_SIGNAL and proc.poll() is None, f"the load never got going ({seen} requests)"
        t_signal = time.monotonic()
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.1)
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), took, \
        json.loads((tmp_path / "r" / "run.json").read_text())


def check_interrupted(out, took: float, info: dict) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 130, text[-3000:]
    assert took < END_WITHIN_S, f"ended {took:.1f} s after the signal"
    assert info["status"] == "interrupted"
    assert "Traceback" not in text and "Fatal error" not in text, text[-3000:]
    assert "interrupted; finished cells are in" in " ".join(out.stdout.split())


SIGNALS = {"sigint": [signal.SIGINT], "sigterm": [signal.SIGTERM], "two_sigints": [signal.SIGINT, signal.SIGINT]}


@pytest.mark.parametrize("name, sigint_ignored", [("sigint", False), ("sigterm", True), ("two_sigints", True)],
                         ids=["sigint", "sigterm-sigint-ignored", "two-sigints-sigint-ignored"])
def test_a_signal_ends_a_closed_loop_under_load(tmp_path, server, smollm2, name, sigint_ignored):
    """``sigint_ignored``: started as a script starts a job with `&` (SIGINT ignored), where SIGINT once went
    unheeded and SIGTERM printed "Fatal error on transport" while the run went on to "finished"."""
    check_interrupted(*interrupted_run(tmp_path, server, CLOSED, SIGNALS[name], sigint_ignored=sigint_ignored))


@pytest.mark.parametrize("profile, name", [("poisson", "sigterm"), ("constant", "two_sigints")])
def test_a_signal_ends_an_open_loop_under_load(tmp_path, server, smollm2, profile, name):
    check_interrupted(*interrupted_run(tmp_path, server, OPEN.replace("PROFILE", profile), SIGNALS[name]))


def test_a_signal_ends_a_load_of_several_workers(tmp_path, server, smollm2):
    """Two load worker processes; SIGINT then SIGTERM. No worker outlives the harness."""
    out, took, info = interrupted_run(tmp_path, server, CLOSED, [signal.SIGINT, signal.SIGTERM], "--load-workers", "2")
    check_interrupted(out, took, info)
    time.sleep(0.5)
    with httpx.Client() as client:
        requests_read(client, server)
        time.sleep(0.5)
        assert requests_read(client, server) == 0, "requests still arrive after the harness exited"


def test_ctrl_c_while_the_report_is_written_is_exit_130_without_a_traceback(tmp_path, monkeypatch):
    """The run is finished and whole; Ctrl-C during its report says where it is and exits 130 (it used to
    print a traceback)."""
    from typer.testing import CliRunner

    import kvbench.reports
    import kvbench.run.runner
    from kvbench.cli import app

    class FinishedRunner:
        def __init__(self, options, console, plan=None):
            self.run_dir = tmp_path / "the-run"

        def run(self):
            return self.run_dir

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvbench.run.runner, "Runner", FinishedRunner)
    monkeypatch.setattr(kvbench.reports, "write_report", interrupted)
    result = CliRunner().invoke(app, ["run", "-b", "llamacpp", "--workload", "smoke",
                                      "--results-dir", str(tmp_path / "r")])
    assert result.exit_code == 130, result.output
    assert "interrupted while writing the report" in result.output and "Traceback" not in result.output
    assert str(tmp_path / "the-run") in result.output.replace("\n", "")
