"""kvbench run --memory-limit: each engine's whole tree in a memory wall (a memory cgroup, the CPU stand-in
for a GPU's memory). Real engines: transformers (its worker held 351 MiB at its peak here: torch and the bf16 weights) is killed at a 250 MiB
wall while llama.cpp (108 MiB: the mmapped GGUF and a small pool) runs under the same wall, in one run."""
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvbench.common.memory_wall import MemoryWallError, detect
from kvbench.store.readers import load_cells, load_run_info

pytestmark = pytest.mark.engine


def _wall_root() -> str | None:
    try:
        return detect()
    except MemoryWallError:
        return None


def _cwd(p: psutil.Process) -> str | None:
    try:
        return p.cwd()
    except psutil.Error:
        return None


def _kvbench(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=900)


@pytest.mark.timeout(900)
def test_an_engine_past_the_wall_fails_its_cells_and_the_other_runs(tmp_path, smollm2):
    assert _wall_root() is not None, "this machine (root, a memory cgroup) can make a wall: CI runs here"
    before = {p.pid for p in psutil.process_iter()}
    out = _kvbench("run", "-b", "hf", "-b", "llamacpp", "--workload", "smoke", "--memory-limit", "250MiB",
                   "--results-dir", str(tmp_path), "--run-id", "wall", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]  # not every cell failed
    run_dir = tmp_path / "wall"
    cells = load_cells(run_dir)
    hf, llama = cells[cells.engine == "hf"], cells[cells.engine == "llamacpp"]
    assert len(hf) == len(llama) == 4
    assert (hf.status == "failed").all()
    assert hf.error.str.contains("out of memory at the 250.0 MiB wall", regex=False).all(), hf.error.tolist()
    assert (llama.status == "ok").all(), llama.error.tolist()
    info = load_run_info(run_dir)
    assert info["memory_limit_bytes"] == 250 * 2**20
    walls = info["memory_walls"]
    assert {k.split(" ")[0] for k in walls} == {"hf-5.24.0", next(b for b in cells.backend.unique() if "llama" in b)}
    hf_wall = next(v for k, v in walls.items() if k.startswith("hf"))
    assert hf_wall["oom_kills"] >= 1 and hf_wall["limit_bytes"] == 250 * 2**20
    assert hf_wall["peak_bytes"] <= 250 * 2**20
    llama_wall = next(v for k, v in walls.items() if not k.startswith("hf"))
    assert llama_wall["oom_kills"] == 0 and 0 < llama_wall["peak_bytes"] <= 250 * 2**20
    # nothing of either engine's tree is left (kvbench ran in tmp_path: its children inherited that folder)
    assert [p.pid for p in psutil.process_iter() if p.pid not in before and _cwd(p) == str(tmp_path)] == []
    for wall in walls.values():
        assert not Path(wall["path"]).exists()


def test_a_bad_memory_limit_is_one_line_and_no_run_folder(tmp_path):
    out = _kvbench("run", "-b", "llamacpp", "--memory-limit", "lots", "--results-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2
    assert "not a size" in out.stderr + out.stdout
    assert list(tmp_path.iterdir()) == []
