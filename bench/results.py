"""The results schema and the files of a run.

A run is a folder ``results/runs/<run_id>/``:

- ``run.json``: run id, command, schema version, environment (harness, CPU/GPU, engines and their
  versions, model file hash) and the exact workload;
- ``cells.jsonl``: one :class:`CellRow` per (backend, prompt length, concurrency), appended as each cell
  finishes, so an interrupted run keeps what it finished;
- ``requests.jsonl``: one :class:`RequestRow` per request with every chunk's timestamp;
- ``timelines/<cell_id>.csv``: memory and KV-in-use samples of the cell on one time axis;
- ``logs/<backend>.log``: each engine's own log.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pandas as pd
from pydantic import BaseModel, Field

SCHEMA_VERSION = 1


class CellRow(BaseModel):
    """One cell's summary. Every size is in bytes, every time in seconds; None means "not measured"."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    cell_id: str
    backend: str  # label, e.g. "vllm-0.32.0"
    engine: str
    engine_version: str  # as configured (the environment's version)
    engine_version_reported: str | None = None  # as the running engine reports it
    model: str
    workload: str
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    kv_dtype: str
    status: Literal["ok", "flagged", "failed", "not run"]
    flags: list[str] = Field(default_factory=list)
    error: str | None = None
    log_tail: str | None = None
    n_requests: int = 0
    n_ok: int = 0
    # latency / throughput (bench/metrics.py defines each)
    ttft_s_mean: float | None = None
    ttft_s_p50: float | None = None
    ttft_s_p90: float | None = None
    ttft_s_p99: float | None = None
    itl_s_mean: float | None = None
    itl_s_p50: float | None = None
    itl_s_p90: float | None = None
    itl_s_p99: float | None = None
    tpot_s_mean: float | None = None
    tpot_s_p50: float | None = None
    tpot_s_p90: float | None = None
    tpot_s_p99: float | None = None
    e2e_s_mean: float | None = None
    e2e_s_p50: float | None = None
    e2e_s_p90: float | None = None
    e2e_s_p99: float | None = None
    wall_s: float | None = None
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    # KV: predicted from the config, allocated by the engine, and in use at the peak
    kv_bytes_per_token_predicted: float | None = None
    kv_tokens_peak_predicted: int | None = None  # concurrency x (prompt + output - 1)
    kv_bytes_peak_predicted: float | None = None
    kv_pool_bytes_engine: int | None = None
    kv_pool_tokens_engine: int | None = None
    kv_pool_bytes_predicted: float | None = None
    kv_pool_source: str | None = None
    kv_in_use_peak_bytes: float | None = None
    kv_in_use_peak_tokens: float | None = None
    kv_in_use_source: str | None = None
    kv_measured_over_predicted: float | None = None
    kv_allocator_bytes_peak: int | None = None  # CUDA allocator delta (transformers on a GPU)
    # memory of the engine's process tree
    rss_baseline_bytes: int | None = None
    rss_peak_bytes: int | None = None
    gpu_process_peak_bytes: int | None = None
    gpu_device_peak_bytes: int | None = None
    memory_samples: int = 0
    memory_sample_hz: float | None = None
    t_cell_start: float | None = None  # perf_counter at the cell's start: timelines count from here


class RequestRow(BaseModel):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    cell_id: str
    backend: str
    request_id: str
    warmup: bool = False
    prompt_tokens_sent: int
    prompt_tokens_reported: int | None
    output_tokens_requested: int
    output_tokens_received: int
    output_tokens_reported: int | None
    t_sent: float
    t_done: float | None
    chunk_times: list[float]
    chunk_tokens: list[int]
    ttft_s: float | None
    e2e_s: float | None
    error: str | None
    engine_details: dict = Field(default_factory=dict)


class RunWriter:
    """Appends rows as they are produced; every write is flushed, so a crash loses nothing finished."""

    def __init__(self, root: Path):
        self.root = root
        (root / "timelines").mkdir(parents=True, exist_ok=True)
        (root / "logs").mkdir(exist_ok=True)

    def write_run_info(self, info: dict) -> None:
        (self.root / "run.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, **info}, indent=2))

    def update_run_info(self, **fields) -> None:
        path = self.root / "run.json"
        info = json.loads(path.read_text())
        info.update(fields)
        path.write_text(json.dumps(info, indent=2))

    def _append(self, name: str, row: BaseModel) -> None:
        with (self.root / name).open("a") as f:
            f.write(row.model_dump_json() + "\n")

    def write_cell(self, row: CellRow) -> None:
        self._append("cells.jsonl", row)

    def write_request(self, row: RequestRow) -> None:
        self._append("requests.jsonl", row)

    def write_timeline(self, cell_id: str, frame: pd.DataFrame) -> None:
        frame.to_csv(self.root / "timelines" / f"{cell_id}.csv", index=False)

    def log_path(self, backend: str) -> Path:
        return self.root / "logs" / f"{backend}.log"


def load_cells(run_dir: str | Path) -> pd.DataFrame:
    """The cells of a run as a DataFrame (one row per cell)."""
    path = Path(run_dir) / "cells.jsonl"
    rows = [CellRow.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]
    return pd.DataFrame([r.model_dump() for r in rows])


def load_run_info(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())
