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
  is refused, or with ``--accept-lost`` taken with the requests it recorded kept (the cell flagged) and
  the rest of its share recorded as lost (``error`` "lost: ...", the cell's ``n_lost``, counted as
  failed): never dropped;
- every figure made of requests is computed again from the joined records (:func:`kvbench.run.rows.request_figures`:
  the token contract, latency percentiles, throughput, the load achieved, the most requests in flight); what
  the engine said during the cell (KV in use, its queue, its prefix-cache counters, the memory timeline) is
  share 0's, the owner's, whose polls saw the server under every share's load.

The merged run's folder has the run.json of share 0 with ``merged_from`` (each folder, its share, status
and host), cells.jsonl, requests.jsonl (every share's requests, the lost ones too), and share 0's timelines,
telemetry and logs. What is checked of the share folders before anything is joined (their own files, no
link followed; one experiment; ``--into``; the records and the clocks) is :mod:`kvbench.run.merge_checks`.
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
from kvbench.common.metrics import percentiles
from kvbench.kv import bounded
from kvbench.load import LoadPoint, profile_class
from kvbench.load.common import LOST, LoadResult, is_lost
from kvbench.load.workers import in_flight_peak
from kvbench.run.contract import lost_flag, request_figures
from kvbench.run.merge_checks import (MergeError, Share, accounted, check_clocks, few, is_count, read_logprobs,
                                      read_shares, rowless_cells, wall_clock_flag)
from kvbench.run.merge_checks import RECORDS, SAME, START_SPREAD_S, own_file  # noqa: F401 - importable here
from kvbench.run.merge_checks import check_one_experiment, read_share  # noqa: F401 - as before the split
from kvbench.run.prefix_cache import cold_hit_flag, measured_hits
from kvbench.run.rows import request_row
from kvbench.store.readers import ensure_parquet
from kvbench.store.schema import CellRow, RequestRow
from kvbench.store.writer import RunWriter
from kvbench.workloads import MAX_IN_FLIGHT, Workload


#: A cell's planned requests kvbench merge accounts for (a list of ordinals per share): a cells.jsonl
#: claiming more is damaged, not read into memory.
MAX_REQUESTS_PLANNED = 10_000_000


@dataclass
class MergedCell:
    row: CellRow
    requests: list[RequestResult]


def expected_ordinals(row: dict, of: int) -> list[list[int]]:
    """Each share's ordinals of a cell: the profile's split of ``range(requests_planned)`` over ``of`` shares
    (an empty list for a share the split leaves out)."""
    planned, concurrency = row["requests_planned"], row["concurrency"]
    # a closed loop's ordinals are dealt out stream by stream: 10^12 streams held kvbench merge for ever
    if is_count(concurrency) and concurrency > MAX_IN_FLIGHT:
        raise MergeError(f"cell {row['cell_id']}: its concurrency {concurrency:,} is more than a workload may give "
                         f"({MAX_IN_FLIGHT:,}; a damaged cells.jsonl): its split over the shares cannot be made again")
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
    results, seen, lost_by, gone, rowless = [], {}, [], [], []
    by_share: dict[int, list[RequestResult]] = {}  # each share's requests kept (the clock checks)

    def keep(s: Share, index: int, got: list[int], rows: list[dict]) -> None:
        for o, r in zip(got, rows):
            if o in seen:
                raise MergeError(f"{where}: ordinal {o} is in {seen[o].path} and {s.path}")
            seen[o] = s
            results.append(_result(r))
            by_share.setdefault(index, []).append(results[-1])

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
            rows = s.requests.get(key, []) if s is not None else []
            got = accounted(s, where, rows, mine) if rows else []
            keep(s, index, got, rows)  # what it recorded before it ended (its pod killed) is measured: kept
            lost_by.append((index, s, sorted(mine - set(got))))
            if got:
                rowless.append((s, len(got)))
            continue
        rows = s.requests.get(key, [])
        counted = s.cells[key]["n_requests"]
        # what the share sent: all of its share, or with a duration the first of them its row counts (a
        # share's profile sends its ordinals in order and stops taking them when the duration is up)
        sent = expected[index] if not duration else expected[index][:max(0, min(counted, len(mine)))]
        got = accounted(s, where, rows, mine, set(sent) if duration else None, counted)
        missing = sorted(set(sent) - set(got))
        if missing:  # a record deleted or torn (a duration-bound cell used to be merged "ok" without them)
            torn = s.torn.get("requests.jsonl") or []
            how = f"its row counts {counted} requests, requests.jsonl holds {len(got)}" + (
                f" and {len(torn)} torn line{'s' if len(torn) > 1 else ''} ({few(torn)})" if torn else "")
            if not accept_lost:
                raise MergeError(f"{s.name}: {where}: ordinals {few(missing)} of its share missing ({how}): its "
                                 "records do not account for its share; --accept-lost merges them as lost")
            gone.append((index, s, missing, how))
        keep(s, index, got, rows)
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
    flags = [f"load share {s.index} ({s.path.name}) wrote no row for this cell (its run: "
             f"{s.info.get('status', 'unknown')}): its {n} recorded requests are kept, what its row said is not known"
             for s, n in rowless]
    for flag in [*flags, wall_clock_flag(key, present)]:
        if flag:
            merged.row.flags.append(flag)
            merged.row.status = "flagged" if merged.row.status == "ok" else merged.row.status
    return merged


def _result(row: dict) -> RequestResult:
    r = RequestResult(row["request_id"], row["prompt_tokens_sent"], row["output_tokens_requested"], row["t_sent"],
                      list(row["chunk_times"]), list(row["chunk_tokens"]), row["t_done"], row["t_scheduled"],
                      prompt_tokens_reported=row["prompt_tokens_reported"],
                      prompt_tokens_cached=row["prompt_tokens_cached"],
                      output_tokens_reported=row["output_tokens_reported"],
                      spec_draft_tokens=row.get("spec_draft_tokens"),
                      spec_accepted_tokens=row.get("spec_accepted_tokens"),
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
    notes: list[str] = field(default_factory=list)  # what was left out (links, special files, cells), one line each


def merge(folders: list[Path], into: Path, accept_lost: bool = False, command: str = "") -> Merged:
    """Read, check and join ``folders`` into the new run folder ``into`` (nothing is written unless every
    cell accounts for every request). MergeError (one line) for folders that are not one experiment's shares."""
    shares = read_shares(folders, into, accept_lost)
    of = shares[0].of
    try:
        duration = bool(Workload.model_validate(shares[0].info.get("workload") or {}).load.duration_s)
    except ValueError:
        raise MergeError(f"{shares[0].path}: run.json's workload does not read as a workload") from None
    order = list(dict.fromkeys(k for s in shares for k in s.order))
    notes = rowless_cells(shares, set(order), accept_lost)
    if not order:
        raise MergeError("no share folder holds a cell's row (every share ended before its first cell was "
                         "written): nothing to merge")
    try:
        joined = [merge_cell(key, shares, of, accept_lost, duration) for key in order]
    except (ValueError, TypeError, KeyError, OverflowError, IndexError) as exc:
        if isinstance(exc, MergeError):
            raise
        raise MergeError(f"the shares' cells could not be merged ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    logprobs = read_logprobs(shares)  # read (and refused) before anything is written
    return _write(Path(into), shares, joined, command, logprobs, notes)


def _write(into: Path, shares: list[Share], joined: list[MergedCell], command: str,
           logprobs: dict[str, list], notes: list[str]) -> Merged:
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


