"""run.json's environment record: CPU speed flags, threads, GPU driver and clocks; how two machines differ."""
import types

from kvbench.common import hardware
from kvbench.common.hardware import NVML, gpu_info, hardware_differences, hardware_key, hardware_line

from tests.fakes.fake_nvml import FakeDevice, FakeNVML

GiB = 2**30


def test_the_environment_records_flags_and_threads():
    env = hardware.environment_info()
    assert set(env["cpu_flags"]) <= set(hardware.SPEED_FLAGS)
    assert {"cpus_allowed", "OMP_NUM_THREADS"} <= set(env["threads"])
    assert env["threads"]["cpus_allowed"] is None or 1 <= env["threads"]["cpus_allowed"] <= (env["cpu_count"] or 10**6)


def test_gpu_info_with_driver_and_clocks_where_nvml_answers():
    nv = FakeNVML([FakeDevice("NVIDIA H200", total=141 * GiB)])
    # clocks: the fake answers SM 1980 MHz max, 1755 now; no memory clock, no power limit (not supported)
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_CLOCK_GRAPHICS = 1, 2, 0
    nv.nvmlDeviceGetMaxClockInfo = lambda h, kind: {1: 1980}.get(kind) or (_ for _ in ()).throw(RuntimeError("n/a"))
    nv.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1755, 0: 1755}[kind] if kind in (0, 1) else 1 / 0
    gpus = gpu_info(NVML(nv))
    assert gpus[0]["name"] == "NVIDIA H200" and gpus[0]["driver_version"] == "570.124.06"
    assert gpus[0]["sm_clock_max_mhz"] == 1980 and gpus[0]["sm_clock_mhz"] == 1755
    assert gpus[0]["memory_clock_mhz"] is None and gpus[0]["power_limit_w"] is None
    assert "driver 570.124.06" in hardware_line({"cpu": "x", "cpu_count": 8, "gpus": gpus})
    assert gpu_info(NVML(types.SimpleNamespace(nvmlInit=lambda: 1 / 0))) == []


def test_two_machines_that_differ_in_avx512_are_told_apart():
    a = {"cpu": "AMD EPYC", "cpu_count": 2, "cpu_flags": ["avx2", "avx512f", "avx512_bf16"], "gpus": []}
    b = {**a, "cpu_flags": ["avx2"]}
    assert hardware_differences(a, a) == []
    assert hardware_differences(a, b) == ["cpu_flags: ['avx2', 'avx512_bf16', 'avx512f'] vs ['avx2']"]
    old = {k: v for k, v in a.items() if k != "cpu_flags"}  # a run from before flags were recorded
    assert hardware_differences(a, old) == [] and "cpu_flags" not in hardware_key(old)
    assert hardware_differences(a, {**a, "gpus": [{"name": "NVIDIA H200"}]})[0].startswith("gpus:")
    assert "flags avx2 avx512f avx512_bf16" in hardware_line(a)
    assert "flags not recorded" in hardware_line(old)
    # a driver upgrade is not different hardware: compare warns about it instead
    from kvbench.common.hardware import driver_differences

    h200 = {**a, "gpus": [{"name": "NVIDIA H200", "driver_version": "570.1"}]}
    newer = {**a, "gpus": [{"name": "NVIDIA H200", "driver_version": "575.2"}]}
    assert hardware_differences(h200, newer) == [] and driver_differences(h200, newer) == [
        "GPU driver: ['570.1'] vs ['575.2']"]
