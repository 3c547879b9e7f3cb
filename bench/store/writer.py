"""The files of a run and the writer that owns them.

A run is a folder ``results/runs/<run_id>/``:

- ``run.json``: run id, command, schema version, environment (harness, CPU/GPU, engines and their
  versions, model file hash) and the exact workload;
- ``cells.jsonl``: one :class:`CellRow` per (backend, prompt length, concurrency), appended as each cell
  finishes, so an interrupted run keeps what it finished;
- ``requests.jsonl``: one :class:`RequestRow` per request with every chunk's timestamp;
- ``timelines/<cell_id>.csv``: memory and KV-in-use samples of the cell on one time axis;
- ``logprobs/<cell_id>.json`` (kv_quant workloads): each request's greedy tokens and top-k log-probabilities;
- ``logs/<backend>.log``: each engine's own log.

Rewritten files (run.json, timelines, the Parquet copies) are replaced atomically and appends are whole
fsynced lines (``kvbench.common.files``), so a crash or a full disk leaves every finished row readable; the
readers skip (and count, in a :class:`DamagedLinesWarning`) a torn line a crash left behind.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import pandas as pd
import psutil
from pydantic import BaseModel

from kvbench.common import outside
from kvbench.common.files import append_line, atomic_write_bytes, atomic_write_text
from kvbench.common.redact import holding, scrub_value
from kvbench.kv import bounded
from kvbench.store.errors import ResultsReadError, ResultsWriteError, RunExistsError, RunFolderError
from kvbench.store.readers import JSONL_MAX_BYTES, _decode_row, load_run_info, read_jsonl_rows
from kvbench.store.schema import SCHEMA_VERSION, CellRow, RequestRow

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


class RunFolderLock:
    """A run folder's one owner: an exclusive lock on the folder itself (flock), which the OS releases when
    the process ends however it ends, so a killed harness leaves no stale lock. Emptying the folder for
    --overwrite keeps the lock (it is on the folder, not a file in it)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._fd: int | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise ResultsWriteError(self.root, "creating the run folder", exc) from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(self._fd)
            self.release()
            raise RunFolderError(f"run {self.root.name} in {self.root.parent} is in use by another kvbench"
                                 + (f" (pid {holder})" if holder else "")
                                 + ": wait for it to finish, or give another --run-id") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.release()


def is_published(run_dir: Path) -> bool:
    """Whether a run folder lies under results/published (the runs the docs cite: never rewritten by a run)."""
    parts = Path(os.path.realpath(run_dir)).parts
    return any(a == "results" and b == "published" for a, b in zip(parts, parts[1:]))


def check_same_schema(info: dict, name: str) -> None:
    """A run is resumed by a kvbench that writes its schema: an older run's rows (and cell ids: before
    repeats they had no ``_r0``) would mix with rows of today's, its finished cells be taken as missing and
    measured again. RunFolderError naming both versions otherwise."""
    version = info.get("schema_version") or 1
    if version != SCHEMA_VERSION:
        which = "an older" if version < SCHEMA_VERSION else "a newer"
        raise RunFolderError(f"--resume: run {name} was written under results schema v{version}, {which} one than "
                             f"this kvbench's v{SCHEMA_VERSION}: resuming would mix two schemas in one run (its "
                             "finished cells measured again where their ids changed); start a new run (report and "
                             "compare read it as it is)")


def lock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file behind ``fd``, from /proc/locks (None where it cannot be read)."""
    st = os.fstat(fd)
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 fd:01:123456 0 EOF"
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].endswith(f":{st.st_ino}"):
            return int(parts[4])
    return None


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

    def __init__(self, root: Path, mode: RunMode = "new", check: Callable[[dict], None] | None = None):
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
        if mode in ("resume", "overwrite") and has_run and is_published(root):
            raise RunFolderError(f"run {name} in {where} is a published run: it is never rewritten (--{mode}); "
                                 "copy it elsewhere to resume it, or start a new run")
        if mode == "resume":
            if not (root / "run.json").exists():
                raise RunFolderError(f"run {name} not found in {where} (no run.json): nothing to resume; "
                                     "leave out --resume to start it")
            info = self._read_info()  # a damaged run.json is refused now, before any engine starts
            if check is not None:  # the caller's (a resumed run is resumed as it was started), before any write
                check(info)
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
        info = scrub_value(info)  # every credential kvbench holds masked (a server's words it recorded)
        with self._writing("writing run.json"):
            atomic_write_text(self.root / "run.json", json.dumps(info, indent=2))
        self._info = info

    def write_run_info(self, info: dict) -> None:
        """Write run.json at the start of an invocation, with ``harness_pid``, ``harness_host`` and
        ``harness_started_at`` (so :func:`run_status` can tell a killed harness) and this invocation in
        ``invocations``. In "resume" mode the earlier run.json is kept underneath: its ``started_at`` and
        invocations stay, the new fields win, and an earlier ``finished_at``/``error`` is dropped."""
        harness = harness_identity()
        own = {}  # what this invocation records of itself only
        if self.mode == "resume":
            old = self._read_info()
            earlier = old.get("invocations") or [_invocation_of(old)]
            merged = {k: v for k, v in old.items() if k not in ("finished_at", "error")}
            merged.update({"schema_version": SCHEMA_VERSION, **info, **harness,
                           "started_at": old.get("started_at", info.get("started_at"))})
            if isinstance(old.get("environment"), dict):
                # the machine the run's cells were measured on stays the run's (a resume on another is
                # refused before this); this invocation's own goes to its entry where it differs at all
                merged["environment"] = old["environment"]
                if "environment" in info and info["environment"] != old["environment"]:
                    own["environment"] = info["environment"]
            merged["invocations"] = list(earlier)
        else:
            merged = {"schema_version": SCHEMA_VERSION, **info, **harness, "invocations": []}
        merged["invocations"].append(_invocation_of({**info, **harness}) | {"mode": self.mode} | own)
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

    def update_run_info(self, invocation: dict | None = None, **fields) -> None:
        """Set fields of run.json (atomically); ``status``, ``finished_at`` and ``error`` also go to the
        current invocation's entry, so each invocation's outcome stays recorded, and ``invocation``'s go
        there only (a refused resume: the run's status stays what it was, the invocation says "refused")."""
        info = dict(self._read_info())
        info.update(fields)
        invocations = list(info.get("invocations") or [])
        if invocations:
            outcome = {k: fields[k] for k in ("status", "finished_at", "error") if k in fields}
            invocations[-1] = {**invocations[-1], **outcome, **(invocation or {})}
            info["invocations"] = invocations
        self._write_info(info)

    # --- rows --------------------------------------------------------------------------------------
    def _append(self, name: str, row: BaseModel) -> None:
        if holding():  # the last guard: no credential in a row, whatever put it there
            changed = {k: v2 for k, v in row.__dict__.items()
                       if isinstance(v, (str, dict, list)) and (v2 := scrub_value(v)) != v}
            row = row.model_copy(update=changed) if changed else row
        try:
            line = row.model_dump_json()
        except ValueError as exc:  # a lone surrogate from outside that no boundary caught: written as U+FFFD
            if "surrogate" not in str(exc):
                raise
            row = row.model_copy(update={k: outside.texts(v) for k, v in row.__dict__.items()
                                         if isinstance(v, (str, dict, list))})
            line = row.model_dump_json()
        with self._writing(f"writing {name}"):
            append_line(self.root / name, line)

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
        try:  # a regular file within the readers' bound (a FIFO or /dev/zero in its place: refused, not read)
            with self._writing("reading requests.jsonl"):
                lines = bounded.read_bytes(path, JSONL_MAX_BYTES, what="").splitlines()
        except bounded.InputError as exc:
            raise ResultsReadError(str(exc)) from None
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

    def write_logprobs(self, cell_id: str, records: list[dict]) -> None:
        """A kv_quant cell's greedy tokens and log-probabilities per request (logprobs/<cell_id>.json),
        written atomically: what the report's divergence from the baseline is computed from."""
        path = self.root / "logprobs" / f"{_file_name(cell_id, 'cell id')}.json"
        with self._writing(f"writing logprobs/{path.name}"):
            path.parent.mkdir(exist_ok=True)
            atomic_write_text(path, json.dumps({"cell_id": cell_id, "requests": records}, separators=(",", ":")))

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
