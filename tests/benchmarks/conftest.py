"""The harness's own hot paths under pytest-benchmark (docs/harness-benchmarks.md).

These files are named bench_*.py, so a plain ``pytest tests`` (and ``make test``) never collects them;
``make bench-harness`` runs them with ``-o python_files=bench_*.py`` and compares them with the baseline
saved under tests/benchmarks/baseline/.
"""
import pytest


@pytest.fixture(autouse=True, scope="session")
def _measured(request):
    """pytest-benchmark disables every benchmark under pytest-xdist workers (pyproject.toml's addopts start
    them): the run would pass having timed nothing, so it is refused instead."""
    if hasattr(request.config, "workerinput"):  # an xdist worker
        pytest.fail("the harness benchmarks time nothing under xdist workers: run them with -n 0 "
                    "(make bench-harness does)", pytrace=False)
