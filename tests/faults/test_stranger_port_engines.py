"""The wrong server on the engine's port, with the real transformers and vLLM engines (docs/fault-matrix.md,
"The wrong server"): `kvbench run -b hf|vllm --workload smoke` with another process answering 200 on the port
kvbench chose gives failed cells naming that process, never a cell the stranger served, and leaves no engine
process. Cheap: the engine is refused before it is spawned, or stopped while it still imports.

In-process (typer's CliRunner), so that the port kvbench chooses can be set to the stranger's: once already
listening before the spawn, once bound in the moment between kvbench's check and the spawn (the race the
ownership check after "ready" closes)."""
from __future__ import annotations

from contextlib import ExitStack

import pytest
from typer.testing import CliRunner

import kvbench.backends.base as base
from kvbench.backends.process import ServerProcess, free_port
from kvbench.cli import app
from kvbench.store.readers import load_cells
from tests.faults.test_failures_engines import processes_of
from tests.faults.test_stranger_port import stranger_on
from tests.helpers import engine_env

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


def smoke_run(tmp_path, engine: str = "hf"):
    result = CliRunner().invoke(app, ["run", "-b", engine, "--workload", "smoke", "--results-dir", str(tmp_path),
                                      "--run-id", "run"])
    return result, load_cells(tmp_path / "run")


def assert_refused(result, cells, port, stranger, env):
    assert result.exit_code == 1, result.output  # every cell failed: the runner's exit for that
    assert len(cells) == 4 and (cells.status == "failed").all()  # no cell the stranger served is "ok"
    said = f"port {port} is served by another process (pid {stranger.pid} "
    assert cells.error.str.contains(said, regex=False).all(), cells.error.tolist()
    assert stranger.poll() is None  # the stranger is not kvbench's to stop
    assert not processes_of(env)  # nothing of the engine's tree is left


def force_port(monkeypatch, port: int) -> None:
    """The engine's port is ``port`` (the stranger's), not the kernel's choice."""
    real = base.hold_port
    monkeypatch.setattr(base, "hold_port", lambda host, _=0: real(host, port))


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_stranger_already_on_the_chosen_port_fails_the_cells(tmp_path, monkeypatch, engine):
    # vLLM's cells once failed with "Expecting value: line 1 column 1 (char 0)" (the stranger's "ok")
    env = engine_env(engine)
    port = free_port()
    force_port(monkeypatch, port)
    with stranger_on(port) as stranger:
        result, cells = smoke_run(tmp_path, engine)
        assert_refused(result, cells, port, stranger, env)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_stranger_that_binds_before_the_engine_fails_the_cells(tmp_path, monkeypatch, engine):
    # the port is free when kvbench checks it; a stranger binding with SO_REUSEADDR (Python's http.server
    # does) takes it from under kvbench's hold before the engine binds it: the engine's bind fails, the
    # stranger answers the health path, and the ownership check after "ready" refuses it
    env = engine_env(engine)
    port = free_port()
    force_port(monkeypatch, port)
    spawn = ServerProcess.start
    strangers = []
    with ExitStack() as stack:
        def stranger_first(self):
            strangers.append(stack.enter_context(stranger_on(port)))
            spawn(self)

        monkeypatch.setattr(ServerProcess, "start", stranger_first)
        result, cells = smoke_run(tmp_path, engine)
        (stranger,) = strangers
        assert_refused(result, cells, port, stranger, env)
