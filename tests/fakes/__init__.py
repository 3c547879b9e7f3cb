"""Faithful fake engine servers: real HTTP servers on 127.0.0.1 that speak each engine's wire format
(taken from the engine's own source and documentation, cited in each module), for engines that cannot
run on the development machines. Each is usable in-process (``FakeTGI(...).start()``) and as a stand-in
executable (``python -m tests.fakes.tgi_server --model-id ...``) put on PATH by a test."""
