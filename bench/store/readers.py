"""Reading runs back: the JSONL records (a torn line skipped and counted), run.json, the Parquet copy
beside them (rebuilt when stale) and :func:`load`, the one public loader of tidy frames.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import re
import warnings
from pathlib import Path
from typing import Literal

import pandas as pd
from pydantic import BaseModel, ValidationError

from kvbench.common import outside
from kvbench.common.files import atomic_write_bytes
from kvbench.common.metrics import RequestTimes, request_verdict
from kvbench.kv import bounded
from kvbench.store.errors import DamagedLinesWarning, ResultsReadError, ResultsWarning, ResultsWriteError
from kvbench.store.schema import SCHEMA_VERSION, CellRow, RequestRow, migrate_row


# a JSON escape of a lone surrogate (a server's "\ud800", kept as it came by an earlier kvbench): such a string
# cannot be written as UTF-8 (report.md, Parquet), so it is read as text that can (kvbench.common.outside)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _decode_row(line: bytes) -> dict | None:
    """One JSONL line as a row, or None when it is not a whole JSON object (a torn or garbled line)."""
    try:
        row = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    if isinstance(row, dict) and _SURROGATE_ESCAPE.search(line):
        row = outside.texts(row)
    return row if isinstance(row, dict) else None


def read_jsonl_rows(path: Path) -> tuple[list[dict], list[int]]:
    """The rows of a JSONL record and the (1-based) numbers of the damaged lines skipped: a line that is
    not a whole JSON object, typically the last one a crash cut short. A missing file has no rows."""
    numbered, damaged = _numbered_rows(path)
    return [row for _, row in numbered], damaged


def _numbered_rows(path: Path) -> tuple[list[tuple[int, dict]], list[int]]:
    if not path.exists():
        return [], []
    try:  # a regular file (a FIFO or /dev/zero in its place is refused, never read)
        data = bounded.read_bytes(path, JSONL_MAX_BYTES, what="")
    except bounded.InputError as exc:
        raise ResultsReadError(str(exc)) from None
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


INT64_MAX = 2**63 - 1
JSONL_MAX_BYTES = 64 << 30  # a run's requests.jsonl: ~3 KB a request, 10^7 requests
LOGPROBS_MAX_BYTES = 4 << 30  # one kv_quant cell's log-probabilities: the top 20 of every token of every request


def _beyond_int64(item) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and abs(item) > INT64_MAX


def _damaged_number(row: dict) -> str | None:
    """The field of a row (or an item of a list field) holding a number no writer writes: NaN or Infinity
    (pydantic writes null where nothing was measured) or, in a list, an integer beyond 64 bits (pandas cannot
    hold it). None for a sound row. (A field of its own beyond 64 bits is :func:`_counts_beyond_int64`'s.)"""
    for key, value in row.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                return f"{key} is {json.dumps(item)}, where a number (or null, not measured) belongs"
            if isinstance(value, list) and _beyond_int64(item):
                return f"{key} is {item}, beyond a 64-bit integer"
    return None


def _counts_beyond_int64(row: dict) -> list[str]:
    """The fields holding an integer beyond 64 bits: a server's count an earlier kvbench kept as it came (a
    /metrics pool of 10^30 blocks), read as not measured (None) and said where the field may be None, so that
    the rest of the run reads; a damaged row where it may not."""
    return [key for key, value in row.items() if _beyond_int64(value)]


def _read_jsonl(path: Path, model: type[BaseModel]) -> pd.DataFrame:
    """A JSONL record as a DataFrame of the current schema. Damaged lines are skipped with a
    :class:`DamagedLinesWarning` and counted in ``frame.attrs["damaged_lines"]`` ({path: [line numbers]});
    a whole row of the wrong shape is a :class:`ResultsReadError` naming the line and field."""
    numbered, damaged = _numbered_rows(path)
    rows, beyond = [], []
    for number, row in numbered:
        if problem := _damaged_number(row):
            raise ResultsReadError(f"{path} line {number}: damaged row: {problem}")
        for key in _counts_beyond_int64(row):
            field = model.model_fields.get(key)
            if field is None or field.is_required() or field.default is not None:  # a count every row has
                raise ResultsReadError(f"{path} line {number}: damaged row: {key} is {row[key]}, beyond a "
                                       "64-bit integer")
            beyond.append(f"line {number}: {key} {row[key]:.3g}")
            row[key] = None
        try:
            rows.append(migrate_row(row, model))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'row'}: {e['msg']}" for e in exc.errors())
            raise ResultsReadError(f"{path} line {number}: {problems}") from None
        except ValueError as exc:
            raise ResultsReadError(f"{path} line {number}: {exc}") from None
    if damaged:
        warnings.warn(DamagedLinesWarning(path, damaged), stacklevel=2)
    if beyond:
        shown = "; ".join(beyond[:3]) + ("; ..." if len(beyond) > 3 else "")
        warnings.warn(ResultsWarning(path, f"{path.name}: {len(beyond)} value(s) beyond a 64-bit integer read as "
                                           f"not measured ({shown})"), stacklevel=2)
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
    try:  # a regular file, bounded in size and nesting (kvbench.kv.bounded)
        data = bounded.read_bytes(path, bounded.RUN_JSON_MAX_BYTES, what="")  # the path names it
        info = bounded.parse_json(data, path, what="")
        if _SURROGATE_ESCAPE.search(data):  # a server's lone surrogate an earlier kvbench kept: text that encodes
            info = outside.texts(info)
    except bounded.InputError as exc:
        raise ResultsReadError(str(exc)) from None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ResultsReadError(f"{path}: cannot be read: {(exc.strerror or str(exc)).lower()}") from None
    if not isinstance(info, dict):
        raise ResultsReadError(f"{path}: not a JSON object")
    try:  # the fields every reader takes for granted, of their types (a hand-edited or hostile run.json)
        _RunInfoShape.model_validate(info)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].lower()}" for e in exc.errors()[:3])
        raise ResultsReadError(f"{path}: a field of the wrong type ({problems})") from None
    return info


class _ModelShape(BaseModel):
    name: str | None = None
    sha256: str | None = None
    max_context: int | None = None


class _EnvironmentShape(BaseModel):
    cpu: str | None = None
    cpu_flags: list[str] | None = None
    cpu_count: int | None = None
    memory_bytes: int | None = None
    gpus: list[dict] | None = None


class _RunInfoShape(BaseModel):
    """What run.json's readers (report, compare, resume, recompute) read, with its types: None where a run
    of an older schema lacks it; every other key is free."""

    schema_version: int | None = None
    run_id: str | None = None
    command: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    status: str | None = None
    environment: _EnvironmentShape | None = None
    workload: dict | None = None
    repeats: int | None = None
    kv_dtype: str | None = None
    backends: list[dict] | None = None
    interleaved: bool | None = None
    harness_pid: int | None = None
    harness_host: str | None = None
    harness_started_at: float | None = None
    invocations: list[dict] | None = None
    model: _ModelShape | None = None
    prompt_lengths: list[int] | None = None
    load_points: list[dict] | None = None
    engine_versions: dict[str, str | None] | None = None
    gpu_baselines: dict | None = None
    token_checks: dict | None = None
    estimates: dict | None = None
    engine_stops: dict | None = None


# --- the columnar copy (Parquet) and the one public loader ---------------------------------------------

PARQUET_FILES = {"cells": ("cells.jsonl", "cells.parquet", CellRow),
                 "requests": ("requests.jsonl", "requests.parquet", RequestRow)}
PARQUET_META_KEY = b"kvbench_schema_version"


def _requests_derived(frame: pd.DataFrame) -> pd.DataFrame:
    """Per-request figures the cell's percentiles are made of (bench/common/metrics.py), as columns: ``tpot_s``;
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
    lists = _list_fields(model)
    # each column converted on its own array and the frame built once: a column set into the frame at a time
    # (Series.where, astype, __setitem__) took 40 ms for a run's 118 columns, most of it pandas' bookkeeping
    columns = {}
    for col, dtype in dtypes.items():
        series = frame[col] if col in frame.columns else pd.Series([None] * len(frame), index=frame.index,
                                                                    dtype="object")
        if col in lists:  # a Parquet copy gives numpy arrays where the JSONL record has lists
            columns[col] = series.map(lambda v: v.tolist() if hasattr(v, "tolist") and not isinstance(v, str) else v)
        elif dtype == "object":
            columns[col] = _none_for_missing(series)
        elif dtype in ("float64", "Int64") and series.dtype == dtype:
            columns[col] = series.copy()
        elif dtype in ("float64", "Int64"):
            columns[col] = pd.to_numeric(_none_for_missing(series), errors="coerce").astype(dtype)
        else:
            columns[col] = series.astype(dtype)
    order = [c for c in dtypes if c in model.model_fields] + \
        [c for c in [*frame.columns, *(c for c in dtypes if c not in frame.columns)] if c not in model.model_fields]
    out = pd.DataFrame({c: columns[c] if c in columns else frame[c].copy() for c in order}, index=frame.index)
    out.attrs = copy.deepcopy(frame.attrs)
    return out


def _none_for_missing(series: pd.Series) -> pd.Series:
    """``series`` as Python objects, None wherever pandas sees a missing value (NaN, NaT, <NA>)."""
    values = series.to_numpy(dtype=object, copy=True)
    values[pd.isna(values)] = None
    return pd.Series(values, index=series.index, dtype="object")


@functools.cache
def _list_fields(model: type[BaseModel]) -> frozenset[str]:
    import typing

    return frozenset(name for name, info in model.model_fields.items()
                     if list in (typing.get_origin(info.annotation), info.annotation))


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

    Requests get three derived columns: ``tpot_s`` (bench/common/metrics.py's definition), ``ok`` (a measured
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


def load_logprobs(run_dir: str | Path) -> dict[str, dict[str, dict]]:
    """A kv_quant run's per-cell records (logprobs/<cell_id>.json, written by ``RunWriter.write_logprobs``):
    {cell_id: {request_id: {"tokens", "top" (one {id: logprob} per position), "prompt_logprobs", "k"}}}, the
    failed requests left out. A file that cannot be read is skipped with a warning."""
    out: dict[str, dict[str, dict]] = {}
    for path in sorted((Path(run_dir) / "logprobs").glob("*.json")):
        try:  # a regular file within bounds: a FIFO, /dev/zero or 100,000 nested lists is one warning
            data = bounded.read_json(path, LOGPROBS_MAX_BYTES, what="")
            out[data["cell_id"]] = {
                r["request_id"]: {"tokens": r["tokens"], "k": r.get("k", 0),
                                  "prompt_logprobs": r.get("prompt_logprobs"),
                                  "top": [{int(t): float(lp) for t, lp in top} for top in r.get("top") or []]}
                for r in data["requests"] if not r.get("error")}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            warnings.warn(f"{path}: unreadable ({type(exc).__name__}: {exc}); its cell has no divergence", stacklevel=2)
    return out
