"""The results schema and the files of a run.

A run is a folder ``results/runs/<run_id>/``:

- ``run.json``: run id, command, schema version, environment (harness, CPU/GPU, engines and their
  versions, model file hash) and the exact workload;
- ``cells.jsonl``: one :class:`CellRow` per (backend, prompt length, concurrency), appended as each cell
  finishes, so an interrupted run keeps what it finished;
- ``requests.jsonl``: one :class:`RequestRow` per request with every chunk's timestamp;
- ``timelines/<cell_id>.csv``: memory and KV-in-use samples of the cell on one time axis;
- ``logs/<backend>.log``: each engine's own log.

Rewritten files (run.json, timelines, the Parquet copies) are replaced atomically and appends are whole
fsynced lines (``kvbench.common.files``), so a crash or a full disk leaves every finished row readable; the
readers skip (and count, in a :class:`DamagedLinesWarning`) a torn line a crash left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import pandas as pd
import psutil
from pydantic import BaseModel, Field, ValidationError

from kvbench.common.files import PlainNameError, append_line, atomic_write_bytes, atomic_write_text, check_plain_name
from kvbench.common.metrics import RequestTimes, request_verdict

__all__ = ["PlainNameError", "check_plain_name"]  # re-exported: run ids are checked with it (files.py has it)

OK_STATUSES = ("ok", "flagged")  # cell statuses whose figures count (flagged: some requests broke the contract)
SCHEMA_VERSION = 6
# v2 (load generator): repeat, load_profile, request_rate, variant, token_contract, attached, queueing
# and goodput fields. v1 rows read as v2 with those fields at their defaults (one closed-loop repeat).
# v3 (one meaning per figure): TPOT is undefined (None, not 0.0) where ITL is, and goodput does not count
# an undefined TPOT as within the SLO; cells' client_loop_lag_s_max (written by some v2 runs without a
# version bump) is a v3 column; loaded requests get ``counted`` (not a warm-up) beside ``ok`` (met the
# token contract), and load() gives every column one dtype in every run (:func:`normalize_dtypes`).
# v4 (GPU runs as deployed): engine_mode ("sized" or "deployed"; "" = not recorded), gpus_used (tensor/
# layer split), gpu_devices (NVML per device), the per-GPU KV in use and its prediction, the engine's
# weights and the measured overhead per GPU.
# v5 (deployments, backends/deployment.py): replica, replicas, queued_first_s, queued_first_replica; a
# deployment's cell has its total row (replica "") and one row per replica (cell_id "<total's>@<host:port>").
# v6 (the cluster's own monitoring, bench/telemetry.py): t_cell_start_unix and the prom_* figures read from
# Prometheus after each cell (--prometheus): DCGM's GPU memory per device, the engines' KV usage and queue.

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
    # "sized": the KV pool sized by kvbench for the workload; "deployed": the engine's own defaults
    # (vLLM's memory utilisation and CUDA graphs, llama.cpp's context, TGI's auto batch tokens); "": not recorded
    engine_mode: str = ""
    gpus_used: int = 1  # GPUs the engine was split over (vLLM/TGI tensor parallel, llama.cpp layers, device_map)
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
    # (kvbench.kv.geometry's engine rule applied to the pool the engine reported); the KV boundary compares
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
    # per GPU (NVML), one dict per device in index order: index, used_peak_bytes, over_baseline_peak_bytes,
    # process_peak_bytes, total_bytes (a list, not columns per device: the number of GPUs differs by machine)
    gpu_devices: list[dict] = Field(default_factory=list)
    # KV per GPU: the engine's in-use peak on its fullest GPU, and what its rules give for one GPU at the
    # same load (`kvbench plan --tp N`'s per-GPU figure)
    kv_in_use_peak_bytes_per_gpu: float | None = None
    kv_peak_bytes_per_gpu_predicted: float | None = None
    # memory besides KV, per GPU: the weights as the engine reports them, and the rest measured (device
    # used over the idle baseline, minus weights and KV pool): CUDA context, graphs, activations, slack
    weights_bytes_engine: float | None = None
    weights_source: str | None = None
    gpu_overhead_bytes_per_gpu: float | None = None
    memory_samples: int = 0
    memory_sample_hz: float | None = None
    t_cell_start: float | None = None  # perf_counter at the cell's start: timelines count from here
    t_cell_start_unix: float | None = None  # the same instant in Unix seconds (telemetry/<cell_id>.csv's clock)
    # the cluster's own monitoring, read from Prometheus after the cell (`--prometheus`; bench/telemetry.py):
    # DCGM exporter's framebuffer used per GPU at its peak (one dict per device: device (UUID), gpu, hostname,
    # model, used_peak_bytes) and on the fullest GPU; per engine instance its KV usage (0-1) and queue peaks;
    # preemptions during the cell summed over engines; how many samples and from where (or why not measured)
    prom_gpu_used_peak_bytes: float | None = None
    prom_gpu_devices: list[dict] = Field(default_factory=list)
    prom_kv_usage_peak: float | None = None
    prom_requests_running_peak: float | None = None
    prom_requests_waiting_peak: float | None = None
    prom_preemptions: float | None = None
    prom_engines: list[dict] = Field(default_factory=list)
    prom_samples: int = 0
    prom_source: str | None = None
    # a deployment of several replicas (backends/deployment.py): each cell has the deployment's total row
    # (replica "", its figures over every request, KV and queue summed over the replicas at each poll, the
    # pool's sequences summed) and one row per replica (replica = its host:port, cell_id the total's +
    # "@host:port": its own pool, KV and queue, and the requests it served). Compare and the plots read the
    # rows with replica "" only.
    replica: str = ""  # "": a single server, or a deployment's total
    replicas: int | None = None  # the replicas of the deployment (None: a single server)
    queued_first_s: float | None = None  # first poll with requests waiting > 0, seconds since the cell started
    queued_first_replica: str | None = None  # a deployment's total row: the replica that queued first


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


class ResultsWriteError(OSError):
    """Writing the results folder failed (disk full, read-only filesystem, permission denied). Raised by
    :class:`RunWriter` (and :func:`write_parquet`, ``kvbench.reports.write``) in place of the OSError; the
    run must stop. ``errno`` is the cause's; the message is one line for the user."""

    def __init__(self, folder: str | Path, doing: str, cause: OSError, intact: bool = True,
                 what: str = "results folder"):
        reason = (cause.strerror or str(cause)).lower()  # e.g. "no space left on device"
        tail = "; everything written before is intact" if intact else ""
        super().__init__(f"{what} {folder}: {reason} ({doing}){tail}")
        self.errno = cause.errno
        self.folder = Path(folder)
        self.doing = doing


class RunFolderError(ValueError):
    """The run folder cannot be used in the asked mode (exists, is not a run folder, nothing to resume)."""


class RunExistsError(RunFolderError):
    """A new run's folder already holds a run."""


class ResultsReadError(ValueError):
    """A run folder's file cannot be read (unreadable run.json, a row of the wrong shape); names the file
    and line. A torn line is not this error: it is skipped and counted (:class:`DamagedLinesWarning`)."""


class ResultsWarning(UserWarning):
    """Something in a run folder was damaged and worked around (nothing intact was lost). ``path`` is the
    file; ``detail`` is the message without the folder, for a report that already names the run."""

    def __init__(self, path: str | Path, detail: str):
        self.path, self.detail = Path(path), detail
        super().__init__(f"{self.path.parent}/{detail}")


class DamagedLinesWarning(ResultsWarning):
    """Lines of a JSONL record that are not whole JSON rows (what a crash mid-append leaves) were skipped."""

    def __init__(self, path: str | Path, lines: list[int]):
        self.lines = list(lines)
        n = len(self.lines)
        shown = ", ".join(map(str, self.lines[:5])) + (", ..." if n > 5 else "")
        super().__init__(path, f"{Path(path).name}: {n} damaged line{'s' if n != 1 else ''} skipped "
                               f"(line{'s' if n != 1 else ''} {shown}: not a whole JSON row, e.g. cut off by a crash)")


RunMode = Literal["new", "resume", "overwrite"]
RUN_MODES = ("new", "resume", "overwrite")
RUN_RECORDS = ("run.json", "cells.jsonl", "requests.jsonl")  # a folder holding one of these holds a run
HARNESS_GONE = "interrupted (harness gone)"


def harness_identity() -> dict:
    """Who is writing the run: pid, host and the process's start time (to tell a reused pid apart)."""
    return {"harness_pid": os.getpid(), "harness_host": socket.gethostname(),
            "harness_started_at": psutil.Process().create_time()}


def run_status(info: dict) -> str:
    """The run's status as recorded, except that a "running" run whose harness process is gone (same
    host, pid not alive or reused by another process) is ``"interrupted (harness gone)"``. A run recorded
    on another host, or without a harness pid (older runs), keeps its recorded status."""
    status = info.get("status") or "unknown"
    pid, host = info.get("harness_pid"), info.get("harness_host")
    if status != "running" or not pid or host != socket.gethostname():
        return status
    try:
        proc = psutil.Process(int(pid))
        started = info.get("harness_started_at")
        if started is not None and abs(proc.create_time() - float(started)) > 1.0:
            return HARNESS_GONE  # the pid now belongs to another process
        if proc.status() == psutil.STATUS_ZOMBIE:
            return HARNESS_GONE
    except psutil.NoSuchProcess:
        return HARNESS_GONE
    except psutil.Error:  # e.g. access denied: it exists, so assume it runs
        return status
    return status


class RunWriter:
    """The files of one run, written so that a crash or a full disk loses nothing finished: rows are
    appended as whole fsynced lines, rewritten files are replaced atomically, and any write error is a
    :class:`ResultsWriteError` (the first one is kept in ``failed``).

    ``mode``: "new" refuses a folder that already holds a run (:class:`RunExistsError`); "overwrite"
    empties a run folder first (and refuses a non-empty folder that is not a run folder); "resume" keeps
    everything: :meth:`finished_cell_ids` says which cells to skip, :meth:`discard_unfinished_requests`
    drops the requests of a cell that was cut off, and :meth:`write_run_info` records the new invocation
    beside the earlier ones in run.json's ``invocations``.
    """

    def __init__(self, root: Path, mode: RunMode = "new"):
        if mode not in RUN_MODES:
            raise ValueError(f"mode must be one of {', '.join(RUN_MODES)}, not {mode!r}")
        self.root = Path(root)
        self.mode = mode
        self.failed: ResultsWriteError | None = None
        self._info: dict | None = None
        root, name, where = self.root, self.root.name, self.root.parent
        has_run = any((root / f).exists() for f in RUN_RECORDS)
        if mode == "new" and has_run:
            raise RunExistsError(f"run {name} already exists in {where}: use --resume to finish its missing cells "
                                 "or --overwrite to replace it")
        if mode == "resume":
            if not (root / "run.json").exists():
                raise RunFolderError(f"run {name} not found in {where} (no run.json): nothing to resume; "
                                     "leave out --resume to start it")
            self._read_info()  # a damaged run.json is refused now, before any engine starts
        if mode == "overwrite" and root.is_dir():
            if not (root / "run.json").exists() and any(root.iterdir()):
                raise RunFolderError(f"{root} is not a kvbench run folder (no run.json): refusing to overwrite it")
            with self._writing("removing the old run", intact=False):
                for child in list(root.iterdir()):
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
        with self._writing("creating the run folder", intact=False):
            (root / "timelines").mkdir(parents=True, exist_ok=True)
            (root / "logs").mkdir(exist_ok=True)

    @contextmanager
    def _writing(self, doing: str, intact: bool = True):
        """Turn an OSError of the block into the run's one :class:`ResultsWriteError` type."""
        try:
            yield
        except ResultsWriteError as exc:
            self.failed = self.failed or exc
            raise
        except OSError as exc:
            error = ResultsWriteError(self.root, doing, exc, intact)
            self.failed = self.failed or error
            raise error from exc

    # --- run.json ----------------------------------------------------------------------------------
    def _read_info(self) -> dict:
        if self._info is None:
            with self._writing("reading run.json"):
                self._info = load_run_info(self.root)
        return self._info

    def _write_info(self, info: dict) -> None:
        with self._writing("writing run.json"):
            atomic_write_text(self.root / "run.json", json.dumps(info, indent=2))
        self._info = info

    def write_run_info(self, info: dict) -> None:
        """Write run.json at the start of an invocation, with ``harness_pid``, ``harness_host`` and
        ``harness_started_at`` (so :func:`run_status` can tell a killed harness) and this invocation in
        ``invocations``. In "resume" mode the earlier run.json is kept underneath: its ``started_at`` and
        invocations stay, the new fields win, and an earlier ``finished_at``/``error`` is dropped."""
        harness = harness_identity()
        if self.mode == "resume":
            old = self._read_info()
            earlier = old.get("invocations") or [_invocation_of(old)]
            merged = {k: v for k, v in old.items() if k not in ("finished_at", "error")}
            merged.update({"schema_version": SCHEMA_VERSION, **info, **harness,
                           "started_at": old.get("started_at", info.get("started_at"))})
            merged["invocations"] = list(earlier)
        else:
            merged = {"schema_version": SCHEMA_VERSION, **info, **harness, "invocations": []}
        merged["invocations"].append(_invocation_of({**info, **harness}) | {"mode": self.mode})
        self._write_info(merged)

    def record_invocation(self, info: dict) -> None:
        """Add this process's invocation (``info``, e.g. command and started_at, with the harness identity)
        to run.json's ``invocations``; if the last entry is already this process's (write_run_info
        recorded it), ``info`` is merged into it instead of adding a duplicate."""
        current = self._read_info()
        harness = harness_identity()
        invocations = list(current.get("invocations") or [])
        same = invocations and all(invocations[-1].get(k) == v for k, v in harness.items())
        entry = {**(invocations.pop() if same else {"mode": self.mode}), **info, **harness}
        self._write_info({**current, "invocations": [*invocations, entry]})

    def update_run_info(self, **fields) -> None:
        """Set fields of run.json (atomically); ``status``, ``finished_at`` and ``error`` also go to the
        current invocation's entry, so each invocation's outcome stays recorded."""
        info = dict(self._read_info())
        info.update(fields)
        invocations = list(info.get("invocations") or [])
        if invocations:
            outcome = {k: fields[k] for k in ("status", "finished_at", "error") if k in fields}
            invocations[-1] = {**invocations[-1], **outcome}
            info["invocations"] = invocations
        self._write_info(info)

    # --- rows --------------------------------------------------------------------------------------
    def _append(self, name: str, row: BaseModel) -> None:
        with self._writing(f"writing {name}"):
            append_line(self.root / name, row.model_dump_json())

    def write_cell(self, row: CellRow) -> None:
        self._append("cells.jsonl", row)

    def write_request(self, row: RequestRow) -> None:
        self._append("requests.jsonl", row)

    def finished_cell_ids(self) -> set[str]:
        """cell_id of every row in cells.jsonl, whatever its status: the cells a resumed run skips."""
        rows, _ = read_jsonl_rows(self.root / "cells.jsonl")
        return {row["cell_id"] for row in rows if isinstance(row.get("cell_id"), str)}

    def discard_unfinished_requests(self) -> int:
        """Rewrite requests.jsonl (atomically) keeping only warm-up rows and rows of finished cells (those
        with a cells.jsonl row): a cell that was cut off mid-way is rerun whole on resume and its old
        requests must not mix with the new ones. Damaged lines go too. Returns the lines removed."""
        path = self.root / "requests.jsonl"
        if not path.exists():
            return 0
        finished = self.finished_cell_ids()
        kept, removed = [], 0
        with self._writing("reading requests.jsonl"):
            lines = path.read_bytes().splitlines()
        for line in lines:
            if not line.strip():
                continue
            row = _decode_row(line)
            if row is not None and (row.get("warmup") or row.get("cell_id") in finished):
                kept.append(line)
            else:
                removed += 1
        if removed:
            with self._writing("rewriting requests.jsonl"):
                atomic_write_bytes(path, b"".join(line + b"\n" for line in kept))
        return removed

    # --- other files -------------------------------------------------------------------------------
    def write_timeline(self, cell_id: str, frame: pd.DataFrame) -> None:
        path = self.root / "timelines" / f"{_file_name(cell_id, 'cell id')}.csv"
        with self._writing(f"writing timelines/{path.name}"):
            atomic_write_text(path, frame.to_csv(index=False))

    def log_path(self, backend: str) -> Path:
        return self.root / "logs" / f"{_file_name(backend, 'backend label')}.log"


def _file_name(name: str, what: str) -> str:
    """``name`` when it is one file name (no folder part, not '.' or '..'), else ValueError: a label made
    from user input must not write outside the run folder."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{what} {name!r} cannot be a file name in the run folder")
    return name


def _invocation_of(info: dict) -> dict:
    """One entry of run.json's ``invocations``: who ran it, when, and how it ended."""
    keys = ("command", "started_at", "harness_pid", "harness_host", "harness_started_at", "mode", "status",
            "finished_at", "error")
    return {k: info[k] for k in keys if k in info}


def migrate_row(row: dict, model: type[BaseModel]) -> dict:
    """One stored row (any schema version) as a row of the current schema.

    v1 -> v2: the fields v2 added take their defaults (``repeat`` 0, ``load_profile`` "concurrent",
    ``request_rate`` None, ``variant`` "", ``token_contract`` "" = not recorded, ``attached`` False, the
    queueing and goodput fields None): a v1 run was one closed-loop repeat of each cell.
    v2 -> v3: ``client_loop_lag_s_max`` None where the row lacks it (not measured). A stored cell's TPOT and
    goodput keep the figures its run wrote (a v2 TPOT may be 0.0 where v3 says undefined): ``kvbench report
    --recompute RUN`` rebuilds them from requests.jsonl under the current definitions.
    v3 -> v4: ``engine_mode`` "" (not recorded: every earlier run sized the pool itself, as "sized" does
    now, and started vLLM with --enforce-eager), ``gpus_used`` 1, ``gpu_devices`` [], and the per-GPU KV,
    weights and overhead fields None (not measured).
    v4 -> v5: ``replica`` "" (every earlier row is a single server's), ``replicas``, ``queued_first_s`` and
    ``queued_first_replica`` None (not measured: earlier runs did not record when requests first waited).
    v5 -> v6: ``t_cell_start_unix`` and the ``prom_*`` figures None (``prom_gpu_devices`` and ``prom_engines``
    [], ``prom_samples`` 0): not measured, no Prometheus was read.
    """
    version = int(row.get("schema_version", 1))
    if version > SCHEMA_VERSION:
        raise ValueError(f"row has schema version {version}, newer than this kvbench's {SCHEMA_VERSION}: upgrade kvbench")
    out = model.model_validate(row).model_dump()
    out["schema_version"] = SCHEMA_VERSION
    return out


def _decode_row(line: bytes) -> dict | None:
    """One JSONL line as a row, or None when it is not a whole JSON object (a torn or garbled line)."""
    try:
        row = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return row if isinstance(row, dict) else None


def read_jsonl_rows(path: Path) -> tuple[list[dict], list[int]]:
    """The rows of a JSONL record and the (1-based) numbers of the damaged lines skipped: a line that is
    not a whole JSON object, typically the last one a crash cut short. A missing file has no rows."""
    numbered, damaged = _numbered_rows(path)
    return [row for _, row in numbered], damaged


def _numbered_rows(path: Path) -> tuple[list[tuple[int, dict]], list[int]]:
    if not path.exists():
        return [], []
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ResultsReadError(f"{path}: cannot be read: {(exc.strerror or str(exc)).lower()}") from None
    rows, damaged = [], []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        row = _decode_row(line)
        if row is None:
            damaged.append(number)
        else:
            rows.append((number, row))
    return rows, damaged


def _read_jsonl(path: Path, model: type[BaseModel]) -> pd.DataFrame:
    """A JSONL record as a DataFrame of the current schema. Damaged lines are skipped with a
    :class:`DamagedLinesWarning` and counted in ``frame.attrs["damaged_lines"]`` ({path: [line numbers]});
    a whole row of the wrong shape is a :class:`ResultsReadError` naming the line and field."""
    numbered, damaged = _numbered_rows(path)
    rows = []
    for number, row in numbered:
        try:
            rows.append(migrate_row(row, model))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'row'}: {e['msg']}" for e in exc.errors())
            raise ResultsReadError(f"{path} line {number}: {problems}") from None
        except ValueError as exc:
            raise ResultsReadError(f"{path} line {number}: {exc}") from None
    if damaged:
        warnings.warn(DamagedLinesWarning(path, damaged), stacklevel=2)
    frame = pd.DataFrame(rows, columns=list(model.model_fields))
    frame.attrs["damaged_lines"] = {str(path): damaged} if damaged else {}
    return frame


def load_cells(run_dir: str | Path) -> pd.DataFrame:
    """The cells of a run as a DataFrame (one row per cell), migrated to the current schema; a torn line
    is skipped and counted (see :func:`_read_jsonl`)."""
    return _read_jsonl(Path(run_dir) / "cells.jsonl", CellRow)


def load_run_info(run_dir: str | Path) -> dict:
    """run.json as a dict; :class:`ResultsReadError` (naming the file) when it is not a JSON object."""
    path = Path(run_dir) / "run.json"
    try:
        info = json.loads(path.read_bytes())
    except ValueError as exc:
        raise ResultsReadError(f"{path}: not valid JSON ({exc})") from None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ResultsReadError(f"{path}: cannot be read: {(exc.strerror or str(exc)).lower()}") from None
    if not isinstance(info, dict):
        raise ResultsReadError(f"{path}: not a JSON object")
    return info


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
    import typing

    lists = {name for name, info in model.model_fields.items()
             if list in (typing.get_origin(info.annotation), info.annotation)}
    frame = frame.copy()
    for col, dtype in dtypes.items():
        if col not in frame.columns:
            frame[col] = pd.Series([None] * len(frame), index=frame.index, dtype="object")
        series = frame[col]
        if col in lists:  # a Parquet copy gives numpy arrays where the JSONL record has lists
            frame[col] = series.map(lambda v: v.tolist() if hasattr(v, "tolist") and not isinstance(v, str) else v)
        elif dtype == "object":
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


PARQUET_DAMAGED_KEY = b"kvbench_damaged_lines"  # the JSONL's skipped line numbers, so load() still says so
PARQUET_SOURCE_KEY = b"kvbench_source_bytes"  # the JSONL's size the copy was made from


def write_parquet(run_dir: str | Path) -> list[Path]:
    """Write cells.parquet and requests.parquet beside the JSONL files (migrated to the current schema;
    the schema version is in each file's metadata under ``kvbench_schema_version``). The JSONL files stay
    the crash-safe record; the Parquet files are a derived copy that :func:`load` prefers when current.
    Each copy replaces the old one atomically; a write error is a :class:`ResultsWriteError`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_dir = Path(run_dir)
    written = []
    for jsonl, parquet, model in PARQUET_FILES.values():
        if not (run_dir / jsonl).exists():
            continue
        source_bytes = (run_dir / jsonl).stat().st_size
        frame = _read_jsonl(run_dir / jsonl, model)
        damaged = frame.attrs.get("damaged_lines", {}).get(str(run_dir / jsonl), [])
        if model is RequestRow:
            # engine_details is free-form per engine: kept as JSON text so every run has one column type
            frame["engine_details"] = frame.engine_details.map(json.dumps)
        table = pa.Table.from_pandas(frame, preserve_index=False)
        meta = dict(table.schema.metadata or {})
        meta[PARQUET_META_KEY] = str(SCHEMA_VERSION).encode()
        meta[PARQUET_SOURCE_KEY] = str(source_bytes).encode()
        if damaged:
            meta[PARQUET_DAMAGED_KEY] = json.dumps(damaged).encode()
        buffer = pa.BufferOutputStream()
        # page checksums: a copy damaged on disk fails to read (and load() falls back to the JSONL)
        # instead of reading back as wrong numbers
        pq.write_table(table.replace_schema_metadata(meta), buffer, write_page_checksum=True)
        try:
            atomic_write_bytes(run_dir / parquet, buffer.getvalue().to_pybytes())
        except OSError as exc:
            raise ResultsWriteError(run_dir, f"writing {parquet}", exc) from exc
        written.append(run_dir / parquet)
    return written


def parquet_is_current(run_dir: str | Path) -> bool:
    """True when every Parquet copy exists, is readable, has the current schema version and was made from
    its JSONL as it is now (not older than it, and from as many bytes where the copy records that)."""
    import pyarrow.parquet as pq

    run_dir = Path(run_dir)
    for jsonl, parquet, _ in PARQUET_FILES.values():
        src, dst = run_dir / jsonl, run_dir / parquet
        if not src.exists():
            continue
        if not dst.exists() or dst.stat().st_mtime < src.stat().st_mtime:
            return False
        try:
            meta = pq.read_schema(dst).metadata or {}
        except Exception:  # a corrupt copy (pyarrow raises ArrowInvalid, OSError, ...) is never current
            return False
        if meta.get(PARQUET_META_KEY) != str(SCHEMA_VERSION).encode():
            return False
        if PARQUET_SOURCE_KEY in meta and meta[PARQUET_SOURCE_KEY] != str(src.stat().st_size).encode():
            return False
    return True


def ensure_parquet(run_dir: str | Path) -> bool:
    """Write the Parquet copies unless they are current; True when they were (re)written."""
    if parquet_is_current(run_dir):
        return False
    write_parquet(run_dir)
    return True


def _read_parquet(path: Path, model: type[BaseModel]) -> pd.DataFrame:
    import pyarrow.parquet as pq

    table = pq.read_table(path, page_checksum_verification=True)
    frame = table.to_pandas()
    if model is RequestRow:
        frame["engine_details"] = frame.engine_details.map(json.loads)
    for col in ("flags", "chunk_times", "chunk_tokens"):  # numpy arrays back to lists
        if col in frame:
            frame[col] = frame[col].map(list)
    damaged = (table.schema.metadata or {}).get(PARQUET_DAMAGED_KEY)
    if damaged:  # the JSONL the copy was made from had damaged lines: say so as the JSONL reader would
        source = path.parent / PARQUET_FILES["cells" if model is CellRow else "requests"][0]
        lines = json.loads(damaged)
        warnings.warn(DamagedLinesWarning(source, lines), stacklevel=3)
        frame.attrs["damaged_lines"] = {str(source): lines}
    return frame


def load(*run_dirs: str | Path, what: Literal["cells", "requests"] = "cells") -> pd.DataFrame:
    """One or more runs as one tidy DataFrame: one row per cell (``what="cells"``) or per request
    (``what="requests"``), every run migrated to the current schema, with ``run_id`` and ``run_dir``
    columns. Reads the Parquet copy when it is current and readable, else the JSONL record (never writes).
    Damaged JSONL lines are skipped with a :class:`DamagedLinesWarning` and listed in
    ``frame.attrs["damaged_lines"]``.

    Requests get three derived columns: ``tpot_s`` (bench/metrics.py's definition), ``ok`` (a measured
    request that met the token contract: the only kind in the cells' figures) and ``engine_details``
    as a dict. ``load(a, b)`` and ``load([a, b])`` are the same.
    """
    if len(run_dirs) == 1 and isinstance(run_dirs[0], (list, tuple)):
        run_dirs = tuple(run_dirs[0])
    if what not in PARQUET_FILES:
        raise ValueError(f"what must be one of {', '.join(PARQUET_FILES)}, not {what!r}")
    jsonl, parquet, model = PARQUET_FILES[what]
    frames, damaged = [], {}
    for run_dir in map(Path, run_dirs):
        if not (run_dir / "run.json").exists():
            raise FileNotFoundError(f"{run_dir} has no run.json: not a kvbench run folder")
        frame = None
        if (run_dir / parquet).exists() and parquet_is_current(run_dir):
            try:
                frame = _read_parquet(run_dir / parquet, model)
            except Exception as exc:  # a damaged copy: the JSONL is the record
                why = " ".join(str(exc).split())  # pyarrow's messages span lines
                warnings.warn(ResultsWarning(run_dir / parquet, f"{parquet}: unreadable ({type(exc).__name__}: "
                                                                f"{why}); read {jsonl} instead"), stacklevel=2)
        if frame is None:
            frame = _read_jsonl(run_dir / jsonl, model)
        damaged.update(frame.attrs.get("damaged_lines", {}))
        if frame.empty:
            continue
        if model is RequestRow:
            frame = _requests_derived(frame)
        frame["run_dir"] = str(run_dir)
        frames.append(frame)
    if not frames:
        out = pd.DataFrame(columns=[*model.model_fields, "run_dir"])
    else:
        out = normalize_dtypes(pd.concat(frames, ignore_index=True), model)
    out.attrs = {"damaged_lines": damaged}  # {JSONL path: skipped line numbers}, as warned
    return out
