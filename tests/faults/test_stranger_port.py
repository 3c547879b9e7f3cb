"""The third fault matrix's wrong server on the engine's port (docs/fault-matrix.md, "The wrong server"): a
200 on the health path proves only that something listens on the port, so the socket must belong to the
engine's own process tree (backends/process.py ServerProcess.stranger_at), and the port must be free right
before the spawn (Backend.start). A stranger is refused with one line naming its pid and command line."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

import kvbench.backends.base as base
from kvbench.backends.base import Backend
from kvbench.backends.process import ServerProcess, free_port, listeners_of, port_taken
from kvbench.backends.types import EngineStartError, ServerSpec

pytestmark = pytest.mark.timeout(60)

# answers 200 to every GET and POST, as an unrelated web server or another benchmark's mock would
STRANGER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Yes(BaseHTTPRequestHandler):
    def answer(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Yes).serve_forever()
"""


def wait_listening(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port} after {timeout_s} s")


@contextmanager
def stranger_on(port: int):
    """A process that is not kvbench's answering 200 on ``port`` for the test's length."""
    proc = subprocess.Popen([sys.executable, "-c", STRANGER, str(port)])
    try:
        wait_listening(port)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def server(tmp_path, argv: list[str]) -> ServerProcess:
    proc = ServerProcess(argv, {}, tmp_path / "engine.log")
    proc.start()
    return proc


def test_a_stranger_on_the_engine_s_port_is_refused_naming_it(tmp_path):
    port = free_port()
    with stranger_on(port) as stranger:
        engine = server(tmp_path, ["sleep", "30"])  # alive, and never listening: the stranger answers for it
        try:
            with pytest.raises(EngineStartError) as info:
                engine.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=10)
        finally:
            assert engine.stop() == []
        assert str(info.value).startswith(f"port {port} is served by another process (pid {stranger.pid} python")
        assert str(info.value).endswith("), not the engine kvbench started")
        assert "\n" not in str(info.value)  # one line, though the stranger's command line has several
        assert stranger.poll() is None  # the stranger is not kvbench's to stop


def test_an_engine_serving_its_own_port_passes(tmp_path):
    port = free_port()
    engine = server(tmp_path, [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"])
    try:
        engine.wait_http(f"http://127.0.0.1:{port}/", timeout_s=20)
        assert listeners_of(port, "127.0.0.1") == [engine.pid]
    finally:
        assert engine.stop() == []


def test_a_listener_started_by_the_server_is_the_engine_s(tmp_path):
    # vLLM's, TGI's and SGLang's HTTP servers can be children of the process kvbench started
    port = free_port()
    engine = server(tmp_path, ["sh", "-c", f"'{sys.executable}' -m http.server {port} --bind 127.0.0.1; :"])
    try:
        engine.wait_http(f"http://127.0.0.1:{port}/", timeout_s=20)
        listener = listeners_of(port, "127.0.0.1")[0]
        assert listener != engine.pid and engine.pid in [p.pid for p in psutil.Process(listener).parents()]
    finally:
        assert engine.stop() == []


def test_a_port_taken_before_the_spawn_is_named(tmp_path):
    port = free_port()
    assert port_taken(port, "127.0.0.1") == ""
    with stranger_on(port) as stranger:
        line = port_taken(port, "127.0.0.1")
        name = psutil.Process(stranger.pid).name()
        assert line.startswith(f"port {port} is served by another process (pid {stranger.pid} {name} -c import sys ")
        assert line.endswith("), not the engine kvbench started") and "\n" not in line
        assert port_taken(port, "10.255.255.1") == ""  # a listener at 127.0.0.1 takes no connection to another address


class Sleeper(Backend):
    engine, default_version = "sleeper", "0"
    recipe = stream = kv_pool = kv_in_use = None

    def command(self, spec):
        return ["sleep", "30"], {}


Sleeper.__abstractmethods__ = frozenset()
SPEC = ServerSpec(model=None, max_context=16, max_concurrency=1, kv_dtype="auto")


def force_ports(monkeypatch, ports) -> list:
    """Backend.start holds the ports of ``ports`` (an iterator) in turn instead of the kernel's choice; the
    holds, for the test to look at."""
    real, holds = base.hold_port, []

    def hold(host, port=0):
        holds.append(real(host, next(ports)))
        return holds[-1]

    monkeypatch.setattr(base, "hold_port", hold)
    return holds


def test_a_chosen_port_taken_before_the_spawn_spawns_nothing(tmp_path, monkeypatch):
    port = free_port()
    chosen = []

    def forced():
        while True:
            chosen.append(port)
            yield port

    force_ports(monkeypatch, forced())
    backend = Sleeper("0", tmp_path)
    with stranger_on(port) as stranger:
        with pytest.raises(EngineStartError, match=rf"^port {port} is served by another process \(pid {stranger.pid} "):
            backend.start(SPEC, tmp_path / "engine.log", timeout_s=10)
    assert backend.server is None  # nothing was spawned, nothing is left to stop
    assert len(chosen) == base.PORT_TRIES  # a port another process took is chosen again, a few times


def test_a_port_taken_once_is_chosen_again(tmp_path, monkeypatch):
    taken, free = free_port(), free_port()
    force_ports(monkeypatch, iter([taken, free]))
    backend = Sleeper("0", tmp_path)
    with stranger_on(taken):
        try:
            with pytest.raises(EngineStartError, match="not ready after 1 s"):  # the sleeper never listens
                backend.start(SPEC, tmp_path / "engine.log", timeout_s=1)
            assert backend.spec.port == free and backend.base_url.endswith(f":{free}")
        finally:
            assert backend.stop() == []


def test_a_port_the_spec_names_is_not_exchanged(tmp_path):
    port = free_port()
    backend = Sleeper("0", tmp_path)
    with stranger_on(port) as stranger:
        with pytest.raises(EngineStartError, match=rf"^port {port} is served by another process \(pid {stranger.pid} "):
            backend.start(ServerSpec(**{**SPEC.__dict__, "port": port}), tmp_path / "engine.log", timeout_s=10)
    assert backend.server is None


def test_an_unseen_or_missing_listener_is_refused_unless_a_container_publishes_the_port(tmp_path, monkeypatch):
    import kvbench.backends.process as process

    engine = server(tmp_path, ["sleep", "30"])
    url = "http://127.0.0.1:8/health"
    try:
        monkeypatch.setattr(process, "listeners_of", lambda port, host: [None])  # another user's socket
        assert engine.stranger_at(url) == "port 8 is served by another process (another user's, which kvbench " \
                                          "may not see), not the engine kvbench started"
        monkeypatch.setattr(process, "listeners_of", lambda port, host: [])
        assert engine.stranger_at(url) == "port 8 answered, but no process kvbench can see listens on it"
        engine.argv = ["/usr/bin/docker", "run", "-p", "127.0.0.1:8:80"]  # root's docker-proxy, or iptables
        for listeners in ([], [None]):
            monkeypatch.setattr(process, "listeners_of", lambda port, host: listeners)
            assert engine.stranger_at(url) == ""
    finally:
        assert engine.stop() == []


class HttpServerEngine(Sleeper):
    """Python's http.server as the engine, binding its port half a second after it starts (an engine's
    imports): the window in which the port is free unless kvbench holds it."""

    health_path = "/"

    def command(self, spec):
        script = ("import sys, time, http.server; time.sleep(0.5); "
                  "http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), "
                  "http.server.SimpleHTTPRequestHandler).serve_forever()")
        return [sys.executable, "-c", script, str(spec.port)], {}


def test_the_chosen_port_is_held_from_its_choice_until_the_engine_binds_it(tmp_path, monkeypatch):
    """Between the spawn and the engine's bind, the port is given to nobody else (a server binding it without
    SO_REUSEADDR is refused "address already in use", the kernel hands it to no ephemeral socket); the
    engine, binding with SO_REUSEADDR, gets it; once the engine answers, kvbench lets go of it."""
    import errno as errno_

    spawn, tried = ServerProcess.start, []
    holds = []
    real = base.hold_port
    monkeypatch.setattr(base, "hold_port", lambda host, port=0: holds.append(real(host, port)) or holds[-1])

    def then_try_to_take_it(self):
        spawn(self)
        port = int(self.argv[-1])
        with socket.socket() as s:  # a stranger without SO_REUSEADDR, in the engine's start-up window
            try:
                s.bind(("127.0.0.1", port))
                tried.append("bound")
            except OSError as exc:
                tried.append(exc.errno)
        ephemeral = []
        for _ in range(200):  # nor does the kernel choose it for anyone
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ephemeral.append(s.getsockname()[1])
        tried.append(port in ephemeral)

    monkeypatch.setattr(ServerProcess, "start", then_try_to_take_it)
    backend = HttpServerEngine("0", tmp_path)
    try:
        backend.start(SPEC, tmp_path / "engine.log", timeout_s=20)
        (hold,) = holds
        assert tried == [errno_.EADDRINUSE, False]
        assert backend.spec.port == hold.port and not hold.held  # let go once the engine answered
        assert listeners_of(hold.port, "127.0.0.1") == [backend.pid]  # and the engine has it
    finally:
        assert backend.stop() == []


def test_the_hold_is_let_go_when_the_engine_fails_to_start(tmp_path, monkeypatch):
    holds = []
    real = base.hold_port
    monkeypatch.setattr(base, "hold_port", lambda host, port=0: holds.append(real(host, port)) or holds[-1])
    backend = Sleeper("0", tmp_path)
    try:
        with pytest.raises(EngineStartError, match="not ready after 1 s"):
            backend.start(SPEC, tmp_path / "engine.log", timeout_s=1)
        assert len(holds) == 1 and not holds[0].held
    finally:
        assert backend.stop() == []


# --- what a started engine says of itself ------------------------------------------------------------------

def _session(cfg, record=None, mode="new"):
    """What check() reads of an engine session, for one started (or attached) engine."""
    from types import SimpleNamespace

    from kvbench.store.run_record import RunRecord

    writer = SimpleNamespace(failed=None, update_run_info=lambda **fields: None)
    model = SimpleNamespace(name="smollm2", gguf_path=Path("SmolLM2-135M-Instruct.Q4_1.gguf"), hf_dir=Path("/m/hf"))
    run = SimpleNamespace(record=record or RunRecord(), writer=writer, console=None,
                          o=SimpleNamespace(results_mode=mode, model="smollm2", allow_model_mismatch=True))
    return SimpleNamespace(cfg=cfg, r=run, spec=SimpleNamespace(model=model))


def test_a_started_engine_answering_as_another_version_or_model_is_refused(tmp_path, monkeypatch):
    """kvbench knows what it started: another version answering (vLLM, transformers: their environment is
    that version) or another model served (llama.cpp's /v1/models) is not its engine."""
    from kvbench.backends import REGISTRY
    from kvbench.run import check
    from kvbench.run.backend_config import BackendConfig

    vllm = REGISTRY["vllm"]("0.32.0", tmp_path, {})
    vllm.base_url = "http://127.0.0.1:8"
    monkeypatch.setattr(type(vllm), "reported_version", lambda self: "0.31.0")
    with pytest.raises(EngineStartError, match=r"^http://127.0.0.1:8 answers as vllm 0.31.0, not the 0.32.0 kvbench "
                                               r"started: not the engine kvbench started$"):
        check.check(_session(BackendConfig.parse("vllm")), vllm)
    llama = REGISTRY["llamacpp"]("0.3.36", tmp_path, {})
    llama.base_url = "http://127.0.0.1:8"
    monkeypatch.setattr(type(llama), "reported_version", lambda self: "0.3.36 (b1-0c1e570)")
    monkeypatch.setattr(type(llama.capabilities.served_model), "models", lambda self, backend: ["other-model.gguf"])
    with pytest.raises(EngineStartError, match=r"^the server serves other-model.gguf, not --model smollm2: .*: not "
                                               r"the engine kvbench started$"):
        check.check(_session(BackendConfig.parse("llamacpp")), llama)


def test_a_started_engine_serving_the_path_it_was_started_with_is_its_engine(tmp_path, monkeypatch):
    """What kvbench passed the engine is what it serves: llama.cpp the GGUF its converter made of an HF folder
    (/v1/models names that path, whose last part, hf.gguf, names no model), TGI the HF copy of the embedded
    GGUF. A path it was not started with is still another server's."""
    from types import SimpleNamespace

    from kvbench.backends import REGISTRY
    from kvbench.run import check
    from kvbench.run.backend_config import BackendConfig

    llama = REGISTRY["llamacpp"]("0.3.36", tmp_path, {})
    llama.base_url = "http://127.0.0.1:8"
    llama.server = SimpleNamespace(argv=["llama-server", "-m", "/k/models/9f16de6bc745d5dc/hf.gguf", "--port", "8"])
    monkeypatch.setattr(type(llama), "reported_version", lambda self: "0.3.36 (b1-0c1e570)")
    monkeypatch.setattr(check, "token_contract", lambda s, backend: "token ids")
    served = ["/k/models/9f16de6bc745d5dc/hf.gguf"]
    monkeypatch.setattr(type(llama.capabilities.served_model), "models", lambda self, backend: served)
    session = _session(BackendConfig.parse("llamacpp"))
    session.info = SimpleNamespace()
    monkeypatch.setattr(check, "replace", lambda info, **fields: fields)
    check.check(session, llama)
    assert session.info["token_contract"] == "token ids"
    served[:] = ["/k/models/0000000000000000/hf.gguf"]
    with pytest.raises(EngineStartError, match=r"^the server serves /k/models/0000000000000000/hf.gguf, not --model "
                                               r"smollm2: .*: not the engine kvbench started$"):
        check.check(_session(BackendConfig.parse("llamacpp")), llama)


def test_an_engine_other_than_the_one_the_run_recorded_is_refused_for_the_run(tmp_path, monkeypatch):
    from kvbench.backends import REGISTRY
    from kvbench.run import check
    from kvbench.run.backend_config import BackendConfig
    from kvbench.store.errors import RunFolderError
    from kvbench.store.run_record import RunRecord

    cfg = BackendConfig.parse("openai:url=http://127.0.0.1:8")
    openai = REGISTRY["openai"]("v1", tmp_path, {})
    openai.base_url = "http://127.0.0.1:8"
    monkeypatch.setattr(type(openai), "reported_version", lambda self: "0.33.0")
    record = RunRecord(engine_versions={cfg.label: "0.32.0"})
    with pytest.raises(RunFolderError, match=r"^--resume: openai@127.0.0.1:8 at http://127.0.0.1:8 now reports "
                                             r"version 0.33.0; the run's cells of it ran on version 0.32.0"):
        check.check(_session(cfg, record, mode="resume"), openai)
    assert record.engine_versions == {cfg.label: "0.32.0"}  # nothing recorded over the run's
