"""What the self-checks share: the mock server in a process of its own, and two small statistics helpers."""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from kvbench.backends.process import free_port
from kvbench.backends.types import LOCALHOST


class Mock:
    """kvbench.selfcheck.mock_server in a subprocess (pinned to ``cpu``), stopped on exit."""

    def __init__(self, ttft_ms: float, itl_ms: float, cpu: int | None, record_sends: bool = True):
        self.port = free_port()
        self.url = f"http://{LOCALHOST}:{self.port}"
        argv = [sys.executable, "-m", "kvbench.selfcheck.mock_server", "--port", str(self.port),
                "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)]
        if cpu is not None:
            argv += ["--cpu", str(cpu)]
        if not record_sends:
            argv.append("--no-record-sends")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parent.parent)
        self.ps = psutil.Process(self.proc.pid)

    def __enter__(self) -> "Mock":
        deadline = time.monotonic() + 20
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mock server exited: {self.proc.stderr.read().decode(errors='replace')[-500:]}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    time.sleep(0.05)
        self.stop()
        raise RuntimeError("mock server did not answer within 20 s")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def records(self) -> list[dict]:
        """The mock's records since the last call (and clears them)."""
        with httpx.Client(timeout=30.0) as client:
            return client.get(self.url + "/mock/records").json()["records"]

    def cpu_seconds(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def median_finite(values) -> float:
    """The median of the values that are numbers (None and NaN left out); NaN when none is."""
    values = [v for v in values if v is not None and not np.isnan(v)]
    return statistics.median(values) if values else float("nan")
