"""The kvbench command as a user runs it, with real engines: a run then its report, and an HF folder served by
transformers and by llama.cpp through its own converter (the rest: tests/test_cli.py).

Tests that start a real engine live in modules named *_engines.py: tests/conftest.py runs them on one xdist
worker, one after another."""

import pytest

from kvbench.store.readers import load_cells
from tests.helpers import engine_env
from tests.test_cli import TINY, kvbench


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
def test_hf_folder_model_runs_on_hf_and_on_llamacpp_through_its_own_converter(tmp_path, smollm2):
    # an HF folder (what a hub id resolves to): llama.cpp serves a GGUF its own convert_hf_to_gguf.py made
    # from the same weights, once
    engine_env("hf")
    engine_env("llamacpp")
    (tmp_path / "tiny.toml").write_text(TINY)
    done = kvbench("run", "-b", "hf", "-b", "llamacpp", "--model", str(smollm2.hf_dir),
                   "--workload", str(tmp_path / "tiny.toml"), "--results-dir", str(tmp_path), "--run-id", "r")
    assert done.returncode == 0, done.stdout + done.stderr
    cells = load_cells(tmp_path / "r").set_index("engine")
    assert cells.loc["hf", "status"] == "ok"
    assert cells.loc["llamacpp", "status"] == "ok", cells.loc["llamacpp", "error"]
    log = (tmp_path / "r" / "logs" / "llamacpp-0.3.36.log").read_text()
    assert ".gguf" in log.splitlines()[0] and str(smollm2.gguf_path) not in log.splitlines()[0]
