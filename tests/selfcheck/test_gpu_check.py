"""selfcheck/gpu_check/ without a GPU: the "no GPU" exit, the pure table functions on fake measurements, and
the measuring steps driven end to end by a fake probe (tests/fakes/fake_gpu_probe.py) and a fake NVML."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kvbench.common.hardware import NVML
from kvbench.selfcheck import gpu_check as gc
from tests.fakes.fake_nvml import FakeDevice, FakeNVML
from tests.helpers import REPO

ROOT = REPO  # the repository
FAKE_PROBE = ROOT / "tests" / "fakes" / "fake_gpu_probe.py"
MiB, GiB = 2**20, 2**30


def test_without_a_gpu_it_says_so_runs_nothing_and_exits_3(tmp_path):
    if NVML().available:
        pytest.skip("this machine has an NVIDIA GPU")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvbench.selfcheck.gpu_check", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "no NVIDIA GPU found (NVML: " in proc.stderr
    assert "the GPU checks need one; nothing was run" in proc.stderr
    assert not out.exists()


def test_kv_cells_fit_the_context():
    assert gc.kv_cells(8192) == [(1024, 1), (4096, 1), (4096, 4), (8176, 1), (8176, 8)]
    assert gc.kv_cells(131072)[:5] == [(1024, 1), (4096, 1), (4096, 4), (16384, 1), (32768, 1)]
    assert gc.kv_cells(2048) == [(1024, 1), (2032, 1), (2032, 8)]


def fake_kv_row(cache=23040 * 1039, allocator_extra=1024, nvml_extra=2 * MiB):
    before = {"event": "cell_before", "prompt": 1024, "batch": 1, "allocated": 300 * MiB}
    after = {"event": "cell_after", "prompt": 1024, "batch": 1, "new": 16, "seconds": 0.1, "cache_bytes": cache,
             "allocated": 300 * MiB + cache + allocator_extra, "max_allocated": 300 * MiB + 3 * cache}
    return gc.kv_row("smollm2", 23040 * 1039, before, after, {"device_used": GiB, "process_bytes": 800 * MiB},
                     {"device_used": GiB + cache + nvml_extra, "process_bytes": 800 * MiB + cache + nvml_extra})


def test_kv_row_three_ways():
    r = fake_kv_row()
    assert r["cache_ok"] and r["allocator_ok"] and r["nvml_ok"]
    assert r["cache_over_predicted"] == 1.0 and r["allocator_delta_bytes"] == 23040 * 1039 + 1024
    assert r["nvml_process_delta_bytes"] == r["nvml_device_delta_bytes"] == 23040 * 1039 + 2 * MiB
    assert r["allocator_peak_delta_bytes"] == 3 * 23040 * 1039
    bad = fake_kv_row(cache=23040 * 1000, nvml_extra=GiB)
    assert bad["cache_ok"] is False and bad["nvml_ok"] is False and bad["allocator_ok"]


def test_sampler_row_and_verdict():
    events = {"ready": {"allocated": 0}, "allocated": {"allocated": 4 * GiB}}
    snaps = {"ready": {"device_used": GiB, "process_bytes": 500 * MiB},
             "allocated": {"device_used": 5 * GiB + 2 * MiB, "process_bytes": 4596 * MiB, "process_found": True}}
    s = gc.sampler_row(4 * GiB, events, snaps, {"hz": 20.3, "samples": 40, "device_over_ready": 4 * GiB + 2 * MiB,
                                                "process_over_ready": 4 * GiB})
    assert s["device_ok"] and s["process_ok"] and s["sampled_ok"] and s["rate_ok"]
    result = {"sampler": s, "kv": [fake_kv_row()], "engines": [gc.engine_row("vllm", "not installed", [], None)],
              "skipped": []}
    assert gc.verdict(result) == (True, [])
    slow = gc.sampler_row(4 * GiB, events, snaps, {"hz": 9.0, "samples": 10, "device_over_ready": 0})
    result["sampler"] = slow
    result["engines"].append(gc.engine_row("hf", "time box (100 s) reached", [], 100.0))
    ok, problems = gc.verdict(result)
    assert not ok and any("sampler rate" in p for p in problems) and any("sampled device delta" in p for p in problems)
    assert any("hf: time box" in p for p in problems)


def test_engine_row_takes_the_largest_ok_cell():
    cells = [{"status": "ok", "prompt_tokens": 1024, "concurrency": 1, "kv_bytes_peak_predicted": 10, "kv_in_use_peak_bytes": 11},
             {"status": "ok", "prompt_tokens": 8064, "concurrency": 16, "kv_bytes_peak_predicted": 99,
              "kv_in_use_peak_bytes": 100, "gpu_process_peak_bytes": 5 * GiB},
             {"status": "failed", "prompt_tokens": 9999, "concurrency": 16, "kv_bytes_peak_predicted": 1000}]
    r = gc.engine_row("vllm", "finished", cells, 80.0)
    assert (r["cells"], r["cells_ok"], r["largest_cell"], r["kv_in_use_bytes"]) == (3, 2, "8064 x16", 100)


def test_markdown_has_the_command_and_every_table():
    result = {"id": "x", "command": "python -m kvbench.selfcheck.gpu_check --out results/gpu/x", "started_at": "now", "seconds": 42.0,
              "environment": {"gpus": [{"name": "NVIDIA H200", "memory_bytes": 141 * GiB}], "driver": "570",
                              "memory_api": "v2", "torch": "2.13.0", "cuda": "12.8", "transformers": "5.24.0",
                              "torch_python": "/x/python"},
              "kv": [fake_kv_row(), {"model": "m", "prompt_tokens": 8176, "batch": 8, "predicted_bytes": 1.0,
                                     "error": "CUDA out of memory: fake"}],
              "engines": [gc.engine_row("vllm", "finished", [], 12.0)], "skipped": []}
    md = gc.render_markdown(result)
    assert "`python -m kvbench.selfcheck.gpu_check --out results/gpu/x`" in md
    assert "## (a)" in md and "not run" in md and "## (b)" in md and "## (c)" in md
    assert "| smollm2 | 1024 | 1 | 22.83 MiB |" in md and "CUDA out of memory: fake" in md
    assert "NVIDIA H200 (141.00 GiB)" in md and "**Problems:**" in md


# --- the measuring steps, end to end with a fake probe and a fake NVML ----------------------------------

class StateProcs(dict):
    """Compute processes as the fake probe last wrote them ("pid bytes")."""

    def __init__(self, state: Path):
        super().__init__()
        self.state = state

    def items(self):
        text = self.state.read_text().split() if self.state.exists() else []
        return [(int(text[0]), int(text[1]))] if text else []


def fake_nvml(tmp_path, monkeypatch, procs_class=StateProcs):
    """A fake H200 whose compute processes are what the fake probe writes: (its NVML, its processes)."""
    state = tmp_path / "gpu_state"
    monkeypatch.setenv("FAKE_GPU_STATE", str(state))
    procs = procs_class(state)

    def used(t):
        return 2 * GiB + sum(b for _, b in procs.items())  # 2 GiB held by someone else

    (tmp_path / "logs").mkdir()
    return NVML(module=FakeNVML([FakeDevice(total=141 * GiB, used=used, compute=procs)])), procs


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    return fake_nvml(tmp_path, monkeypatch)[0], tmp_path


def test_check_sampler_end_to_end(fake_gpu):
    nvml, tmp = fake_gpu
    row = gc.check_sampler(nvml, sys.executable, 4 * GiB, gc.Budget(60), tmp / "logs", script=FAKE_PROBE)
    assert row["requested_bytes"] == row["allocator_delta_bytes"] == 4 * GiB
    assert row["nvml_device_delta_bytes"] == row["nvml_process_delta_bytes"] == 4 * GiB
    # the sampler's figures with the row: once on busy cores (2026-12-05) no sample saw the held 4 GiB
    assert row["sampled_device_delta_bytes"] == 4 * GiB and row["sampled_process_delta_bytes"] == 4 * GiB, row
    assert row["process_found"] and row["device_ok"] and row["sampled_ok"] and row["rate_ok"], row
    assert row["freed_device_delta_bytes"] == 0 and row["baseline"]["used_bytes"] >= 2 * GiB


class StallingProcs(StateProcs):
    """StateProcs whose first read by the sampler's thread once the probe is ready waits until the probe holds
    its allocation: a sample stamped before go() that reads after it (a thread descheduled on busy cores)."""

    def __init__(self, state: Path):
        super().__init__(state)
        self.stalled = threading.Event()

    def items(self):
        held = super().items()
        if held and threading.current_thread() is not threading.main_thread() and not self.stalled.is_set():
            self.stalled.set()
            deadline = time.monotonic() + 20
            while super().items() == held and time.monotonic() < deadline:
                time.sleep(0.005)
            held = super().items()
        return held


def test_a_sample_that_reads_after_the_allocation_is_not_the_ready_baseline(tmp_path, monkeypatch):
    """Once on busy cores (2026-12-05) the sampled delta read 0 over a held 4 GiB: the baseline was the last
    sample stamped before go(), and that sample had read the allocation."""
    nvml, procs = fake_nvml(tmp_path, monkeypatch, StallingProcs)
    row = gc.check_sampler(nvml, sys.executable, 4 * GiB, gc.Budget(60), tmp_path / "logs", script=FAKE_PROBE)
    assert procs.stalled.is_set()
    assert row["sampled_device_delta_bytes"] == row["sampled_process_delta_bytes"] == 4 * GiB, row
    assert row["sampled_ok"], row


def test_check_kv_end_to_end(fake_gpu):
    nvml, tmp = fake_gpu
    model = tmp / "model"
    model.mkdir()
    # 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 2 bytes = 256 bytes per token, as the fake probe assumes
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    rows = gc.check_kv(nvml, sys.executable, model, "tiny", gc.Budget(120), tmp / "logs", script=FAKE_PROBE)
    assert [(r["prompt_tokens"], r["batch"]) for r in rows] == [(1024, 1), (4080, 1), (4080, 8)]
    ok = rows[0]
    assert ok["predicted_bytes"] == ok["cache_bytes"] == 256 * (1024 + gc.NEW_TOKENS - 1)
    assert ok["cache_ok"] and ok["allocator_ok"] and ok["nvml_ok"]
    assert ok["nvml_device_delta_bytes"] == ok["cache_bytes"] + 2 * MiB
    assert rows[2]["error"].startswith("CUDA out of memory")
    result = {"kv": rows, "sampler": None, "skipped": []}
    ok_all, problems = gc.verdict(result)
    assert not ok_all and any("4080 x8" in p for p in problems)


# --- issue 15 item 6: three geometries by default, the overhead, llama.cpp's CUDA build ------------------

def test_check_kv_measures_the_overhead_besides_weights_and_kv(fake_gpu):
    """(d) from the fake probe: its CUDA context is 500 MiB, its weights 100 MiB, and each cell's allocator peak
    during generate is twice its cache (the activations are one cache more)."""
    nvml, tmp = fake_gpu
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    overhead = []
    rows = gc.check_kv(nvml, sys.executable, model, "tiny", gc.Budget(120), tmp / "logs", script=FAKE_PROBE,
                       overhead=overhead)
    (o,) = overhead
    largest = 256 * (4080 + gc.NEW_TOKENS - 1)  # the largest cell that ran (4080 x8 ran out of memory)
    assert o["context_bytes"] == 500 * MiB and o["weights_bytes"] == 100 * MiB
    assert o["loaded_device_delta_bytes"] == 600 * MiB and o["at_load_bytes"] == 500 * MiB
    assert o["largest_cell"] == (4080, 1) and o["activations_peak_bytes"] == largest
    assert o["overhead_bytes"] == 500 * MiB + largest
    assert o["over_assumption"] == pytest.approx((500 * MiB + largest) / (1.5 * GiB))
    md = gc.render_markdown({"kv": rows, "overhead": overhead, "skipped": []})
    assert "## (d) runtime overhead" in md and "| tiny | 500.00 MiB | 100.00 MiB | 500.00 MiB |" in md


def test_the_default_configs_are_an_8b_gqa_a_hybrid_window_and_an_mla_geometry():
    from kvbench.kv.model_config import geometry_from_hf

    geoms = [geometry_from_hf(gc.CONFIG_DIR / name) for name in gc.DEFAULT_CONFIGS]
    gqa, hybrid, mla = geoms
    assert (gqa.num_layers, gqa.num_kv_heads, gqa.num_attention_heads) == (32, 8, 32)
    assert hybrid.num_sliding_layers and hybrid.num_sliding_layers < hybrid.num_layers
    assert mla.mla is not None and gqa.mla is None
    # and they travel: small text files in the repository
    assert sum((gc.CONFIG_DIR / n).stat().st_size for n in gc.DEFAULT_CONFIGS) < 64 * 1024


def test_llama_cuda_build_from_a_source_archive(tmp_path, monkeypatch):
    """(e) with a stand-in cmake on PATH: the archive is unpacked, configured with CUDA for this GPU, the server
    target built and asked for its devices; a failing step is reported, never raised."""
    import tarfile

    src = tmp_path / "pack" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(llama)")
    archive = tmp_path / "llama.cpp-src.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(src, arcname="llama.cpp")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "cmake").write_text(f"""#!/bin/sh
echo "$@" >> {calls}
if [ "$1" = "--build" ]; then
  mkdir -p "$2/bin"
  printf '#!/bin/sh\\necho "Available devices:"\\necho "  CUDA0: NVIDIA H200 (143156 MiB, 142000 MiB free)"\\n' > "$2/bin/llama-server"
  chmod +x "$2/bin/llama-server"
fi
[ -z "$FAIL_BUILD" ] || [ "$1" != "--build" ]
""")
    (bin_dir / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    row = gc.build_llama(archive, out, gc.Budget(120), arch="90")
    assert row["status"] == "built" and row["devices"] == "CUDA0: NVIDIA H200 (143156 MiB, 142000 MiB free)"
    configure, build = calls.read_text().splitlines()
    assert "-DGGML_CUDA=ON" in configure and "-DCMAKE_CUDA_ARCHITECTURES=90" in configure
    assert f"-S {out}/llama-src/llama.cpp" in configure and build.startswith("--build") and "llama-server" in build
    monkeypatch.setenv("FAIL_BUILD", "1")
    (tmp_path / "out2" / "logs").mkdir(parents=True)
    failed = gc.build_llama(archive, tmp_path / "out2", gc.Budget(120))
    assert failed["status"] == "`cmake --build` exited 1" and failed["devices"] is None
    assert gc.build_llama(archive, out, gc.Budget(20))["status"] == "skipped: time budget"
    md = gc.render_markdown({"llama_build": row, "skipped": []})
    assert "## (e) llama.cpp's CUDA server built here" in md and "CUDA0: NVIDIA H200" in md


def llama_sdist(version: str) -> Path:
    """PyPI's llama-cpp-python sdist of ``version``, fetched once into $KVBENCH_HOME/sdists/ with the pip
    command the llama.cpp recipe's scripts use (backends/llamacpp/scripts/*.sh; `make test` has just fetched
    the same file for llama.cpp's environment, so pip's cache usually serves it). A failed download fails."""
    from kvbench.common.envs import kvbench_home

    cache = kvbench_home() / "sdists"
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if sdist.exists():
        return sdist
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=cache, prefix=".download-"))
    try:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                              f"llama-cpp-python=={version}", "-d", str(partial)], capture_output=True, text=True,
                             timeout=400, check=False)
        assert got.returncode == 0, f"pip download of the llama-cpp-python {version} sdist failed: {got.stderr}"
        os.replace(partial / sdist.name, sdist)  # whole or not at all
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return sdist


@pytest.mark.timeout(900)  # a first download of the 77 MB sdist, then xz on a shared 2-core machine
def test_the_packed_llama_source_fits_a_gpu_loan(tmp_path):
    """pack_llama_source.sh trims the 77 MB sdist of the llama.cpp adapter's default version to what builds
    llama-server (and the converter): under 64 MiB, with the server's and CUDA backend's sources and without
    the vocab GGUFs. The real sdist, not a stand-in: what is checked is its layout and size. xz at its
    fastest level (XZ_OPT=-0, which tar passes on): 10.3 MB in 1.9 s against the default level's 8.0 MB in
    26 s, so the size checked is an upper bound of the archive the script makes for a loan."""
    import tarfile

    from kvbench.backends import REGISTRY

    version = REGISTRY["llamacpp"].default_version
    script = ROOT / "backends" / "llamacpp" / "scripts" / "pack_llama_source.sh"
    out = subprocess.run(["bash", str(script), version, str(tmp_path), str(llama_sdist(version))],
                         capture_output=True, text=True, timeout=400, env={**os.environ, "XZ_OPT": "-0"})
    assert out.returncode == 0, out.stderr
    archive = Path(out.stdout.strip().splitlines()[-1])
    assert archive.stat().st_size < 64 * MiB
    names = tarfile.open(archive).getnames()
    for needed in ("llama.cpp/CMakeLists.txt", "llama.cpp/tools/server/server.cpp", "llama.cpp/tools/ui",
                   "llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt", "llama.cpp/convert_hf_to_gguf.py"):
        assert needed in names, needed
    assert not any(n.startswith(("llama.cpp/models/", "llama.cpp/docs/")) for n in names)


def test_gpu_check_runs_from_a_checkout_that_is_not_installed(tmp_path):
    """make gpu-check without .venv (a GPU machine lent with no network): selfcheck/uninstalled.py maps the
    package as pyproject.toml does, so every module comes from that checkout; here it exits 3 (no GPU)."""

    copy = tmp_path / "checkout"
    for folder in ("bench", "backends", "workloads", "selfcheck"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys; sys.path.insert(0, 'selfcheck'); import uninstalled; uninstalled.register(); "
            "import kvbench.selfcheck.gpu_check as g, kvbench.backends.vllm.adapter as v, kvbench.workloads as w; "
            "print(g.__file__); print(v.__file__); print(w.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(copy / "selfcheck" / "gpu_check" / "__init__.py"),
                                  str(copy / "backends" / "vllm" / "adapter.py"), str(copy / "workloads" / "__init__.py")]
    # the package's __main__ runs through that path too (--help: no GPU needed), and finds its probe in the copy
    helped = subprocess.run([sys.executable, "selfcheck/uninstalled.py", "kvbench.selfcheck.gpu_check", "--help"],
                            cwd=copy, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: python -m kvbench.selfcheck.gpu_check") and "--llama-source" in helped.stdout
    code = ("import sys; sys.path.insert(0, 'selfcheck'); import uninstalled; uninstalled.register(); "
            "from kvbench.selfcheck.gpu_check.probe import probe_script; print(probe_script())")
    probe = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True, timeout=120)
    assert Path(probe.stdout.strip()) == (copy / "backends" / "hf" / "scripts" / "gpu_probe.py").resolve(), probe.stderr
    if not NVML().available:
        run = subprocess.run([sys.executable, "selfcheck/uninstalled.py", "kvbench.selfcheck.gpu_check"], cwd=copy,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 3 and "nothing was run" in run.stderr


def test_the_cuda_architecture_comes_from_nvml():
    fake = FakeNVML([FakeDevice()])
    assert gc.cuda_architecture(NVML(module=fake)) == "native"  # a binding without the call
    fake.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)
    assert gc.cuda_architecture(NVML(module=fake)) == "90"


@pytest.mark.parametrize("read, ok, problem", [(4.1e12, True, None), (5.2e12, False, "1.08 of the specification"),
                                               (None, None, "the device read failed (exit 1)")])
def test_check_bandwidth_sets_the_device_read_beside_the_specification(tmp_path, monkeypatch, read, ok, problem):
    """(g) with a stand-in for gpu_probe.py bandwidth on a fake H200 (4,800 GB/s by its specification): a read
    within half of it and it is believable; above it, or none, and the check says so."""
    from kvbench.selfcheck.gpu_check import bandwidth as bw

    script = tmp_path / "probe.py"
    body = (f"print({json.dumps(json.dumps({'event': 'bandwidth', 'read_bytes_per_s': read, 'copy_bytes_per_s': 3.9e12}))})"
            if read else "raise SystemExit('CUDA error: out of memory')")
    script.write_text(body + "\n")
    monkeypatch.setattr(bw, "probe_script", lambda: script)
    result: dict = {}
    bw.run_bandwidth(result, NVML(module=FakeNVML([FakeDevice()])), sys.executable, gc.Budget(60))
    b = result["bandwidth"]
    assert b["spec_bytes_per_s"] == 4.8e12 and "TensorRT-LLM" in b["spec_source"] and b["ok"] is ok
    found = bw.problems(result)
    assert (not found) if problem is None else (problem in found[0])
    md = "\n".join(bw.markdown(result))
    assert "| NVIDIA H200 | 4,800 |" in md and ("| 4,100 | 3,900 | 0.8542 | yes |" in md if ok else True)
