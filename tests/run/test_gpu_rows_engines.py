"""The runner end to end with the real transformers engine and a fake NVML of two GPUs: every row has both
devices (tests/backends/test_engine_modes.py has the same without an engine).

Tests that start a real engine live in modules named *_engines.py: tests/conftest.py runs them on one xdist
worker, one after another."""

import pytest

from kvbench.common.hardware import NVML
from tests.backends.test_engine_modes import _EngineTree
from tests.fakes.fake_nvml import FakeDevice, FakeNVML, GiB


@pytest.mark.engine
def test_a_real_run_writes_per_gpu_rows_through_a_two_gpu_fake_nvml(tmp_path, monkeypatch):
    """The runner end to end with the real transformers engine (on the CPU) and a fake NVML of two GPUs on
    which that engine's processes hold 3 GiB and 1 GiB: every row has both devices, the mode and the GPUs."""
    import io

    from rich.console import Console

    from kvbench.run.backend_config import BackendConfig
    from kvbench.run.runner import Runner, RunOptions
    from kvbench.store.readers import load_cells
    from kvbench.workloads import load
    from tests.helpers import engine_env

    engine_env("hf")
    gpu0, gpu1 = _EngineTree(3 * GiB), _EngineTree(GiB)
    fake = FakeNVML([FakeDevice("NVIDIA H100", total=80 * GiB, used=lambda t: sum(b for _, b in gpu0.items()),
                                compute=gpu0),
                     FakeDevice("NVIDIA H100", total=80 * GiB, used=lambda t: sum(b for _, b in gpu1.items()),
                                compute=gpu1)])
    monkeypatch.setattr("kvbench.run.runner.NVML", lambda: NVML(module=fake))
    # one cell of two requests: the rows' GPU fields are what is checked, not the ladder
    one_cell = load("smoke").model_copy(update={"prompt_tokens": [128], "concurrency": [2], "warmup_requests": 0})
    opts = RunOptions(model="smollm2", workload=one_cell, backends=[BackendConfig.parse("hf:engine_mode=deployed")],
                      results_dir=tmp_path, run_id="run", start_timeout_s=300, request_timeout_s=300, estimate=False)
    cells = load_cells(Runner(opts, Console(file=io.StringIO(), width=200)).run())
    assert (cells.status == "ok").all() and (cells.engine_mode == "deployed").all() and (cells.gpus_used == 1).all()
    for devices in cells.gpu_devices:
        assert [d["index"] for d in devices] == [0, 1] and [d["total_bytes"] for d in devices] == [80 * GiB] * 2
        # the engine's processes (the worker, at least) on each device: whole multiples of its share
        assert devices[0]["process_peak_bytes"] >= 3 * GiB and devices[0]["process_peak_bytes"] % (3 * GiB) == 0
        assert devices[1]["process_peak_bytes"] >= GiB and devices[1]["over_baseline_peak_bytes"] >= GiB
    assert (cells.weights_bytes_engine == 269_030_272).all()  # SmolLM2's bf16 parameters, as the worker loaded them
    # the overhead is the fullest device's use over its baseline minus the weights and the cache
    assert cells.gpu_overhead_bytes_per_gpu.notna().all()
