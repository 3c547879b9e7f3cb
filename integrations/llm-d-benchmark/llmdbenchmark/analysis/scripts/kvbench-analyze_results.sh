#!/usr/bin/env bash
# kvbench's analyzer for llm-d-benchmark: its entrypoint runs <harness>-analyze_results.sh after the harness.
# kvbench's harness wrote the Benchmark Reports itself; this validates every benchmark_report_v0.2,_*.yaml in
# the results folder with the llmd-benchmark-report package (exit 1 when one does not validate, or when kvbench
# succeeded and wrote none).
KVBENCH_PYTHON="${KVBENCH_PYTHON:-/opt/kvbench/bin/python}"
if [[ ! -x "$KVBENCH_PYTHON" ]]; then
  echo "kvbench-harness: error: no kvbench Python at $KVBENCH_PYTHON (set KVBENCH_PYTHON)" >&2
  exit 127
fi
exec "$KVBENCH_PYTHON" -m kvbench.integrations.llmd_harness analyze
