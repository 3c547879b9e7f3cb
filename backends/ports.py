"""The engine's port, held from the moment kvbench chooses it until the engine has bound it."""
from __future__ import annotations

import errno
import socket

from .types import LOCALHOST


class PortHold:
    """A port held from the moment kvbench chooses it until the engine has bound it (:func:`hold_port`): a
    socket bound to it with SO_REUSEADDR that never listens. While it is held the kernel gives the port to
    no other socket (an ephemeral port, a connection's local port, a server binding without SO_REUSEADDR:
    "address already in use"), yet the engine, which binds with SO_REUSEADDR as every server here does
    (uvicorn, vLLM's own socket, llama.cpp's httplib, Go's net, Python's http.server), binds and listens on
    it. A server that also binds with SO_REUSEADDR and listens first still can: the ownership check after
    "ready" (:meth:`kvbench.backends.process.ServerProcess.stranger_at`) refuses it. Not inherited by the engine (PEP 446)."""

    def __init__(self, sock: socket.socket):
        self._sock: socket.socket | None = sock
        self.port: int = sock.getsockname()[1]

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def held(self) -> bool:
        return self._sock is not None


class PortInUse(OSError):
    """The port to hold has a listener (or a socket bound without SO_REUSEADDR)."""

    def __init__(self, port: int, reason: str):
        super().__init__(f"port {port}: {reason}")
        self.port = port


def hold_port(host: str = LOCALHOST, port: int = 0) -> PortHold:
    """``port`` (0: one the kernel chooses) held at ``host`` (:class:`PortHold`); :class:`PortInUse` where
    another socket has it, OSError where ``host`` cannot be bound at all."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(port, (exc.strerror or str(exc)).lower()) from None
        raise
    return PortHold(sock)
