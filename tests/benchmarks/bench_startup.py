"""How long ``kvbench --help`` takes to start: a fresh interpreter each round (verbs are imported only when
they run; before that change it took 2.1-2.7 s on a 2-core machine, pandas, matplotlib and transformers
imported at start-up)."""
import subprocess
import sys


def _help() -> str:
    done = subprocess.run([sys.executable, "-m", "kvbench.cli", "--help"], capture_output=True, text=True, check=True)
    return done.stdout


def test_kvbench_help_startup(benchmark):
    out = benchmark.pedantic(_help, rounds=10, warmup_rounds=1)
    assert "backends" in out
