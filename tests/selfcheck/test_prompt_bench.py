"""The long-prompt start-up benchmark (selfcheck/prompt_bench.py), small: it launches `kvbench run` against the
mock end to end and prints its figures. No speed thresholds here: those are measurements, in docs/workloads.md."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO


def test_prompt_bench_runs_end_to_end():
    proc = subprocess.run([sys.executable, "-m", "kvbench.selfcheck.prompt_bench", "--repeats", "1", "--requests",
                           "3", "--prompt-tokens", "1000"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launch = re.search(r"first request read by the mock: ([\d.]+) s \(all (\d+) read", proc.stdout)
    assert launch and int(launch.group(2)) >= 3, proc.stdout
    assert re.search(r"tokenizer scan [\d.]+ s .*kept words read [\d.]+ s .*building the prompts [\d.]+ s",
                     proc.stdout), proc.stdout
