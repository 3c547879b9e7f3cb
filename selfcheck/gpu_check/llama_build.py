"""(e) With ``--llama-source``: llama.cpp's CUDA llama-server built here from a source archive
(backends/llamacpp/scripts/pack_llama_source.sh makes one), if the time allows, and the devices it lists."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from .common import Budget


def cuda_architecture(nvml) -> str:
    """The first GPU's compute capability as CMake wants it ("90" for 9.0), from NVML; "native" (CMake >= 3.24
    asks the driver) where NVML does not say. One architecture: compiling ggml's CUDA kernels for all of them
    would not fit a short loan."""
    try:
        major, minor = nvml.nv.nvmlDeviceGetCudaComputeCapability(nvml.handles[0])
        return f"{int(major)}{int(minor)}"
    except Exception:
        return "native"


def llama_build_argv(src: Path, build: Path, jobs: int, arch: str = "native") -> list[list[str]]:
    """(e) The commands that build llama-server with CUDA from llama.cpp's sources (the options of
    build_llama_server.sh, plus CUDA for this machine's GPU), then list the devices it sees."""
    return [["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_NATIVE=ON"],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
            [str(build / "bin" / "llama-server"), "--list-devices"]]


def build_llama(source: Path, out: Path, budget: Budget, reserve_s: float = 30, arch: str = "native") -> dict:
    """(e) Build llama.cpp's CUDA llama-server from ``source`` (an archive pack_llama_source.sh made, or a
    folder holding llama.cpp/) within what is left of the budget; the devices it lists. Never fails the run:
    the status says what happened."""
    import tarfile

    row = {"source": str(source), "status": "not run", "seconds": None, "devices": None, "note": "",
           "cuda_architecture": arch}
    t0 = time.monotonic()
    try:
        if source.is_file():
            with tarfile.open(source) as tar:
                try:
                    tar.extractall(out / "llama-src", filter="data")
                except TypeError:  # a Python before 3.11.4 / 3.10.12: no extraction filters
                    tar.extractall(out / "llama-src")
            source = out / "llama-src"
        src = source / "llama.cpp" if (source / "llama.cpp" / "CMakeLists.txt").exists() else source
        if not (src / "CMakeLists.txt").exists():
            return {**row, "status": "no CMakeLists.txt in the source"}
        log = (out / "logs" / "llama_build.log").open("w")
        for argv in llama_build_argv(src, out / "llama-build", os.cpu_count() or 4, arch):
            left = budget.left() - reserve_s
            if left < 30:
                return {**row, "status": "skipped: time budget", "seconds": time.monotonic() - t0,
                        "note": f"stopped before `{' '.join(argv[:3])}`"}
            done = subprocess.run(argv, stdout=subprocess.PIPE if argv[-1] == "--list-devices" else log,
                                  stderr=subprocess.STDOUT, text=True, timeout=left)
            if done.returncode != 0:
                return {**row, "status": f"`{Path(argv[0]).name} {argv[1]}` exited {done.returncode}",
                        "seconds": time.monotonic() - t0, "note": "see logs/llama_build.log"}
            if argv[-1] == "--list-devices":
                devices = [line.strip() for line in (done.stdout or "").splitlines() if "CUDA" in line]
                row["devices"] = "; ".join(devices) or "none with CUDA"
        return {**row, "status": "built", "seconds": time.monotonic() - t0}
    except subprocess.TimeoutExpired as exc:
        return {**row, "status": "time box reached", "seconds": time.monotonic() - t0, "note": str(exc.cmd[:3])}
    except (OSError, tarfile.TarError) as exc:
        return {**row, "status": f"failed: {exc}", "seconds": time.monotonic() - t0}


def run_llama_build(result: dict, source: Path, nvml, out: Path, budget: Budget) -> None:
    print(f"(e) building llama.cpp's CUDA server from {source}", flush=True)
    result["llama_build"] = build_llama(source, out, budget, arch=cuda_architecture(nvml))


def markdown(result: dict) -> list[str]:
    if not result.get("llama_build"):
        return []
    b = result["llama_build"]
    return ["", "## (e) llama.cpp's CUDA server built here", "",
            f"From `{b.get('source')}`: {b['status']}"
            + (f" in {b['seconds']:.0f} s" if b.get("seconds") is not None else "")
            + (f"; `llama-server --list-devices`: {b['devices']}" if b.get("devices") else "")
            + (f"; {b['note']}" if b.get("note") else "")]
