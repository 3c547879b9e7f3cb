"""The kvbench command as a user runs it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.results import load_cells

from .conftest import engine_env

REPO = Path(__file__).resolve().parent.parent
TINY = """name = "tiny"
seed = 3
prompt_tokens = [64]
output_tokens = 8
concurrency = [1]
"""


def kvbench(*args, timeout=600):
    # a wide terminal, so that rich does not wrap the error messages the tests look for
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "300"})


@pytest.mark.engine
def test_run_then_report(tmp_path):
    engine_env("llamacpp")
    (tmp_path / "tiny.toml").write_text(TINY)
    done = kvbench("run", "-b", "llamacpp", "--workload", str(tmp_path / "tiny.toml"),
                   "--results-dir", str(tmp_path), "--run-id", "r")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "llamacpp-0.3.36" in done.stdout and "prompt     64 x1" in done.stdout
    report = kvbench("report", str(tmp_path / "r"), "--raw")
    assert report.returncode == 0
    assert "| llamacpp-0.3.36 | 64 | 1 | f16 | 23,040 |" in report.stdout
    assert (tmp_path / "r" / "report.md").read_text() in report.stdout


@pytest.mark.engine
def test_hf_folder_model_runs_on_hf_and_llamacpp_says_why_not(tmp_path, smollm2):
    engine_env("hf")
    engine_env("llamacpp")
    (tmp_path / "tiny.toml").write_text(TINY)
    done = kvbench("run", "-b", "hf", "-b", "llamacpp", "--model", str(smollm2.hf_dir),
                   "--workload", str(tmp_path / "tiny.toml"), "--results-dir", str(tmp_path), "--run-id", "r")
    assert done.returncode == 0, done.stdout + done.stderr
    cells = load_cells(tmp_path / "r").set_index("engine")
    assert cells.loc["hf", "status"] == "ok"
    assert cells.loc["llamacpp", "status"] == "failed"
    assert "llama.cpp needs a GGUF" in cells.loc["llamacpp", "error"]


def test_bad_arguments_name_the_allowed_values(tmp_path):
    bad_backend = kvbench("run", "-b", "sglang")
    assert bad_backend.returncode == 2 and "allowed: hf, llamacpp, ollama, openai, tgi, vllm" in bad_backend.stderr
    two_urls = kvbench("run", "-b", "vllm", "-b", "hf", "--url", "http://127.0.0.1:9")
    assert two_urls.returncode == 2 and "exactly one --backend" in two_urls.stderr
    bad_workload = kvbench("run", "--workload", "nope")
    assert bad_workload.returncode == 2 and "long_context_ladder" in bad_workload.stderr
    not_a_run = kvbench("report", str(tmp_path))
    assert not_a_run.returncode == 2 and "not a kvbench run folder" in not_a_run.stderr
