"""What the fake-server tests share: a model spec (SmolLM2's geometry), prompts, stand-in executables on
PATH, and a poller that samples an adapter while requests run."""
from __future__ import annotations

import os
import stat
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from kvbench import load
from kvbench.backends.types import ServerSpec
from kvbench.common.models import ModelFiles, sha256_file
from kvbench.kv.geometry import KVGeometry
from kvbench.load import LoadPoint, LoadSettings, run_async
from kvbench.workloads.prompts import Prompt

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = KVGeometry.uniform(30, 3, 64, num_attention_heads=9, max_context=8192, model_type="llama")
BYTES_PER_TOKEN = 23_040  # 2 x 30 x 3 x 64 x 2 bytes


def spec(tmp_path: Path, max_context=4096, max_concurrency=2, kv_dtype="auto", gguf: Path | None = None) -> ServerSpec:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir(exist_ok=True)
    # as kvbench.common.models.resolve does: a GGUF model's digest is the file's
    model = ModelFiles("smollm2", hf_dir, gguf, sha256_file(gguf) if gguf and gguf.exists() else "ab" * 32, SMOLLM2)
    return ServerSpec(model, max_context, max_concurrency, kv_dtype)


def prompt(n_prompt: int, n_out: int, request_id: str = "r0") -> Prompt:
    return Prompt(request_id, tuple(range(100, 100 + n_prompt)), " w" * n_prompt, n_out)


def run(backend, prompts, concurrency=1, timeout_s=30.0):
    """The load generator's own path (kvbench.load), transport errors included."""
    return run_async(load.run(backend, prompts, LoadPoint("concurrent", concurrency), LoadSettings(timeout_s))).results


def stand_in(bin_dir: Path, name: str, module: str) -> Path:
    """An executable ``name`` that runs ``python -m module`` (a fake server's main) with this interpreter."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m {module} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def only_on_path(monkeypatch, bin_dir: Path) -> None:
    """PATH = bin_dir alone (plus /bin for sh), so nothing else of the machine's is found."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/bin")


def listening(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN]


class Poller:
    """Calls ``fn(client)`` at ~100 Hz in a thread while a block runs; keeps the non-None answers."""

    def __init__(self, fn, hz: float = 100.0):
        self.fn, self.period, self.samples = fn, 1.0 / hz, []
        self._stop = threading.Event()

    def __enter__(self):
        def loop():
            with httpx.Client(timeout=2.0) as client:
                while not self._stop.is_set():
                    value = self.fn(client)
                    if value is not None:
                        self.samples.append(value)
                    time.sleep(self.period)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.samples and time.monotonic() < deadline:  # one sample before the block starts
            time.sleep(0.005)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
