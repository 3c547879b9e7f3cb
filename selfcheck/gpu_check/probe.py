"""The CUDA side of the checks: the transformers engine's ``scripts/gpu_probe.py`` run by an interpreter whose
torch sees the GPU, stepped through its events, and NVML read at those moments."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

from kvbench.selfcheck.engines import TRANSFORMERS, engine_script

# What the probe runs with: offline, transformers quiet.
PROBE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


@cache
def probe_script() -> Path:
    """The real probe; it runs in its own folder, as does any stand-in given for it."""
    return engine_script(TRANSFORMERS, "gpu_probe.py")


class Probe:
    """The GPU probe in a CUDA torch interpreter, stepped through its events."""

    def __init__(self, python: str, args: list[str], log: Path, script: Path | None = None):
        self.log = log.open("w")
        self.proc = subprocess.Popen([python, str(script or probe_script()), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
                                     cwd=probe_script().parent, env={**os.environ, **PROBE_ENV})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float) -> dict:
        end = time.monotonic() + max(timeout, 0.1)
        while True:
            try:
                line = self.lines.get(timeout=max(0.05, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the GPU probe said nothing for {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"the GPU probe exited ({self.proc.wait()}); see {self.log.name}")
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                return event

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def probe_events(out: str) -> list[dict]:
    """The events among a finished probe's output lines."""
    events = []
    for line in out.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def nvml_snapshot(nvml, pids: set[int], settle_s: float = 0.2, readings: int = 3) -> dict:
    """NVML at one moment: the median of a few readings once the driver's figures have settled."""
    time.sleep(settle_s)
    used, procs, found = [], [], set()
    for _ in range(readings):
        used.append(nvml.device_used_bytes())
        mem = nvml.process_memory(pids)
        procs.append(mem.bytes)
        found |= mem.pids_found
        time.sleep(0.02)
    known = sorted(p for p in procs if p is not None)
    return {"device_used": sorted(used)[len(used) // 2], "process_bytes": known[len(known) // 2] if known else None,
            "process_found": bool(found)}


def find_torch_python(explicit: str | None) -> tuple[str | None, dict, list[str]]:
    """The first interpreter whose torch sees CUDA: --torch-python, the hf environments, this one, python3."""
    from kvbench.common.envs import kvbench_home

    candidates = [explicit] if explicit else []
    candidates += sorted(str(p) for p in (kvbench_home() / "envs").glob("hf-*/bin/python"))
    candidates += [sys.executable, "python3"]
    tried = []
    for python in dict.fromkeys(candidates):
        try:
            out = subprocess.run([python, str(probe_script()), "info"], capture_output=True, text=True, timeout=60)
            info = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            info = {}
        if info.get("cuda_available"):
            return python, info, tried
        tried.append(f"{python}: " + ("torch without CUDA" if info else "no torch"))
    return None, {}, tried
