"""``kvbench merge DIR... --into RUN``: the run folders of one experiment's load shares (``kvbench run
--load-share I/N``, one per machine or pod) joined into one run, as if one load process had sent it all.

What makes folders one experiment: the same workload (its seed in it), model (name and sha256), backends
(labels and options), prompt salt, KV dtype and repeats, and shares 0..N-1 of the same N, each once. Any
other folder is refused, in one line naming the difference (:class:`MergeError`, exit 2).

How a cell is joined (AIPerf's records manager re-ingests every worker's raw records the same way; summaries
or histograms cannot be merged into percentiles, as inference-perf's distributed-load notes say):

- every share's raw per-request records are read back; their times are already on the run owner's clock
  (each share put them there with its measured offsets, which each request keeps);
- every request is accounted for: the ordinals (each request's place in the cell's schedule) the profile
  gave each share (:meth:`~kvbench.load.profile.LoadProfile.shares` of ``range(requests_planned)``) must be
  exactly the ones that share recorded, no ordinal twice, and all of them together ``0..n-1`` once each (a
  permutation; with a ``duration_s`` the ones due within it); anything else is refused, naming the cell,
  the share and the ordinals;
- a share whose folder lacks the cell (its pod died, or its run ended, before the cell's row was written)
  is refused, or with ``--accept-lost`` taken with its requests recorded as lost (``error`` "lost: ...", the
  cell's ``n_lost``, counted as failed): never dropped;
- every figure made of requests is computed again from the joined records (:func:`kvbench.run.rows.request_figures`:
  the token contract, latency percentiles, throughput, the load achieved, the most requests in flight); what
  the engine said during the cell (KV in use, its queue, its prefix-cache counters, the memory timeline) is
  share 0's, the owner's, whose polls saw the server under every share's load.

The merged run's folder has the run.json of share 0 with ``merged_from`` (each folder, its share, status
and host), cells.jsonl, requests.jsonl (every share's requests, the lost ones too), and share 0's timelines,
telemetry and logs.
"""
from __future__ import annotations

import json
import shutil
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvbench.backends.types import RequestResult
from kvbench.load import LoadPoint, profile_class
from kvbench.load.common import LOST, LoadResult, is_lost
from kvbench.load.workers import in_flight_peak
from kvbench.common.metrics import percentiles
from kvbench.run.prefix_cache import cold_hit_flag, measured_hits
from kvbench.run.contract import lost_flag, request_figures
from kvbench.run.rows import request_row
from kvbench.store.errors import ResultsReadError
from kvbench.store.readers import ensure_parquet, load_run_info, not_a_run_dir, read_jsonl_rows
from kvbench.store.schema import CellRow, RequestRow, migrate_row
from kvbench.store.writer import RunWriter
from kvbench.workloads import Workload


class MergeError(ValueError):
    """Folders that are not the shares of one experiment, or records that do not account for every request."""


#: run.json's records that must be equal in every share's folder (the experiment), and how each is named.
SAME = {"workload": "workload", "model": "model", "backends": "backends", "prompt_salt": "prompt salt",
        "kv_dtype": "KV dtype", "repeats": "repeats", "interleaved": "interleave",
        "reset_cache_between_cells": "cache resets"}


@dataclass
class Share:
    """One share's run folder: its record and rows (migrated to the current schema)."""

    path: Path
    info: dict
    index: int
    of: int
    cells: dict[tuple[str, int], dict] = field(default_factory=dict)  # (cell_id, repeat) -> row
    order: list[tuple[str, int]] = field(default_factory=list)
    requests: dict[tuple[str, int], list[dict]] = field(default_factory=dict)  # measured requests per cell
    warmups: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.path} (share {self.index} of {self.of})"


def read_share(path: Path) -> Share:
    if problem := not_a_run_dir(path):
        raise MergeError(problem)
    info = load_run_info(path)
    share = info.get("load_share") or {"index": 0, "of": 1}
    if not isinstance(share, dict) or not isinstance(share.get("index"), int) or not isinstance(share.get("of"), int):
        raise MergeError(f"{path}: run.json's load_share is {share!r}, not {{index, of}}")
    out = Share(Path(path), info, share["index"], share["of"])
    cells, _ = read_jsonl_rows(Path(path) / "cells.jsonl")
    for raw in cells:
        row = _migrated(raw, CellRow, path, "cells.jsonl")
        if row["replica"]:
            raise MergeError(f"{path}: cell {row['cell_id']} is a deployment's replica row: kvbench merge joins "
                             "shares sent to one endpoint (a Kubernetes Service: -b ENGINE:url=...)")
        key = (row["cell_id"], row["repeat"])
        out.cells[key] = row
        out.order.append(key)
    requests, _ = read_jsonl_rows(Path(path) / "requests.jsonl")
    for raw in requests:
        row = _migrated(raw, RequestRow, path, "requests.jsonl")
        if row["warmup"]:
            out.warmups.append(row)
        else:
            out.requests.setdefault((row["cell_id"], row["repeat"]), []).append(row)
    return out


def _migrated(raw: dict, model, path: Path, name: str) -> dict:
    try:
        return migrate_row(raw, model)
    except ValueError as exc:  # pydantic's ValidationError too
        raise MergeError(f"{path}/{name}: {str(exc).splitlines()[0]}") from None


def check_one_experiment(shares: list[Share]) -> None:
    """The folders are shares 0..N-1 of one experiment, else MergeError naming the first difference."""
    first = shares[0]
    for other in shares[1:]:
        for key, what in SAME.items():
            a, b = _comparable(key, first.info.get(key)), _comparable(key, other.info.get(key))
            if a != b:
                raise MergeError(f"{other.path} differs from {first.path} in its {what}{_which(a, b)}: only the "
                                 "folders of one experiment's load shares are merged")
        if other.of != first.of:
            raise MergeError(f"{other.path} is a share of {other.of} processes, {first.path} of {first.of}: "
                             "the folders of one experiment's load shares only")
    seen: dict[int, Share] = {}
    for s in shares:
        if s.index in seen:
            raise MergeError(f"{seen[s.index].path} and {s.path} are both share {s.index} of {s.of}: the same "
                             "requests twice, not two shares")
        seen[s.index] = s


def _comparable(key: str, value):
    if key == "workload" and isinstance(value, dict):
        try:
            return Workload.model_validate(value).model_dump()
        except ValueError:
            return value
    if key == "model" and isinstance(value, dict):
        return {k: value.get(k) for k in ("name", "sha256")}
    if key == "prompt_salt" and isinstance(value, dict):
        return value.get("value")
    return value


def _which(a, b) -> str:
    """The keys of two dicts that differ, or their two values, briefly."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return f" ({', '.join(keys)})"
    if isinstance(a, list) and isinstance(b, list):
        return ""
    return f" ({a!r} and {b!r})"


@dataclass
class MergedCell:
    row: CellRow
    requests: list[RequestResult]


def expected_ordinals(row: dict, of: int) -> list[list[int]]:
    """Each share's ordinals of a cell: the profile's split of ``range(requests_planned)`` over ``of`` shares
    (an empty list for a share the split leaves out)."""
    planned = row["requests_planned"]
    point = LoadPoint(row["load_profile"], row["concurrency"], row["request_rate"])
    split = profile_class(row["load_profile"]).shares(list(range(planned)), point, 0, of) if planned else []
    return [list(split[i][0]) if i < len(split) else [] for i in range(of)]


def merge_cell(key: tuple[str, int], shares: list[Share], of: int, accept_lost: bool, duration: bool) -> MergedCell:
    """One cell from every share's records (module docstring), or MergeError."""
    cell_id, repeat = key
    where = f"cell {cell_id}" + (f" (repeat {repeat})" if repeat else "")
    by_index = {s.index: s for s in shares}
    present = [s for s in shares if key in s.cells]
    base = dict(present[0].cells[key])
    if base["requests_planned"] is None:
        raise MergeError(f"{present[0].path}: {where} recorded no requests_planned (a run from before kvbench "
                         "merge): its requests cannot be accounted for")
    expected = expected_ordinals(base, of)
    results, seen, lost_by = [], {}, []
    for index in range(of):
        s = by_index.get(index)
        mine = set(expected[index])
        if s is None or key not in s.cells:
            if not mine:
                continue
            why = "has no folder" if s is None else f"has no row for it (its run: {s.info.get('status', 'unknown')})"
            if not accept_lost:
                raise MergeError(f"share {index} of {of} {why if s is None else f'({s.path}) ' + why} for {where}: "
                                 f"its {len(mine)} requests are not there; --accept-lost merges them as lost")
            lost_by.append((index, s, sorted(mine)))
            continue
        rows = s.requests.get(key, [])
        got = [r["ordinal"] for r in rows]
        if any(o is None for o in got):
            raise MergeError(f"{s.path}: {where} has requests without an ordinal (a run from before kvbench merge)")
        twice = sorted({o for o in got if got.count(o) > 1})
        stray = sorted(set(got) - mine)
        missing = sorted(mine - set(got))
        if twice or stray or (missing and not duration):
            what = "; ".join(p for p in (twice and f"ordinals {_few(twice)} twice",
                                         stray and f"ordinals {_few(stray)} not of its share",
                                         missing and f"ordinals {_few(missing)} of its share missing") if p)
            raise MergeError(f"{s.name}: {where}: {what}: its records do not account for its share")
        for o, r in zip(got, rows):
            if o in seen:
                raise MergeError(f"{where}: ordinal {o} is in {seen[o].path} and {s.path}")
            seen[o] = s
            results.append(_result(r))
    if duration and lost_by:  # due within the duration: as far as the ordinals sent reach (schedules only grow)
        reach = max(seen, default=-1)
        lost_by = [(i, s, [o for o in ords if o <= reach]) for i, s, ords in lost_by]
    for index, s, ordinals in lost_by:
        process = f"share {index} ({s.path.name})" if s is not None else f"share {index} (no folder)"
        why = "ended before it finished this cell" if s is not None else "left no folder"
        for o in ordinals:
            results.append(_lost(o, cell_id, process, why))
    ordinals = sorted(r.ordinal for r in results)
    if not duration and ordinals != list(range(base["requests_planned"])):
        raise MergeError(f"{where}: the shares' ordinals are not 0..{base['requests_planned'] - 1} once each")
    return MergedCell(_remade(base, present, results, of), results)


def _few(values: list[int]) -> str:
    return ", ".join(map(str, values[:5])) + (f" ... ({len(values)})" if len(values) > 5 else "")


def _result(row: dict) -> RequestResult:
    r = RequestResult(row["request_id"], row["prompt_tokens_sent"], row["output_tokens_requested"], row["t_sent"],
                      list(row["chunk_times"]), list(row["chunk_tokens"]), row["t_done"], row["t_scheduled"],
                      row["prompt_tokens_reported"], row["prompt_tokens_cached"], row["output_tokens_reported"],
                      dict(row["engine_details"] or {}), row["error"])
    r.ordinal, r.load_process = row["ordinal"], row["load_process"]
    r.clock_offset_start_s, r.clock_offset_end_s = row["clock_offset_start_s"], row["clock_offset_end_s"]
    return r


def _lost(ordinal: int, cell_id: str, process: str, why: str) -> RequestResult:
    """A lost request: the share's records say nothing of it but its place (its id and lengths are the
    cell's: not known here), stamped nowhere in particular (0.0: when it left is not known)."""
    r = RequestResult(f"{cell_id}#{ordinal}", 0, 0, 0.0)
    r.error, r.ordinal, r.load_process = f"{LOST}load process {process} {why}", ordinal, process
    return r


def _remade(base: dict, present: list[Share], results: list[RequestResult], of: int) -> CellRow:
    """The cell's row: share 0's (or the first present share's), every figure made of requests made again."""
    key = (base["cell_id"], base["repeat"])
    row = CellRow.model_validate({**base, "flags": [], "status": "ok", "error": None, "log_tail": None})
    sent = [r for r in results if not is_lost(r)]
    for r in results:  # a lost request's lengths are its cell's
        if is_lost(r):
            r.prompt_tokens_sent, r.output_tokens_requested = base["prompt_tokens"], base["output_tokens"]
            r.t_sent = base["t_cell_start"] or 0.0
    lags = [r.t_sent - r.t_scheduled for r in sent if r.t_scheduled is not None]
    loop_lags = [s.cells[key]["client_loop_lag_s_max"] for s in present
                 if s.cells[key]["client_loop_lag_s_max"] is not None]
    ends = [r.t_done or (r.chunk_times[-1] if r.chunk_times else r.t_sent) for r in sent]
    load = LoadResult(sorted(sent, key=lambda r: r.t_sent) + [r for r in results if is_lost(r)],
                      base["t_cell_start"] or 0.0, max(ends, default=0.0),
                      offered_request_rate=base["offered_request_rate"], max_in_flight=in_flight_peak(sent),
                      send_lags=lags, loop_lag_s_max=max(loop_lags) if loop_lags else None, processes=of)
    request_figures(row, load, log_tail=base["log_tail"] or "")
    row.send_lag_s_p99 = percentiles(lags, "lag")["lag_p99"] if lags else None
    ids = {r.request_id for r in results}
    for s in present:  # what a share's row said besides its own requests (an engine's end, a barrier missed)
        for flag in s.cells[key]["flags"]:
            if flag.split(":")[0] not in ids and not flag.startswith(("... ", )) and "requests lost" not in flag \
                    and flag not in row.flags:
                row.flags.append(flag)
    if row.flags and row.status == "ok":
        row.status = "flagged"
    lost = [r for r in results if is_lost(r)]
    if lost and lost_flag(lost) not in row.flags:
        row.flags.insert(0, lost_flag(lost))
    _held(row, base)
    hits = measured_hits(sent, None, None)
    if hits is not None:  # per-request counts: every share's requests
        row.prefix_cache_hit_tokens, row.prefix_cache_query_tokens, row.prefix_cache_source = hits
        row.prefix_cache_hit_rate = hits[0] / hits[1] if hits[1] else None
        if (flag := cold_hit_flag(row.prefix_cache_expected, row.prefix_cache_hit_rate)) and flag not in row.flags:
            row.flags.insert(0, flag)
            row.status = "flagged" if row.status == "ok" else row.status
    row.requests_planned = base["requests_planned"]
    return row


def _held(row: CellRow, base: dict) -> None:
    """The KV the formula gives for the sequences held at once, from the merged cell's requests in flight."""
    cached = row.prompt_tokens + row.output_tokens - 1
    before = base["kv_tokens_peak_predicted"]
    if not before or cached <= 0:
        return
    held_before = max(1, before // cached)
    held = max(1, min(row.max_in_flight or 1, row.kv_pool_sequences_predicted or 10**9))
    row.kv_tokens_peak_predicted = held * cached
    if base["kv_bytes_peak_predicted"] is not None:
        row.kv_bytes_peak_predicted = base["kv_bytes_peak_predicted"] / held_before * held
    if row.kv_in_use_peak_bytes and row.kv_bytes_peak_predicted:
        row.kv_measured_over_predicted = row.kv_in_use_peak_bytes / row.kv_bytes_peak_predicted


@dataclass
class Merged:
    into: Path
    shares: list[Share]
    cells: int
    requests: int
    lost: int


def merge(folders: list[Path], into: Path, accept_lost: bool = False, command: str = "") -> Merged:
    """Read, check and join ``folders`` into the new run folder ``into`` (nothing is written unless every
    cell accounts for every request). MergeError (one line) for folders that are not one experiment's shares."""
    if len(folders) < 1:
        raise MergeError("give the run folders of every load share")
    resolved = [Path(f).resolve() for f in folders]
    if len(set(resolved)) != len(resolved):
        raise MergeError("a folder is given twice")
    if Path(into).resolve() in resolved:
        raise MergeError(f"--into {into} is one of the folders merged: give a new folder")
    try:
        shares = sorted((read_share(Path(f)) for f in folders), key=lambda s: s.index)
    except ResultsReadError as exc:
        raise MergeError(str(exc)) from None
    check_one_experiment(shares)
    of = shares[0].of
    if len(shares) < of and not accept_lost:
        have = sorted(s.index for s in shares)
        raise MergeError(f"shares {[i for i in range(of) if i not in have]} of {of} have no folder here: give every "
                         "share's folder, or --accept-lost to merge their requests as lost")
    try:
        duration = bool(Workload.model_validate(shares[0].info.get("workload") or {}).load.duration_s)
    except ValueError:
        raise MergeError(f"{shares[0].path}: run.json's workload does not read as a workload") from None
    order = list(dict.fromkeys(k for s in shares for k in s.order))
    joined = [merge_cell(key, shares, of, accept_lost, duration) for key in order]
    return _write(Path(into), shares, joined, command)


def _write(into: Path, shares: list[Share], joined: list[MergedCell], command: str) -> Merged:
    owner = shares[0]
    writer = RunWriter(into, mode="new")
    started = sorted(s.info.get("started_at") for s in shares if s.info.get("started_at"))
    finished = sorted(s.info.get("finished_at") for s in shares if s.info.get("finished_at"))
    info = {k: v for k, v in owner.info.items() if k not in ("harness_pid", "harness_host", "harness_started_at",
                                                            "invocations", "error", "finished_at")}
    info |= {"run_id": into.name, "command": command, "status": "running",
             "started_at": started[0] if started else None,
             "load_share": None, "merged_at": datetime.now(timezone.utc).isoformat(), "merged_on": socket.gethostname(),
             "merged_from": [{"folder": str(s.path), "run_id": s.info.get("run_id"), "share": s.index, "of": s.of,
                              "status": s.info.get("status"), "host": s.info.get("harness_host"),
                              "load_owner": s.info.get("load_owner")} for s in shares]}
    writer.write_run_info(info)
    for s in shares:  # the processes' own warm-ups, as they ran
        for row in s.warmups:
            writer.write_request(RequestRow.model_validate({**row, "run_id": into.name}))
    n_requests = n_lost = 0
    for cell in joined:
        for r in sorted(cell.requests, key=lambda r: r.ordinal):
            writer.write_request(request_row(into.name, cell.row.cell_id, cell.row.backend, r, repeat=cell.row.repeat))
        cell.row.run_id = into.name
        writer.write_cell(cell.row)
        n_requests += len(cell.requests)
        n_lost += cell.row.n_lost
    for part in ("timelines", "telemetry", "logs"):  # the owner's: its polls saw every share's load
        source = owner.path / part
        if source.is_dir():
            shutil.copytree(source, into / part, dirs_exist_ok=True)
    _logprobs(shares, into)
    writer.update_run_info(status="finished" if not n_lost else f"finished, {n_lost} requests lost",
                           finished_at=finished[-1] if finished else None)
    ensure_parquet(into)
    return Merged(into, shares, len(joined), n_requests, n_lost)


def _logprobs(shares: list[Share], into: Path) -> None:
    """A kv_quant run's per-request log-probabilities: every share's requests of each cell, in one file."""
    files: dict[str, list] = {}
    for s in shares:
        for path in sorted((s.path / "logprobs").glob("*.json")) if (s.path / "logprobs").is_dir() else []:
            files.setdefault(path.name, []).extend(json.loads(path.read_text()).get("requests", []))
    if files:
        (into / "logprobs").mkdir(exist_ok=True)
    for name, requests in files.items():
        (into / "logprobs" / name).write_text(json.dumps({"cell_id": name[:-5], "requests": requests},
                                                         separators=(",", ":")))
