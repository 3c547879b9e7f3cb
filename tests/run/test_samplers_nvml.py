"""The NVML side of the memory sampler, against a fake NVML (tests/fakes/fake_nvml.py): no GPU needed."""
import subprocess
import sys
import time

import psutil
import pytest

from kvbench.run.samplers import NVML, ProcessTreeMemorySampler
from tests.fakes.fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND, FakeDevice, FakeNVML, GiB

MiB = 1 << 20


@pytest.fixture
def tree():
    """A real process tree: a parent with one child (pids outside it must not be counted)."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 10
    while not psutil.Process(parent.pid).children() and time.time() < deadline:
        time.sleep(0.02)
    children = psutil.Process(parent.pid).children(recursive=True)
    assert children, "the child process did not start"
    yield parent.pid, children[0].pid
    for c in children:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    parent.kill()
    parent.wait()


def run_sampler(sampler, seconds: float):
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    return sampler.samples


def test_device_memory_v2_total_reserved_used():
    nv = FakeNVML([FakeDevice(total=80 * GiB, used=3 * GiB, reserved=GiB),
                   FakeDevice(total=80 * GiB, used=5 * GiB, reserved=GiB)])
    nvml = NVML(module=nv)
    assert nvml.available and nvml.error is None and len(nvml.handles) == 2
    mem = nvml.device_memory()
    assert [(d.total, d.used, d.reserved) for d in mem] == [(80 * GiB, 4 * GiB, GiB), (80 * GiB, 6 * GiB, GiB)]
    assert nvml.memory_api == "v2"
    assert nvml.device_used_bytes() == 10 * GiB
    assert nvml.devices()[0] == {"index": 0, "name": "NVIDIA H200", "memory_bytes": 80 * GiB, "reserved_bytes": GiB}
    # what kvbench.common.hardware.environment_info reads directly
    assert nvml.nv.nvmlDeviceGetMemoryInfo(nvml.handles[0]).total == 80 * GiB


@pytest.mark.parametrize("mode", ["not_supported", "missing", "old_binding"])
def test_v2_falls_back_to_v1_with_the_same_used_figure(mode):
    device = FakeDevice(total=80 * GiB, used=3 * GiB, reserved=GiB)
    v2 = NVML(module=FakeNVML([device])).device_memory()[0]
    nv = FakeNVML([device], v2=mode)
    nvml = NVML(module=nv)
    v1 = nvml.device_memory()[0]
    assert nvml.memory_api == "v1"
    assert (v1.total, v1.used, v1.free) == (v2.total, v2.used, v2.free)
    assert v1.reserved is None
    nvml.device_memory()
    assert nv.calls.get("v2", 0) == 0 and nv.calls["v1"] == 2  # v2 is not retried on every sample


@pytest.mark.parametrize("code", [NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_gpu_means_unavailable_and_samples_carry_none(code):
    nvml = NVML(module=FakeNVML(init_error=code))
    assert not nvml.available and nvml.handles == []
    assert "Not Found" in nvml.error or "Not Loaded" in nvml.error
    assert nvml.idle_baseline() is None
    samples = run_sampler(ProcessTreeMemorySampler(psutil.Process().pid, 50, nvml), 0.2)
    assert samples
    for s in samples:
        assert s.rss_bytes > 0
        assert s.gpu_process_bytes is None and s.gpu_device_used_bytes is None
        assert s.gpu_device_reserved_bytes is None and s.gpu_device_total_bytes is None
        assert s.gpu_device_over_baseline_bytes is None


def test_no_device_listed_is_unavailable():
    nvml = NVML(module=FakeNVML([]))
    assert not nvml.available and nvml.error == "NVML found no device"


def test_real_pynvml_on_this_machine_does_not_raise():
    nvml = NVML()  # nvidia-ml-py without a driver: unavailable with a reason, never an exception
    assert nvml.available or nvml.error


def test_process_tree_attribution_counts_only_pids_in_the_tree(tree):
    root, child = tree
    outsider = 1 if root != 1 else 2
    nv = FakeNVML([FakeDevice(compute={root: 100 * MiB, child: 2 * GiB, outsider: 7 * GiB},
                              graphics={child: 2 * GiB}),  # one process, both kinds of context: once
                   FakeDevice(compute={child: 300 * MiB}, graphics={outsider: GiB})])
    nvml = NVML(module=nv)
    samples = run_sampler(ProcessTreeMemorySampler(root, 50, nvml), 0.3)
    assert samples and all(s.gpu_process_bytes == 100 * MiB + 2 * GiB + 300 * MiB for s in samples)
    assert all(s.n_processes == 2 for s in samples)
    mem = nvml.process_memory({root, child})
    assert mem.pids_found == {root, child} and outsider in mem.pids_listed
    assert nv.calls["graphics"] > 0


def test_process_bytes_none_when_nvml_has_no_figure_and_zero_when_not_listed():
    nvml = NVML(module=FakeNVML([FakeDevice(compute={10: None, 11: 5 * MiB})]))
    assert nvml.process_bytes({10}) is None
    assert nvml.process_memory({10}).pids_unknown_bytes == {10}
    assert nvml.process_bytes({10, 11}) == 5 * MiB
    assert nvml.process_bytes({99}) == 0


def test_graphics_not_supported_still_counts_compute():
    nvml = NVML(module=FakeNVML([FakeDevice(compute={10: 5 * MiB})], graphics="not_supported"))
    assert nvml.process_bytes({10}) == 5 * MiB


def test_sampler_rate_is_at_least_20_hz_with_nvml(tree):
    root, child = tree
    nvml = NVML(module=FakeNVML([FakeDevice(compute={child: GiB})], clock=None))
    samples = run_sampler(ProcessTreeMemorySampler(root, 20.0, nvml), 1.0)
    span = samples[-1].t - samples[0].t
    assert (len(samples) - 1) / span >= 19.0  # 20 Hz, within scheduling jitter
    assert len(samples) >= 19
    fast = run_sampler(ProcessTreeMemorySampler(root, 50.0, nvml), 0.5)
    assert (len(fast) - 1) / (fast[-1].t - fast[0].t) >= 40


def test_idle_baseline_and_subtraction_follow_memory_over_time(tree):
    root, child = tree
    clock = {"t": 0.0}
    # 2 GiB already used by someone else; the engine's 6 GiB arrive at t >= 1.
    dev = FakeDevice(total=80 * GiB, reserved=GiB, used=lambda t: 2 * GiB + (6 * GiB if t >= 1 else 0),
                     compute={4242: 2 * GiB, child: lambda t: 6 * GiB if t >= 1 else None})
    nvml = NVML(module=FakeNVML([dev], clock=lambda: clock["t"]))
    baseline = nvml.idle_baseline(readings=3, interval_s=0.0)
    assert baseline.device_used_bytes == [3 * GiB]  # allocations + the reserve
    assert baseline.device_reserved_bytes == [GiB] and baseline.device_total_bytes == [80 * GiB]
    assert baseline.process_bytes == {4242: 2 * GiB, child: None}
    assert baseline.to_dict()["used_bytes"] == 3 * GiB
    sampler = ProcessTreeMemorySampler(root, 50, nvml, baseline=baseline)
    sampler.sample()
    clock["t"] = 1.5
    sampler.sample()
    before, after = sampler.samples
    assert before.gpu_device_over_baseline_bytes == 0 and before.gpu_process_bytes is None
    assert after.gpu_device_over_baseline_bytes == 6 * GiB and after.gpu_process_bytes == 6 * GiB
    assert after.gpu_device_used_bytes == 9 * GiB and after.gpu_device_reserved_bytes == GiB
    assert after.gpu_device_total_bytes == 80 * GiB


def test_baseline_takes_the_lowest_reading():
    readings = iter([5 * GiB, 3 * GiB, 4 * GiB])
    nv = FakeNVML([FakeDevice(reserved=0, used=lambda t: next(readings))])
    assert NVML(module=nv).idle_baseline(readings=3, interval_s=0.0).device_used_bytes == [3 * GiB]


def test_sampler_follows_children_that_start_and_end_during_a_cell():
    """The tree is listed again every TREE_REFRESH_S and at once when one of its processes ends, so a
    worker the engine starts mid-run is counted within that time and one that ended drops out. The parent
    prints when its child started and ended (perf_counter: the same monotonic clock as the samples'), so on a
    machine that starves the sampler the samples it did take are judged against those moments, not a schedule."""
    code = ("import subprocess, sys, time; time.sleep(0.6); t = time.perf_counter(); "
            "c = subprocess.Popen(['sleep', '60']); time.sleep(1.2); c.kill(); c.wait(); "
            "print(t, time.perf_counter(), flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        sampler = ProcessTreeMemorySampler(parent.pid, 20.0)
        samples = run_sampler(sampler, 2.6)
        started, ended = map(float, parent.stdout.readline().split())
    finally:
        parent.kill()
        parent.wait()
    assert samples[0].n_processes == 1 and samples[-1].n_processes == 1  # before the child starts and after it ended
    assert any(s.n_processes == 2 for s in samples)
    listed_after_start = [s for s in samples if started + sampler.TREE_REFRESH_S + 0.1 < s.t < ended - 0.05]
    assert all(s.n_processes == 2 for s in listed_after_start), [(s.t - started, s.n_processes) for s in samples]
    assert all(s.n_processes == 1 for s in samples if s.t > ended + 0.1)
