"""The decode bound's denominator on a GPU machine (bench/run/device_bandwidth.py): the card's specification from
the catalogue by the name NVML gives, a device read by an engine environment that can, and which one divided."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.backends.capabilities import DeviceBandwidth
from kvbench.planner.shared import gpu_specs
from kvbench.run import device_bandwidth
from kvbench.run.backend_config import BackendConfig
from kvbench.run.rows import summarize

from tests.fakes.testkit import BYTES_PER_TOKEN
from tests.run.test_rows_summary import WORKLOAD, engine_run, measurement, request

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 81559 * 2**20}
A100_PCIE = {"name": "NVIDIA A100 80GB PCIe", "memory_bytes": 81920 * 2**20}


def test_every_catalogue_card_has_a_bandwidth_with_its_source_or_says_it_has_none():
    for name, card in gpu_specs().items():
        assert card.bandwidth_bytes_per_s and 1e11 <= card.bandwidth_bytes_per_s <= 1e13, name
        assert "(" in card.bandwidth_source and ")" in card.bandwidth_source, name  # the quoted words and where


def test_without_a_device_read_the_specification_divides_and_says_so(monkeypatch):
    monkeypatch.setattr(device_bandwidth, "measure_on_device", lambda backends: {"not_measured": "no engine can"})
    got = device_bandwidth.gpu_bandwidth({"gpus": [H100]}, [])
    assert got["bytes_per_s"] == got["spec_bytes_per_s"] == 3.35e12 and "TensorRT-LLM" in got["spec_source"]
    assert got["label"] == "per GPU, the card's specification; not measured: no engine can"
    # a form of the card whose figure differs (NVML's name says which), and a card the catalogue lacks
    pcie = device_bandwidth.gpu_bandwidth({"gpus": [A100_PCIE]}, [])
    assert pcie["bytes_per_s"] == 1.935e12 and pcie["spec_source"].startswith("NVIDIA A100 80GB PCIe: ")
    unknown = device_bandwidth.gpu_bandwidth({"gpus": [{"name": "NVIDIA Z9000", "memory_bytes": 2**34}]}, [])
    assert "bytes_per_s" not in unknown and "not in kvbench's catalogue" in unknown["not_measured"]


def test_a_device_read_divides_where_there_is_one_and_the_specification_is_kept_beside_it(monkeypatch):
    read = {"read_bytes_per_s": 2.9e12, "copy_bytes_per_s": 2.6e12, "engine": "hf"}
    monkeypatch.setattr(device_bandwidth, "measure_on_device", lambda backends: read)
    got = device_bandwidth.gpu_bandwidth({"gpus": [H100]}, [])
    assert (got["bytes_per_s"], got["spec_bytes_per_s"], got["measured"]) == (2.9e12, 3.35e12, read)
    assert "read on the device" in got["label"] and "hf's torch" in got["label"]


def test_the_first_installed_environment_that_measures_is_asked(monkeypatch, tmp_path):
    """vLLM's adapter measures nothing (the default); hf's environment is not installed, then is."""
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    backends = [BackendConfig.parse("vllm"), BackendConfig.parse("hf")]
    assert device_bandwidth.measure_on_device(backends) == {"not_measured": "hf's environment is not installed"}
    from kvbench.common import envs
    monkeypatch.setattr(envs, "is_installed", lambda recipe: True)
    monkeypatch.setattr(DeviceBandwidth, "measure", lambda self, python: {"read_bytes_per_s": 1e12, "python": str(python)})
    got = device_bandwidth.measure_on_device(backends)
    assert got["engine"] == "hf" and got["python"].startswith(str(tmp_path))
    # a server already on the GPU is not disturbed: no read where the run attaches to one
    attached = device_bandwidth.measure_on_device([*backends, BackendConfig.parse("vllm:url=http://127.0.0.1:8000")])
    assert "attaches to a server" in attached["not_measured"]


def stand_in(tmp_path: Path, body: str) -> DeviceBandwidth:
    script = tmp_path / "probe.py"
    script.write_text(f"import sys, json\nassert sys.argv[1:] == ['bandwidth', '--device', 'cuda']\n{body}\n")
    return DeviceBandwidth(script=script)


def test_the_capability_reads_its_scripts_line_or_says_why_not(tmp_path):
    assert "measures no device bandwidth" in DeviceBandwidth().measure(Path(sys.executable))["not_measured"]
    ok = stand_in(tmp_path, 'print("warming up"); print(json.dumps({"event": "bandwidth", "read_bytes_per_s": 5e11}))')
    assert ok.measure(Path(sys.executable)) == {"read_bytes_per_s": 5e11}
    crash = stand_in(tmp_path, 'raise SystemExit("CUDA error: no CUDA GPUs are available")')
    assert crash.measure(Path(sys.executable))["not_measured"] == \
        "the device read failed (exit 1): CUDA error: no CUDA GPUs are available"
    zero = stand_in(tmp_path, 'print(json.dumps({"read_bytes_per_s": 0}))')
    assert "failed (exit 0)" in zero.measure(Path(sys.executable))["not_measured"]
    slow = stand_in(tmp_path, "import time; time.sleep(5)")
    assert "did not finish: TimeoutExpired" in slow.measure(Path(sys.executable), timeout_s=0.5)["not_measured"]
    assert "did not finish" in ok.measure(tmp_path / "no-such-python")["not_measured"]


def test_a_gpu_rows_bound_reads_at_every_gpu_the_engine_is_split_over(tmp_path):
    from kvbench.run.decode_bound import decode_bound_columns

    probe = {"device": "gpu", "bytes_per_s": 1e12, "label": "per GPU, the card's specification"}
    run = replace(engine_run(tmp_path), memory_bandwidth=probe, checkpoint_bytes=10**9)
    one = summarize(run, measurement([request(0, 10.0)]))
    two = one.model_copy(update={"gpus_used": 2})
    decode_bound_columns(two, run.model.geometry, probe, 10**9, WORKLOAD.output_tokens)
    assert one.decode_step_bytes == pytest.approx(1e9 + 2 * 101 * BYTES_PER_TOKEN)
    assert two.itl_s_bound == pytest.approx(one.itl_s_bound / 2)
    assert "1,000.0 GB/s (per GPU, the card's specification)" in one.decode_bound_source
    assert "2,000.0 GB/s (per GPU, the card's specification, x 2 GPUs)" in two.decode_bound_source
