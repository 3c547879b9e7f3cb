"""How long ``kvbench plan`` takes for a catalog model, a fresh interpreter each round (issue 36 item 5):
a plain config is read without importing transformers (kvbench.kv.model_config.PlainConfig), the run's
option parser only for --engine-option. One round is what a user waits for the first answer."""
import subprocess
import sys

import pytest


def _plan(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvbench.cli", "plan", *args], capture_output=True, text=True,
                          check=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    return done.stdout


@pytest.mark.parametrize("args", [("llama-3.1-8b", "-n", "8k"),
                                  ("llama-3.1-70b", "-n", "8k", "--engine", "vllm", "--gpu", "H100-80GB")],
                         ids=["plain-formula", "vllm-on-h100"])
def test_plan_catalog_model(benchmark, args):
    out = benchmark.pedantic(_plan, args=args, rounds=10, warmup_rounds=1)
    assert out.startswith("Asked: ")
