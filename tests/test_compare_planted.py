"""`kvbench compare` on engines of known speed (issue 13's acceptance): a mock engine 10 % slower is caught
at the repeats the README recommends (10, interleaved), and an unchanged one is not flagged.

The mock engines are tests/fakes/openai_server.py servers whose every token (the first too) takes
``token_delay_s``: 20 ms against 22 ms is a 10 % slower engine, TTFT and ITL alike. Both run in one
interleaved run (AB BA AB ...), which compare reads as paired repeats.
"""
import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.workloads import load

from .fakes.openai_server import FakeOpenAI

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = """name = "planted"
description = "one short rung, five requests a cell: for compare's acceptance test"
seed = 3
prompt_tokens = [64]
output_tokens = 8
concurrency = [1]
rounds = 5
warmup_requests = 1
warmup_prompt_tokens = 32
"""


def ab_run(tmp_path: Path, delay_a: float, delay_b: float) -> tuple[Path, str, str]:
    (tmp_path / "planted.toml").write_text(WORKLOAD)
    with FakeOpenAI(token_delay_s=delay_a) as a, FakeOpenAI(token_delay_s=delay_b) as b:
        opts = RunOptions(model="smollm2", workload=load(str(tmp_path / "planted.toml")), results_dir=tmp_path,
                          run_id="ab", repeats=10, interleave=True, estimate=False,
                          backends=[BackendConfig.parse(f"openai:url={s.url}") for s in (a, b)])
        run_dir = Runner(opts, Console(file=io.StringIO())).run()
    return run_dir, f"openai@127.0.0.1:{a.port}", f"openai@127.0.0.1:{b.port}"


def compare(run_dir: Path, baseline: str, candidate: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.cli", "compare", str(run_dir), "--baseline-backend",
                           baseline, "--candidate-backend", candidate], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("slower, expected_exit", [(1.10, 1), (1.0, 0)], ids=["10%-slower", "unchanged"])
def test_compare_catches_a_planted_regression_and_passes_an_unchanged_engine(tmp_path, smollm2, slower,
                                                                             expected_exit):
    run_dir, a, b = ab_run(tmp_path, 0.020, 0.020 * slower)
    result = compare(run_dir, a, b)
    assert result.returncode == expected_exit, result.stdout + result.stderr
    head = result.stdout.splitlines()[:6]
    if expected_exit:
        assert any("regression" in line.lower() for line in head), head  # the verdict comes first
        assert "ttft_s_p50" in result.stdout
    assert "paired" in result.stdout.lower()
