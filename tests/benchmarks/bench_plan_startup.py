"""How long ``kvbench plan llama-3.1-8b --gpu H100-80GB`` takes against ``kvbench --help`` (issue 54 item 4:
the plan at or under 0.3 s on a loaded machine, importing only what the answer needs).

Each round runs the two commands alternately, each in a fresh interpreter through the installed ``kvbench``
script (what a user types), so what other processes take from the machine lands on both alike: the median of
each, and their ratio, are printed. Nothing here asserts a time (tests/planner/test_plan_imports.py checks
what the plan imports). Run it alone::

    .venv/bin/python tests/benchmarks/bench_plan_startup.py [ROUNDS]

or under ``make bench-harness`` (one round there is the pair: the plan, then ``--help``).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLAN = ("plan", "llama-3.1-8b", "--gpu", "H100-80GB")
HELP = ("--help",)
ROUNDS = 7


def _command() -> list[str]:
    """The installed ``kvbench`` script beside this interpreter, else the module."""
    script = Path(sys.executable).with_name("kvbench")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvbench.cli"]


def timed(*args: str) -> float:
    """Wall seconds of one ``kvbench ARGS`` in a fresh interpreter."""
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's install has its bytecode: the warm-up round writes it
    t0 = time.perf_counter()
    subprocess.run([*_command(), *args], capture_output=True, check=True, env=env)
    return time.perf_counter() - t0


def medians(rounds: int = ROUNDS) -> tuple[float, float]:
    """(plan, --help): the median wall seconds of ``rounds`` of each, alternated, after one of each unmeasured."""
    timed(*PLAN), timed(*HELP)  # warm the file cache and the bytecode
    plan, help_ = [], []
    for _ in range(rounds):
        plan.append(timed(*PLAN))
        help_.append(timed(*HELP))
    return statistics.median(plan), statistics.median(help_)


def line(plan: float, help_: float, rounds: int) -> str:
    return (f"kvbench plan {' '.join(PLAN[1:])}: median {plan:.3f} s; kvbench --help: median {help_:.3f} s; "
            f"plan / help {plan / help_:.2f} (median of {rounds}, alternated)")


def test_plan_startup(benchmark):
    plan, help_ = [], []

    def pair():
        plan.append(timed(*PLAN))
        help_.append(timed(*HELP))

    benchmark.pedantic(pair, rounds=ROUNDS, warmup_rounds=1)
    plan_s, help_s = statistics.median(plan[1:]), statistics.median(help_[1:])
    benchmark.extra_info.update(plan_median_s=plan_s, help_median_s=help_s)
    print("\n" + line(plan_s, help_s, ROUNDS))


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    print(line(*medians(n), n))
