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
