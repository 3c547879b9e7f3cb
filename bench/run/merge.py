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
import os
import shutil
import socket
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvbench.backends.types import RequestResult
from kvbench.load import LoadPoint, profile_class
from kvbench.load.common import LOST, LoadResult, is_lost
from kvbench.kv import bounded
from kvbench.load.split import MAX_SHARES
from kvbench.load.workers import in_flight_peak
from kvbench.common.metrics import percentiles
from kvbench.run.prefix_cache import cold_hit_flag, measured_hits
from kvbench.run.contract import lost_flag, request_figures
from kvbench.run.rows import request_row
from kvbench.store.errors import ResultsReadError
from kvbench.store.readers import LOGPROBS_MAX_BYTES, ensure_parquet, load_run_info, not_a_run_dir, read_jsonl_rows
from kvbench.store.schema import CellRow, RequestRow, migrate_row
from kvbench.store.writer import RunWriter
from kvbench.workloads import Workload


class MergeError(ValueError):
    """Folders that are not the shares of one experiment, or records that do not account for every request."""


#: A cell's planned requests kvbench merge accounts for (a list of ordinals per share): a cells.jsonl
#: claiming more is damaged, not read into memory.
MAX_REQUESTS_PLANNED = 10_000_000
#: How far apart, on the owner's clock, the shares may start one cell: each takes its start right after the
#: cell's ``:ready`` barrier (bench/run/measure.py), then a few calls to the engine (its counters, a cache
#: reset). Further apart, the folders did not run at one barrier (another run's share, or times shifted).
START_SPREAD_S = 60.0
#: The record files of a share, read (never through a link: kvbench merge reads only the folder given).
RECORDS = ("run.json", "cells.jsonl", "requests.jsonl")


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
    torn: dict[str, list[int]] = field(default_factory=dict)  # record file -> its damaged (torn) line numbers

    @property
    def name(self) -> str:
        return f"{self.path} (share {self.index} of {self.of})"


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def own_file(path: Path, folder: Path) -> None:
    """``path`` is the share folder's own file, not a link (to a file outside it, or back into the merged
    run): MergeError otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise MergeError(f"{path} is a symbolic link: kvbench merge reads a share folder's own files and follows "
                         f"no link out of {folder}")


def read_share(path: Path) -> Share:
    if problem := not_a_run_dir(path):
        raise MergeError(problem)
    for name in RECORDS:
        own_file(Path(path) / name, Path(path))
    info = load_run_info(path)
    share = info.get("load_share") or {"index": 0, "of": 1}
    if not isinstance(share, dict) or not _count(share.get("index")) or not _count(share.get("of")):
        raise MergeError(f"{path}: run.json's load_share is {str(share)[:100]}, not {{index, of}}")
    if not (0 < share["of"] <= MAX_SHARES and 0 <= share["index"] < share["of"]):
        raise MergeError(f"{path}: run.json's load_share is share {str(share['index'])[:30]} of "
                         f"{str(share['of'])[:30]}: not 0 <= index < of <= {MAX_SHARES}")
    out = Share(Path(path), info, share["index"], share["of"])
    cells, out.torn["cells.jsonl"] = read_jsonl_rows(Path(path) / "cells.jsonl")
    for raw in cells:
        row = _migrated(raw, CellRow, path, "cells.jsonl")
        if row["replica"]:
            raise MergeError(f"{path}: cell {row['cell_id']} is a deployment's replica row: kvbench merge joins "
                             "shares sent to one endpoint (a Kubernetes Service: -b ENGINE:url=...)")
        key = (row["cell_id"], row["repeat"])
        out.cells[key] = row
        out.order.append(key)
    requests, out.torn["requests.jsonl"] = read_jsonl_rows(Path(path) / "requests.jsonl")
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
    try:
        point = LoadPoint(row["load_profile"], row["concurrency"], row["request_rate"])
        split = profile_class(row["load_profile"]).shares(list(range(planned)), point, 0, of) if planned else []
    except (ValueError, TypeError, OverflowError) as exc:
        raise MergeError(f"cell {row['cell_id']}: its load ({row['load_profile']!r}, concurrency "
                         f"{row['concurrency']}, rate {row['request_rate']}) cannot be split again: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return [list(split[i][0]) if i < len(split) else [] for i in range(of)]


def merge_cell(key: tuple[str, int], shares: list[Share], of: int, accept_lost: bool, duration: bool) -> MergedCell:
    """One cell from every share's records (module docstring), or MergeError."""
    cell_id, repeat = key
    where = f"cell {cell_id}" + (f" (repeat {repeat})" if repeat else "")
    by_index = {s.index: s for s in shares}
    present = [s for s in shares if key in s.cells]
    base = dict(present[0].cells[key])
    planned = base["requests_planned"]
    if planned is None:
        raise MergeError(f"{present[0].path}: {where} recorded no requests_planned (a run from before kvbench "
                         "merge): its requests cannot be accounted for")
    if not 0 <= planned <= MAX_REQUESTS_PLANNED:
        raise MergeError(f"{present[0].path}: {where} records {planned} requests planned, not 0 to "
                         f"{MAX_REQUESTS_PLANNED:,} (a damaged cells.jsonl)")
    expected = expected_ordinals(base, of)
    results, seen, lost_by, gone = [], {}, [], []
    by_share: dict[int, list[RequestResult]] = {}  # each present share's requests (the clock checks)
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
        counted = s.cells[key]["n_requests"]
        # what the share sent: all of its share, or with a duration the first of them its row counts (a
        # share's profile sends its ordinals in order and stops taking them when the duration is up)
        sent = expected[index] if not duration else expected[index][:max(0, min(counted, len(mine)))]
        twice = sorted({o for o in got if got.count(o) > 1})
        stray = sorted(set(got) - mine)
        beyond = sorted(set(got) - set(sent) - set(stray)) if duration else []
        if twice or stray or beyond:
            what = "; ".join(p for p in (twice and f"ordinals {_few(twice)} twice",
                                         stray and f"ordinals {_few(stray)} not of its share",
                                         beyond and f"ordinals {_few(beyond)} beyond the {counted} requests its "
                                                    "row counts") if p)
            raise MergeError(f"{s.name}: {where}: {what}: its records do not account for its share")
        missing = sorted(set(sent) - set(got))
        if missing:  # a record deleted or torn (a duration-bound cell used to be merged "ok" without them)
            torn = s.torn.get("requests.jsonl") or []
            how = f"its row counts {counted} requests, requests.jsonl holds {len(got)}" + (
                f" and {len(torn)} torn line{'s' if len(torn) > 1 else ''} ({_few(torn)})" if torn else "")
            if not accept_lost:
                raise MergeError(f"{s.name}: {where}: ordinals {_few(missing)} of its share missing ({how}): its "
                                 "records do not account for its share; --accept-lost merges them as lost")
            gone.append((index, s, missing, how))
        for o, r in zip(got, rows):
            if o in seen:
                raise MergeError(f"{where}: ordinal {o} is in {seen[o].path} and {s.path}")
            seen[o] = s
            results.append(_result(r))
            by_share.setdefault(index, []).append(results[-1])
    check_clocks(where, key, present, by_share)
    if duration and lost_by:  # due within the duration: as far as the ordinals sent reach (schedules only grow)
        reach = max([*seen, *(o for _, _, ords, _ in gone for o in ords)], default=-1)
        lost_by = [(i, s, [o for o in ords if o <= reach]) for i, s, ords in lost_by]
    for index, s, ordinals in lost_by:
        process = f"share {index} ({s.path.name})" if s is not None else f"share {index} (no folder)"
        why = "ended before it finished this cell" if s is not None else "left no folder"
        for o in ordinals:
            results.append(_lost(o, cell_id, process, why))
    for index, s, ordinals, how in gone:
        for o in ordinals:
            results.append(_lost(o, cell_id, f"share {index} ({s.path.name})",
                                 f"has no record of it ({how}: a line deleted or torn)"))
    ordinals = sorted(r.ordinal for r in results)
    if not duration and ordinals != list(range(planned)):
        raise MergeError(f"{where}: the shares' ordinals are not 0..{planned - 1} once each")
    merged = MergedCell(_remade(base, present, results, of), results)
    if flag := wall_clock_flag(key, present):
        merged.row.flags.append(flag)
        merged.row.status = "flagged" if merged.row.status == "ok" else merged.row.status
    return merged


def _start_on_owner(s: Share, key: tuple[str, int], mine: list[RequestResult]) -> float | None:
    """Where share ``s`` took the cell's start (its row's ``t_cell_start``, on its own clock), on the owner's
    clock: moved by the offset its requests were moved by. None: not known (no request with an offset)."""
    start = s.cells[key]["t_cell_start"]
    offsets = [r.clock_offset_start_s for r in mine if r.clock_offset_start_s is not None]
    if start is None or not offsets:
        return None
    return start + offsets[0]


def check_clocks(where: str, key: tuple[str, int], present: list[Share],
                 by_share: dict[int, list[RequestResult]]) -> None:
    """The shares started the cell at one barrier on one clock: each share's start, put on the owner's clock
    with the offset its requests carry, within :data:`START_SPREAD_S` of the first share's, and none of its
    requests sent before it (shares of two runs, or a folder whose times were moved, were merged without
    a word: a cell an hour long)."""
    starts = {}
    for s in present:
        mine = by_share.get(s.index, [])
        start = _start_on_owner(s, key, mine)
        if start is None:
            continue
        starts[s.index] = (s, start)
        early = [r for r in mine if r.t_sent < start - START_SPREAD_S]
        if early:
            raise MergeError(f"{s.name}: {where}: request {early[0].request_id} was sent "
                             f"{start - early[0].t_sent:,.0f} s before the share started the cell, on the owner's "
                             "clock: its times are not on the run owner's clock")
    if len(starts) < 2:
        return
    first_index = min(starts)
    first, t0 = starts[first_index]
    for index, (s, start) in sorted(starts.items()):
        if abs(start - t0) > START_SPREAD_S:
            raise MergeError(f"{s.name} started {where} {start - t0:+,.0f} s from {first.name}, on the run owner's "
                             f"clock (more than {START_SPREAD_S:g} s): the shares of one run start every cell at "
                             "one barrier; these folders are not one run's, or their times were moved")


def wall_clock_flag(key: tuple[str, int], present: list[Share]) -> str:
    """A flag where the shares' wall clocks (each cell's start in Unix seconds, taken right after the cell's
    barrier) disagree by more than :data:`START_SPREAD_S`: the merged row's time of day is the first
    share's."""
    starts = [(s, s.cells[key]["t_cell_start_unix"]) for s in present if s.cells[key]["t_cell_start_unix"]]
    if len(starts) < 2:
        return ""
    (first, t0), *rest = starts
    worst = max(rest, key=lambda st: abs(st[1] - t0))
    if abs(worst[1] - t0) <= START_SPREAD_S:
        return ""
    return (f"load shares' wall clocks disagree: share {worst[0].index} started the cell {worst[1] - t0:+,.0f} s "
            f"from share {first.index} by its wall clock (the times of day are share {first.index}'s)")


def _few(values: list[int]) -> str:
    return ", ".join(map(str, values[:5])) + (f" ... ({len(values)})" if len(values) > 5 else "")


def _result(row: dict) -> RequestResult:
    r = RequestResult(row["request_id"], row["prompt_tokens_sent"], row["output_tokens_requested"], row["t_sent"],
                      list(row["chunk_times"]), list(row["chunk_tokens"]), row["t_done"], row["t_scheduled"],
                      prompt_tokens_reported=row["prompt_tokens_reported"],
                      prompt_tokens_cached=row["prompt_tokens_cached"],
                      output_tokens_reported=row["output_tokens_reported"],
                      spec_draft_tokens=row.get("spec_draft_tokens"), spec_accepted_tokens=row.get("spec_accepted_tokens"),
                      engine_details=dict(row["engine_details"] or {}), error=row["error"])
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
    notes: list[str] = field(default_factory=list)  # what was left out (links, special files), one line each


def merge(folders: list[Path], into: Path, accept_lost: bool = False, command: str = "") -> Merged:
    """Read, check and join ``folders`` into the new run folder ``into`` (nothing is written unless every
    cell accounts for every request). MergeError (one line) for folders that are not one experiment's shares."""
    if len(folders) < 1:
        raise MergeError("give the run folders of every load share")
    resolved = [Path(f).resolve() for f in folders]
    if len(set(resolved)) != len(resolved):
        raise MergeError("a folder is given twice")
    target = Path(into).resolve()
    for given, folder in zip(folders, resolved):
        if target == folder:
            raise MergeError(f"--into {into} is one of the folders merged: give a new folder")
        if folder in target.parents:  # the merged run would be copied into itself, or into a share
            raise MergeError(f"--into {into} is inside the share folder {given}: give a new folder outside the "
                             "folders merged")
        if target in folder.parents:
            raise MergeError(f"--into {into} holds the share folder {given}: give a new folder outside the folders "
                             "merged, not one of their parents")
    try:
        shares = sorted((read_share(Path(f)) for f in folders), key=lambda s: s.index)
    except ResultsReadError as exc:
        raise MergeError(str(exc)) from None
    except MergeError:
        raise
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:  # a row of the wrong kind
        raise MergeError(f"the share folders could not be read ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
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
    try:
        joined = [merge_cell(key, shares, of, accept_lost, duration) for key in order]
    except (ValueError, TypeError, KeyError, OverflowError, IndexError) as exc:
        if isinstance(exc, MergeError):
            raise
        raise MergeError(f"the shares' cells could not be merged ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    logprobs = _logprobs(shares)  # read (and refused) before anything is written
    return _write(Path(into), shares, joined, command, logprobs)


def _write(into: Path, shares: list[Share], joined: list[MergedCell], command: str,
           logprobs: dict[str, list]) -> Merged:
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
    notes: list[str] = []
    for part in ("timelines", "telemetry", "logs"):  # the owner's: its polls saw every share's load
        copy_own(owner.path / part, into / part, notes)
    if logprobs:
        (into / "logprobs").mkdir(exist_ok=True)
    for name, requests in logprobs.items():
        (into / "logprobs" / name).write_text(json.dumps({"cell_id": name[:-5], "requests": requests},
                                                         separators=(",", ":")))
    if notes:
        writer.update_run_info(merge_notes=notes)
    writer.update_run_info(status="finished" if not n_lost else f"finished, {n_lost} requests lost",
                           finished_at=finished[-1] if finished else None)
    ensure_parquet(into)
    return Merged(into, shares, len(joined), n_requests, n_lost, notes)


def copy_own(source: Path, dest: Path, notes: list[str]) -> None:
    """The regular files under ``source`` copied to ``dest``, following no symbolic link (shutil.copytree
    followed them: a link back to an ancestor copied the merged run into itself, a link to a file outside
    the share copied that file into the merged run); a link or a special file is left out, with a line in
    ``notes``."""
    try:
        mode = os.lstat(source).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        notes.append(f"left out {source}: {bounded.file_kind(mode)}, not a folder (kvbench merge copies a share "
                     "folder's own files and follows no link out of it)")
        return
    for folder, dirs, files in os.walk(source, followlinks=False):
        here = Path(folder)
        (dest / here.relative_to(source)).mkdir(parents=True, exist_ok=True)
        for name in sorted(dirs + files):
            path = here / name
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                continue  # os.walk goes into it (a link to a folder is no folder to lstat)
            if stat.S_ISREG(mode):
                shutil.copyfile(path, dest / path.relative_to(source), follow_symlinks=False)
            else:
                notes.append(f"left out {path}: {bounded.file_kind(mode)} (kvbench merge copies a share folder's "
                             "own files and follows no link out of it)")


def _logprobs(shares: list[Share]) -> dict[str, list]:
    """A kv_quant run's per-request log-probabilities: every share's requests of each cell, in one file
    each (read here, before anything is written; a link or a damaged file is refused)."""
    files: dict[str, list] = {}
    for s in shares:
        folder = s.path / "logprobs"
        own_file(folder, s.path)
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json")):
            own_file(path, s.path)
            try:
                data = bounded.read_json(path, LOGPROBS_MAX_BYTES, what="")
                requests = data.get("requests", []) if isinstance(data, dict) else None
                if not isinstance(requests, list):
                    raise bounded.InputError(f"{path}: not a cell's log-probabilities (no list of requests)")
            except (bounded.InputError, OSError) as exc:
                raise MergeError(str(exc).splitlines()[0]) from None
            files.setdefault(path.name, []).extend(requests)
    return files
