"""Ctrl-C and SIGTERM during a load: the load stops within a fraction of a second, at any request rate.

Why not asyncio's own Ctrl-C handling: ``asyncio.Runner`` cancels the main task once and raises
KeyboardInterrupt only when that cancellation comes back out of it. Python 3.11's ``asyncio.wait_for``
swallows a cancellation that lands while the request it waits on has just finished (it returns the
result instead), and with requests of one token that is most of the time: the worker went on with its
queue, and a second Ctrl-C raised KeyboardInterrupt inside a transport callback ("Fatal error on
transport", a traceback, the run going on). Here a signal only *notes* the stop (:func:`note`) and
cancels the main task (again at every signal); the profiles send nothing once :func:`stopping` says so,
whatever happened to the cancellation, and :func:`~kvbench.load.common.run_async` raises
KeyboardInterrupt after its loop has ended cleanly. Nothing is raised inside the event loop.

The note is process-wide: the runner reads it to keep a later signal from cutting its wind-down short
(stopping engines, writing run.json), and clears it with :func:`reset` at the start of a run.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: list[int] = []  # the stop signals noted since the last reset, in order


def note(signum: int) -> None:
    _received.append(signum)


def received() -> list[int]:
    return list(_received)


def stopping() -> bool:
    """Whether a stop signal has been noted: no further request is sent."""
    return bool(_received)


def reset() -> None:
    _received.clear()


@contextmanager
def signals_call(on_signal: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM are noted and passed to ``on_signal`` instead of raising,
    also a SIGINT ignored on entry (see the runner's :func:`~kvbench.run.runner._interrupt`); the previous
    handlers come back at the end. Only the main thread can set handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        note(signum)
        on_signal(signum)

    previous = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
