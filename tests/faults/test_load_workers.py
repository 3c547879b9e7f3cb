"""The fourth fault matrix, part A (docs/fault-matrix.md): a load worker (``kvbench run --load-workers N``,
bench/load/workers.py) that stops answering mid-cell, against the fake OpenAI server."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time
from dataclasses import replace

import psutil

from kvbench.backends.openai.adapter import OpenAIBackend
from kvbench.load import LoadPoint, LoadSettings, run, workers
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.testkit import prompt, spec


def test_a_stopped_load_worker_loses_only_its_own_requests_and_the_run_says_which(tmp_path, monkeypatch):
    """Worker 1 SIGSTOPped while it streams: the cell used to wait for it for ever (its sibling's requests with
    it). Now it is ended once silent for HANG_S, its requests recorded lost naming it and why, and every other
    request of the cell measured by worker 0."""
    monkeypatch.setattr(workers, "HANG_S", 4.0)  # 30 s in a run; beside busy test workers a loop may lag ~1 s
    prompts = [replace(prompt(8, 20, f"r{i}"), ordinal=i) for i in range(12)]
    with FakeOpenAI(token_delay_s=0.01) as fake:  # each request 0.2 s
        backend = OpenAIBackend("v1", tmp_path, {"token_ids": True, "ignore_eos": True, "return_token_ids": True})
        backend.attach(spec(tmp_path), fake.url, timeout_s=5)

        def streaming(p) -> bool:
            with contextlib.suppress(psutil.Error):
                return any(c.raddr and c.raddr.port == fake.port for c in psutil.Process(p.pid).net_connections("tcp"))
            return False

        async def stop_one_once_both_stream():
            task = asyncio.create_task(run(backend, prompts, LoadPoint("concurrent", 2),
                                           LoadSettings(30.0, workers=2)))
            deadline = time.monotonic() + 30
            while not (len(kids := multiprocessing.active_children()) == 2 and all(map(streaming, kids))):
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.02)
            stopped = max(kids, key=lambda p: p.pid)
            os.kill(stopped.pid, signal.SIGSTOP)
            t = time.monotonic()
            load = await asyncio.wait_for(task, 60)
            return load, stopped.pid, time.monotonic() - t

        load, pid, took = asyncio.run(stop_one_once_both_stream())
    assert took < 4.0 + 10  # its silence, not for ever
    assert sorted(r.ordinal for r in load.results) == list(range(12))  # every request of the cell, once
    lost = [r for r in load.results if r.error]
    assert lost and all(r.error.startswith("lost: ") and r.load_process.endswith(f":{pid}") for r in lost), \
        [(r.error, r.load_process) for r in lost]
    assert all("stopped answering (silent for 4 s: stopped or hung) and was ended" in r.error for r in lost)
    kept = [r for r in load.results if not r.error]
    assert len(kept) >= 12 - 2 and {r.load_process for r in kept} != {r.load_process for r in lost}
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
