#!/usr/bin/env bash
# kvbench as an llm-d-benchmark harness (docs/llm-d-benchmark.md in kvbench). llm-d-benchmark's harness pod runs
# this script with its environment (LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR, ..._HARNESS_WORKLOAD_NAME, ...); the
# work is kvbench's own module, which writes stdout.log, stderr.log, run_metadata.yaml and one Benchmark Report
# per cell into the results folder and exits with kvbench run's status.
# KVBENCH_PYTHON: the Python that has kvbench (the harness image installs it in /opt/kvbench).
KVBENCH_PYTHON="${KVBENCH_PYTHON:-/opt/kvbench/bin/python}"
if [[ ! -x "$KVBENCH_PYTHON" ]]; then
  message="kvbench-harness: error: no kvbench Python at $KVBENCH_PYTHON: build the harness image with kvbench's integrations/llm-d-benchmark/Containerfile, or set KVBENCH_PYTHON"
  if [[ -n "$LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR" ]]; then
    mkdir -p "$LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR" && echo "$message" >> "$LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR/stderr.log"
  fi
  echo "$message" >&2
  exit 127
fi
exec "$KVBENCH_PYTHON" -m kvbench.integrations.llmd_harness run
