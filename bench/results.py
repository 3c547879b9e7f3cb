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

from kvbench.metrics import RequestTimes, request_verdict

OK_STATUSES = ("ok", "flagged")  # cell statuses whose figures count (flagged: some requests broke the contract)
SCHEMA_VERSION = 3
# v2 (load generator): repeat, load_profile, request_rate, variant, token_contract, attached, queueing
# and goodput fields. v1 rows read as v2 with those fields at their defaults (one closed-loop repeat).
# v3 (one meaning per figure): TPOT is undefined (None, not 0.0) where ITL is, and goodput does not count
# an undefined TPOT as within the SLO; cells' client_loop_lag_s_max (written by some v2 runs without a
# version bump) is a v3 column; loaded requests get ``counted`` (not a warm-up) beside ``ok`` (met the
# token contract), and load() gives every column one dtype in every run (:func:`normalize_dtypes`).

#: The fields that say what a cell *is*; two cells with equal values measure the same thing
#: (``kvbench compare`` matches on these, repeats aside).
CELL_CONFIG_FIELDS = ("engine", "engine_version", "model", "workload", "variant", "prompt_tokens", "output_tokens",
                      "load_profile", "concurrency", "request_rate", "kv_dtype")


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
    variant: str = ""  # a workload's setting beyond length and load, e.g. "prefix_caching=on", "turn=3"
    prompt_tokens: int
    output_tokens: int
    # load: a closed loop of `concurrency` workers ("concurrent"), or an open loop ("poisson", "constant") at
    # `request_rate` requests/s with at most `concurrency` in flight (None: no cap)
    load_profile: str = "concurrent"  # a name in kvbench.load.registry
    concurrency: int | None
    request_rate: float | None = None
    repeat: int = 0  # 0-based index of the repeated run of this cell
    kv_dtype: str
    # how output length was forced and prompts checked, e.g. "token ids, ignore_eos" (compare refuses to
    # compare cells whose contracts differ)
    token_contract: str = ""
    attached: bool = False  # benchmarked a server kvbench did not start: no process memory
    status: Literal["ok", "flagged", "failed", "not run"]
    flags: list[str] = Field(default_factory=list)
    error: str | None = None
    log_tail: str | None = None
    n_requests: int = 0
    n_ok: int = 0  # requests that met the token contract: the only ones in the headline figures
    n_failed: int = 0
    n_truncated: int = 0  # the engine read fewer prompt tokens than were sent
    n_short: int = 0  # fewer output tokens than asked
    # load actually achieved (open loop: offered vs achieved shows coordinated omission)
    offered_request_rate: float | None = None
    achieved_request_rate: float | None = None
    send_lag_s_p99: float | None = None  # how late requests left against their schedule
    client_loop_lag_s_max: float | None = None  # the client's event loop at its latest: bounds its own timing error
    max_in_flight: int | None = None
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
    goodput_requests_per_s: float | None = None  # requests within the SLO per second
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # queueing (the KV boundary): the engine's own counters during the cell
    requests_waiting_peak: float | None = None
    requests_running_peak: float | None = None
    preemptions: float | None = None  # during the cell (counter difference)
    queue_source: str | None = None
    # sequences of prompt_tokens + output_tokens that the engine's KV pool holds at once, by the KV model
    # (kvbench.kvmodel's engine rule applied to the pool the engine reported); the KV boundary compares
    # this with requests_running_peak
    kv_pool_sequences_predicted: int | None = None
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
    kv_allocator_generate_peak_bytes: int | None = None  # allocator peak during generate, over its start
    kv_allocator_reserved_delta_bytes: int | None = None  # the caching allocator's reserved growth
    # memory of the engine's process tree
    rss_baseline_bytes: int | None = None
    rss_peak_bytes: int | None = None
    gpu_process_peak_bytes: int | None = None
    gpu_device_peak_bytes: int | None = None
    gpu_device_over_baseline_peak_bytes: int | None = None  # device used minus the idle baseline
    gpu_baseline_used_bytes: int | None = None  # device used before the engine started
    gpu_device_total_bytes: int | None = None
    gpu_device_reserved_bytes: int | None = None
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
    t_scheduled: float | None = None  # open loop: when the schedule wanted it sent (t_sent - this = lag)
    repeat: int = 0
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


def migrate_row(row: dict, model: type[BaseModel]) -> dict:
    """One stored row (any schema version) as a row of the current schema.

    v1 -> v2: the fields v2 added take their defaults (``repeat`` 0, ``load_profile`` "concurrent",
    ``request_rate`` None, ``variant`` "", ``token_contract`` "" = not recorded, ``attached`` False, the
    queueing and goodput fields None): a v1 run was one closed-loop repeat of each cell.
    v2 -> v3: ``client_loop_lag_s_max`` None where the row lacks it (not measured). A stored cell's TPOT and
    goodput keep the figures its run wrote (a v2 TPOT may be 0.0 where v3 says undefined): ``kvbench report
    --recompute RUN`` rebuilds them from requests.jsonl under the current definitions.
    """
    version = int(row.get("schema_version", 1))
    if version > SCHEMA_VERSION:
        raise ValueError(f"row has schema version {version}, newer than this kvbench's {SCHEMA_VERSION}: upgrade kvbench")
    out = model.model_validate(row).model_dump()
    out["schema_version"] = SCHEMA_VERSION
    return out


def _read_jsonl(path: Path, model: type[BaseModel]) -> pd.DataFrame:
    rows = [migrate_row(json.loads(line), model) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []
    return pd.DataFrame(rows, columns=list(model.model_fields))


def load_cells(run_dir: str | Path) -> pd.DataFrame:
    """The cells of a run as a DataFrame (one row per cell), migrated to the current schema."""
    return _read_jsonl(Path(run_dir) / "cells.jsonl", CellRow)


def load_run_info(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())


# --- the columnar copy (Parquet) and the one public loader ---------------------------------------------

PARQUET_FILES = {"cells": ("cells.jsonl", "cells.parquet", CellRow),
                 "requests": ("requests.jsonl", "requests.parquet", RequestRow)}
PARQUET_META_KEY = b"kvbench_schema_version"


def _requests_derived(frame: pd.DataFrame) -> pd.DataFrame:
    """Per-request figures the cell's percentiles are made of (bench/metrics.py), as columns: ``tpot_s``;
    ``ok``, the request met the token contract (warm-ups too); ``counted``, it was measured, not a warm-up.
    A cell's headline figures are made of the requests that are both ``ok`` and ``counted``."""
    frame = frame.copy()
    frame["tpot_s"] = [RequestTimes(0.0, tuple(t), tuple(k)).tpot
                       for t, k in zip(frame.chunk_times, frame.chunk_tokens)]

    def count(x):  # a count the engine did not report reads back as NaN
        return None if pd.isna(x) else int(x)

    frame["ok"] = [request_verdict(None if pd.isna(error) else error, sent, count(p_reported),
                                   asked, count(o_reported), int(received)) == "ok"
                   for error, sent, p_reported, asked, o_reported, received in zip(
                       frame.error, frame.prompt_tokens_sent, frame.prompt_tokens_reported,
                       frame.output_tokens_requested, frame.output_tokens_reported, frame.output_tokens_received)]
    frame["counted"] = [not bool(w) for w in frame.warmup]
    return frame


#: dtypes of the columns load() adds to a model's fields
DERIVED_DTYPES = {"tpot_s": "float64", "ok": "bool", "counted": "bool", "run_dir": "object"}


def column_dtypes(model: type[BaseModel]) -> dict[str, str]:
    """One pandas dtype per field of ``model``, whatever a run holds: floats (None as NaN) float64; byte
    figures (ints named ``*bytes*``, read as sizes) float64; other ints (counts, lengths) Int64, with
    <NA> where not measured; bools bool (boolean where optional); strings, lists and dicts object."""
    import types
    import typing

    out = {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)] \
            if typing.get_origin(ann) in (typing.Union, types.UnionType) else [ann]
        optional = len(args) < len(typing.get_args(ann)) if typing.get_origin(ann) in (typing.Union,
                                                                                       types.UnionType) else False
        base = args[0] if len(args) == 1 else None
        if base is float or (base is int and "bytes" in name):
            out[name] = "float64"
        elif base is int:
            out[name] = "Int64"
        elif base is bool:
            out[name] = "boolean" if optional else "bool"
        else:
            out[name] = "object"
    return out


def normalize_dtypes(frame: pd.DataFrame, model: type[BaseModel]) -> pd.DataFrame:
    """``frame`` with the same columns in the same dtypes for every run, old or new (:func:`column_dtypes`
    for the model's fields, :data:`DERIVED_DTYPES` for the derived ones); a missing field is added empty."""
    dtypes = {**column_dtypes(model), **{k: v for k, v in DERIVED_DTYPES.items()
                                         if k in frame.columns or (k == "run_dir")}}
    frame = frame.copy()
    for col, dtype in dtypes.items():
        if col not in frame.columns:
            frame[col] = pd.Series([None] * len(frame), index=frame.index, dtype="object")
        series = frame[col]
        if dtype == "object":
            frame[col] = series.astype(object).where(series.notna(), None) if len(series) else series.astype(object)
        elif dtype in ("float64", "Int64", "boolean"):
            frame[col] = pd.to_numeric(series.astype(object).where(series.notna(), None), errors="coerce") \
                .astype(dtype) if dtype != "boolean" else series.astype("boolean")
        else:
            frame[col] = series.astype(dtype)
    first = [c for c in dtypes if c in model.model_fields]
    return frame[first + [c for c in frame.columns if c not in model.model_fields]]


def not_a_run_dir(run_dir: str | Path) -> str | None:
    """Why ``run_dir`` is not a kvbench run folder (the message for the user), or None when it is one."""
    if not (Path(run_dir) / "run.json").exists() or not (Path(run_dir) / "cells.jsonl").exists():
        return f"{run_dir} has no run.json/cells.jsonl: not a kvbench run folder"
    return None


def write_parquet(run_dir: str | Path) -> list[Path]:
    """Write cells.parquet and requests.parquet beside the JSONL files (migrated to the current schema;
    the schema version is in each file's metadata under ``kvbench_schema_version``). The JSONL files stay
    the crash-safe record; the Parquet files are a derived copy that :func:`load` prefers when current."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_dir = Path(run_dir)
    written = []
    for jsonl, parquet, model in PARQUET_FILES.values():
        if not (run_dir / jsonl).exists():
            continue
        frame = _read_jsonl(run_dir / jsonl, model)
        if model is RequestRow:
            # engine_details is free-form per engine: kept as JSON text so every run has one column type
            frame["engine_details"] = frame.engine_details.map(json.dumps)
        table = pa.Table.from_pandas(frame, preserve_index=False)
        meta = dict(table.schema.metadata or {})
        meta[PARQUET_META_KEY] = str(SCHEMA_VERSION).encode()
        pq.write_table(table.replace_schema_metadata(meta), run_dir / parquet)
        written.append(run_dir / parquet)
    return written


def parquet_is_current(run_dir: str | Path) -> bool:
    """True when every Parquet copy exists, has the current schema version and is newer than its JSONL."""
    import pyarrow.parquet as pq

    run_dir = Path(run_dir)
    for jsonl, parquet, _ in PARQUET_FILES.values():
        src, dst = run_dir / jsonl, run_dir / parquet
        if not src.exists():
            continue
        if not dst.exists() or dst.stat().st_mtime < src.stat().st_mtime:
            return False
        meta = pq.read_schema(dst).metadata or {}
        if meta.get(PARQUET_META_KEY) != str(SCHEMA_VERSION).encode():
            return False
    return True


def ensure_parquet(run_dir: str | Path) -> bool:
    """Write the Parquet copies unless they are current; True when they were (re)written."""
    if parquet_is_current(run_dir):
        return False
    write_parquet(run_dir)
    return True


def load(*run_dirs: str | Path, what: Literal["cells", "requests"] = "cells") -> pd.DataFrame:
    """One or more runs as one tidy DataFrame: one row per cell (``what="cells"``) or per request
    (``what="requests"``), every run migrated to the current schema, with ``run_id`` and ``run_dir``
    columns. Reads the Parquet copy when it is current, else the JSONL record (never writes).

    Requests get three derived columns: ``tpot_s`` (bench/metrics.py's definition), ``ok`` (a measured
    request that met the token contract: the only kind in the cells' figures) and ``engine_details``
    as a dict. ``load(a, b)`` and ``load([a, b])`` are the same.
    """
    if len(run_dirs) == 1 and isinstance(run_dirs[0], (list, tuple)):
        run_dirs = tuple(run_dirs[0])
    if what not in PARQUET_FILES:
        raise ValueError(f"what must be one of {', '.join(PARQUET_FILES)}, not {what!r}")
    jsonl, parquet, model = PARQUET_FILES[what]
    frames = []
    for run_dir in map(Path, run_dirs):
        if not (run_dir / "run.json").exists():
            raise FileNotFoundError(f"{run_dir} has no run.json: not a kvbench run folder")
        if (run_dir / parquet).exists() and parquet_is_current(run_dir):
            frame = pd.read_parquet(run_dir / parquet)
            if model is RequestRow:
                frame["engine_details"] = frame.engine_details.map(json.loads)
            for col in ("flags", "chunk_times", "chunk_tokens"):  # numpy arrays back to lists
                if col in frame:
                    frame[col] = frame[col].map(list)
        else:
            frame = _read_jsonl(run_dir / jsonl, model)
        if frame.empty:
            continue
        if model is RequestRow:
            frame = _requests_derived(frame)
        frame["run_dir"] = str(run_dir)
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=[*model.model_fields, "run_dir"])
    return normalize_dtypes(pd.concat(frames, ignore_index=True), model)
