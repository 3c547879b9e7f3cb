"""What ``kvbench merge`` (:mod:`kvbench.run.merge`) checks of the share folders it is given, before
anything is joined or written: that it reads each folder's own files and follows no link out of it (a record
file that is a link is refused), that the folders are shares 0..N-1 of one experiment, that ``--into`` is
neither inside a share nor above one, that each share's records account for its share of a cell (no ordinal
twice or of another share; torn lines counted), that the shares started every cell at one barrier on one
clock, and which requests belong to a cell no share wrote a row for. Every refusal is a :class:`MergeError`,
one line (exit 2).
"""
from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.backends.types import RequestResult
from kvbench.kv import bounded
from kvbench.load.split import MAX_SHARES
from kvbench.store.errors import ResultsReadError
from kvbench.store.readers import LOGPROBS_MAX_BYTES, load_run_info, not_a_run_dir, read_jsonl_rows
from kvbench.store.schema import CellRow, RequestRow, migrate_row
from kvbench.workloads import Workload


class MergeError(ValueError):
    """Folders that are not the shares of one experiment, or records that do not account for every request."""


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


def read_shares(folders: list[Path], into: Path, accept_lost: bool) -> list[Share]:
    """The share folders read and checked (in share order): given once each, ``into`` neither one of them,
    inside one nor above one, their files their own, one experiment's shares, every share there unless
    ``accept_lost``. MergeError (one line) otherwise."""
    if len(folders) < 1:
        raise MergeError("give the run folders of every load share")
    resolved = [Path(f).resolve() for f in folders]
    if len(set(resolved)) != len(resolved):
        raise MergeError("a folder is given twice")
    check_into(folders, resolved, into)
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
    return shares


def check_into(folders: list[Path], resolved: list[Path], into: Path) -> None:
    """``into`` (the merged run's new folder) is none of the share folders, inside none (the merged run
    would be copied into itself) and holds none (a share's parent): MergeError otherwise."""
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


def is_count(value) -> bool:
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
    if not isinstance(share, dict) or not is_count(share.get("index")) or not is_count(share.get("of")):
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


def accounted(s: Share, where: str, rows: list[dict], mine: set[int], sent: set[int] | None = None,
               counted: int | None = None) -> list[int]:
    """The ordinals of share ``s``'s request rows of a cell, each once and all of its share (``mine``; with a
    duration, of those its row counts: ``sent``), else MergeError naming them."""
    got = [r["ordinal"] for r in rows]
    if any(o is None for o in got):
        raise MergeError(f"{s.path}: {where} has requests without an ordinal (a run from before kvbench merge)")
    twice = sorted(o for o, n in Counter(got).items() if n > 1)
    stray = sorted(set(got) - mine)
    beyond = sorted(set(got) - sent - set(stray)) if sent is not None else []
    if twice or stray or beyond:
        what = "; ".join(p for p in (twice and f"ordinals {few(twice)} twice",
                                     stray and f"ordinals {few(stray)} not of its share",
                                     beyond and f"ordinals {few(beyond)} beyond the {counted} requests its "
                                                "row counts") if p)
        raise MergeError(f"{s.name}: {where}: {what}: its records do not account for its share")
    return got


def few(values: list[int]) -> str:
    return ", ".join(map(str, values[:5])) + (f" ... ({len(values)})" if len(values) > 5 else "")


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
    a word: a cell an hour long); a share that wrote no row for the cell, none sent before the earliest
    start."""
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
    with_rows = {s.index for s in present}
    if starts:  # a share that wrote no row for the cell (ended in it): its requests against the earliest start
        s0, t_first = min(starts.values(), key=lambda st: st[1])
        for index, mine in sorted(by_share.items()):
            early = [r for r in mine if r.t_sent < t_first - START_SPREAD_S] if index not in with_rows else []
            if early:
                raise MergeError(f"share {index}: {where}: request {early[0].request_id} was sent "
                                 f"{t_first - early[0].t_sent:,.0f} s before {s0.name} started the cell, on the "
                                 "owner's clock: its times are not on the run owner's clock")
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


def rowless_cells(shares: list[Share], cells: set[tuple[str, int]], accept_lost: bool) -> list[str]:
    """Requests of a cell no share wrote a row for (every share ended in it: the cell's requests planned
    and load are not known, so they cannot be accounted for): refused, or with ``accept_lost`` left out,
    a line each in the notes returned (they were silently dropped)."""
    cut: Counter = Counter()
    for s in shares:
        for key, rows in s.requests.items():
            if key not in cells:
                cut[key] += len(rows)
    what = [f"cell {cell_id}" + (f" (repeat {repeat})" if repeat else "") + f" ({n} requests)"
            for (cell_id, repeat), n in cut.items()]
    if what and not accept_lost:
        raise MergeError(f"requests of {', '.join(what[:3])}{' ...' if len(what) > 3 else ''} but no share's row "
                         "for the cell (every share ended in it): they cannot be accounted for; --accept-lost "
                         "merges the other cells and leaves them out")
    return [f"left out {w}: no share wrote the cell's row (every share ended in it)" for w in what]


def read_logprobs(shares: list[Share]) -> dict[str, list]:
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
