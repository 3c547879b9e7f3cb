"""The harness's own hot paths under pytest-benchmark (docs/harness-benchmarks.md).

These files are named bench_*.py, so a plain ``pytest tests`` (and ``make test``) never collects them;
``make bench-harness`` runs them with ``-o python_files=bench_*.py`` and compares them with the baseline
saved under tests/benchmarks/baseline/.
"""
