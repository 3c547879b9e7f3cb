"""The device read a GPU run records (backends/hf/scripts/gpu_probe.py bandwidth), run for real in the transformers
environment with ``--device cpu``: the same torch code as on a GPU, read back through the capability."""
import json
import subprocess

import pytest

from kvbench.backends.hf.adapter import HFBackend
from kvbench.common.envs import env_python

from tests.helpers import engine_env

pytestmark = pytest.mark.engine


def test_the_transformers_environment_reads_its_device_and_the_capability_parses_it():
    python = env_python(engine_env("hf"))
    capability = HFBackend.capabilities.device_bandwidth
    out = subprocess.run([str(python), str(capability.script), "bandwidth", "--device", "cpu", "--bytes", str(256 << 20),
                          "--rounds", "2", "--passes", "2"], capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(out.stdout.splitlines()[-1])
    assert figures["event"] == "bandwidth" and figures["device"] == "cpu" and figures["array_bytes"] == 256 << 20
    # any memory reads and copies between 100 MB/s and 10 TB/s: a figure outside is a broken probe
    assert 1e8 < figures["read_bytes_per_s"] < 1e13 and 1e8 < figures["copy_bytes_per_s"] < 1e13
    # through the capability, on CUDA: this machine has none, and the answer says why in one line
    got = capability.measure(python, timeout_s=300)
    assert set(got) == {"not_measured"} and got["not_measured"].startswith("the device read failed (exit 1): ")
