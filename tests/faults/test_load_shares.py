"""The fourth fault matrix, part A (docs/fault-matrix.md): load shares on several machines (``kvbench run
--load-share I/N --load-owner``, bench/load/owner.py) and ``kvbench merge`` (bench/run/merge.py) fed share
folders that lie. Two real shares (``kvbench run`` processes against the fake OpenAI server, a duration-bound
workload) are run once; each case edits a copy of their folders."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.load import LoadPoint, LoadSettings, owner, run_async
from kvbench.load.common import LoadShare
from kvbench.load.owner import LoadOwner, OwnerClient, OwnerError
from tests.fakes.openai_server import FakeOpenAI
from tests.helpers import REPO, kvbench_here

WORKLOAD = """name = "shares"
seed = 5
prompt_tokens = [32]
output_tokens = 4
warmup_requests = 0
[load]
profile = "concurrent"
concurrency = [2]
requests = 30
duration_s = 60
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shares(tmp_path_factory) -> Path:
    """exp/share-0 and exp/share-1: one cell of 30 requests (15 each), duration-bound."""
    tmp = tmp_path_factory.mktemp("shares")
    (tmp / "w.toml").write_text(WORKLOAD)
    port = free_port()
    with FakeOpenAI(token_delay_s=0.002) as fake:
        procs = [subprocess.Popen([sys.executable, "-m", "kvbench.cli", "run", "--workload", str(tmp / "w.toml"),
                                   "--model", "smollm2", "-b", f"openai:url={fake.url}", "--prompt-salt", "s",
                                   "--load-share", f"{i}/2", "--load-owner", f"127.0.0.1:{port}", "--results-dir",
                                   str(tmp / "exp"), "--run-id", f"share-{i}", "--no-report"], cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
                 for i in (0, 1)]
        outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return tmp / "exp"


def copied(shares: Path, dest: Path) -> Path:
    shutil.copytree(shares, dest, symlinks=True)
    for parquet in dest.rglob("*.parquet"):  # derived copies; the JSONL records are what is edited
        parquet.unlink()
    return dest


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def whole_rows(path: Path) -> list[dict]:
    """The rows of a record that are whole JSON objects (a torn line left out; none where the record is no
    regular file of its own)."""
    out = []
    if not regular(path):
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def write_rows(path: Path, data: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))


def refused(*args) -> str:
    done = kvbench_here(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def files_under(folder: Path, but: Path | None = None) -> dict[str, tuple]:
    """Every entry under ``folder`` (links not followed) with what it is and holds, ``but`` left out."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if but is not None and (path == but or but in path.parents):
            continue
        if path.is_symlink():
            out[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            out[str(path)] = ("file", path.read_bytes())
        else:
            out[str(path)] = ("other", path.stat().st_mode)
    return out


# --- share counts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("share, says", [
    ("0/12345678901234567890", "at most 1024 shares"),  # grew the owner to all the machine's memory
    ("0/2000", "at most 1024 shares"),
    ("0/5", "shares 2..4 would send nothing; give N <= 2"),  # each cell splits over 2 at most: waited 600 s
    ("3/4", "shares 2..3 would send nothing"),
])
def test_a_share_count_beyond_any_cell_is_one_line_and_exit_2(tmp_path, share, says):
    (tmp_path / "w.toml").write_text(WORKLOAD)
    line = refused("run", "--workload", tmp_path / "w.toml", "-b", "openai:url=http://127.0.0.1:9", "--prompt-salt",
                   "s", "--load-share", share, "--load-owner", "127.0.0.1:9", "--results-dir", tmp_path / "r")
    assert says in line and not (tmp_path / "r").exists()


def test_a_load_worker_count_beyond_a_machine_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "w.toml").write_text(WORKLOAD)
    line = refused("run", "--workload", tmp_path / "w.toml", "-b", "openai:url=http://127.0.0.1:9",
                   "--load-workers", "1000000", "--results-dir", tmp_path / "r")
    assert "--load-workers 1000000: at most 256 load processes" in line and not (tmp_path / "r").exists()


# --- the owner's barrier and clock -------------------------------------------------------------------------

def test_a_barrier_says_which_shares_it_waits_for_and_starts_without_them_at_its_deadline(monkeypatch):
    monkeypatch.setattr(owner, "SAY_EVERY_S", 0.3)
    said = []
    server = LoadOwner("127.0.0.1", 0, 3, barrier_timeout_s=1.2, say=said.append)
    try:
        t0 = time.monotonic()
        t_go = server.arrive("cell-a", 0)
        assert 1.2 <= time.monotonic() - t0 < 3 and t_go["missing"] == [1, 2]
    finally:
        server.close()
    assert any("cell-a: waiting for shares 1, 2 of 3" in line for line in said), said
    assert "cell-a: shares 1, 2 of 3 did not reach the start within 1.2 s: starting without them" in said[-1]


def test_a_share_started_before_its_owner_waits_for_it_then_gives_up_on_an_owner_gone(monkeypatch):
    """Pods start in any order: a share whose owner is not up yet (connection refused) tries again, saying so,
    until the owner answers (it used to fail every cell on the first refusal, and the owner then waited for
    it). Once reached, an owner that refuses connections has ended: given up on within its short deadline."""
    monkeypatch.setattr(owner, "SAY_EVERY_S", 0.3)
    monkeypatch.setattr(owner, "RECONNECT_DEADLINE_S", 1.0)
    port, said, started = free_port(), [], []

    def start_late():
        time.sleep(1.5)
        started.append(LoadOwner("127.0.0.1", port, 2))

    threading.Thread(target=start_late, daemon=True).start()
    client = OwnerClient(f"http://127.0.0.1:{port}", 1, 2, say=said.append)
    try:
        offset, rtt = client.offset()
        assert abs(offset) <= rtt < 0.5 and client.reached
        assert any(f"load share 1: waiting for the load owner at http://127.0.0.1:{port}" in s for s in said), said
        started[0].close()
        t0 = time.monotonic()
        with pytest.raises(OwnerError, match="did not answer /clock: no connection any more for 1 s"):
            client.offset()
        assert time.monotonic() - t0 < 5
    finally:
        client.close()
        for server in started:
            server.close()


class _OwnerThatDies:
    """An owner client whose owner answers the start and then is gone (killed mid-cell)."""

    def __init__(self):
        self.calls = 0

    def offset(self):
        self.calls += 1
        if self.calls > 1:
            raise OwnerError("the load owner at http://owner:7070 did not answer /clock: no connection any more")
        return 0.0, 0.0

    def arrive(self, key):
        return time.perf_counter() + 0.05, []


def test_the_owner_killed_mid_cell_keeps_this_shares_measured_requests(tmp_path):
    """The owner gone before the cell's end offset (its pod killed): this share's requests were dropped with
    the failed cell; now they are kept, on the owner's clock with the start's offset, and the cell says so."""
    from dataclasses import replace

    from kvbench.backends.openai.adapter import OpenAIBackend
    from kvbench.load.owner import run_share
    from tests.fakes.testkit import prompt, spec

    prompts = [replace(prompt(8, 3, f"r{i}"), ordinal=i) for i in range(8)]
    with FakeOpenAI(token_delay_s=0.002) as fake:
        backend = OpenAIBackend("v1", tmp_path, {"token_ids": True, "ignore_eos": True, "return_token_ids": True})
        backend.attach(spec(tmp_path), fake.url, timeout_s=5)
        share = LoadShare(1, 2, _OwnerThatDies(), "cell")
        load = run_async(run_share(backend, prompts, LoadPoint("concurrent", 2), LoadSettings(30.0, share=share)))
    assert sorted(r.ordinal for r in load.results) == [1, 3, 5, 7]  # share 1's half, every one measured
    assert all(r.error is None and r.clock_offset_end_s is None for r in load.results)
    assert load.notes and load.notes[0].startswith("the load owner stopped answering during the cell")


# --- kvbench merge: links, where it writes ---------------------------------------------------------------

def test_merge_follows_no_link_out_of_a_share_folder(shares, tmp_path):
    exp = copied(shares, tmp_path / "exp")
    outside = tmp_path / "outside.txt"
    outside.write_text("not the share's")
    (exp / "share-0" / "timelines" / "up").symlink_to("../..")  # copied the merged run into itself
    (exp / "share-0" / "logs").mkdir(exist_ok=True)
    (exp / "share-0" / "logs" / "x.log").symlink_to(outside)  # copied that file into the merged run
    os.mkfifo(exp / "share-0" / "logs" / "fifo")
    done = kvbench_here("merge", exp / "share-0", exp / "share-1", "--into", exp / "merged")
    assert done.returncode == 0, done.stderr
    warnings = done.stderr.strip().splitlines()
    assert len(warnings) == 3 and all(w.startswith("warning: left out ") for w in warnings), warnings
    assert "up: a symbolic link" in done.stderr and "x.log: a symbolic link" in done.stderr and "a FIFO" in done.stderr
    merged = exp / "merged"
    assert not (merged / "timelines" / "up").exists() and not (merged / "logs" / "x.log").exists()
    assert not any(p.is_symlink() for p in merged.rglob("*"))
    assert len(json.loads((merged / "run.json").read_text())["merge_notes"]) == 3
    # a record file that is a link is refused: its rows would be another folder's
    (exp / "share-1" / "requests.jsonl").unlink()
    (exp / "share-1" / "requests.jsonl").symlink_to(exp / "share-0" / "requests.jsonl")
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m2")
    assert "requests.jsonl is a symbolic link: kvbench merge reads a share folder's own files" in line
    assert not (tmp_path / "m2").exists()


@pytest.mark.parametrize("where", ["the shares' parent", "inside a share", "a share's grandparent"])
def test_merge_writes_nothing_inside_or_above_its_inputs(shares, tmp_path, where):
    exp = copied(shares, tmp_path / "exp")
    into = {"the shares' parent": exp, "inside a share": exp / "share-0" / "sub",
            "a share's grandparent": tmp_path}[where]
    before = files_under(tmp_path)
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", into)
    assert ("is inside the share folder" if where == "inside a share" else "holds the share folder") in line
    assert files_under(tmp_path) == before


# --- kvbench merge: records that fall short, clocks apart ------------------------------------------------

@pytest.mark.parametrize("how", ["deleted", "torn"])
def test_a_deleted_or_torn_request_line_of_a_duration_cell_is_refused_or_merged_lost(shares, tmp_path, how):
    """29 of 30 requests used to merge "ok" without a word: a duration-bound cell allowed missing ordinals."""
    exp = copied(shares, tmp_path / "exp")
    path = exp / "share-1" / "requests.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    if how == "deleted":
        del lines[4]
    else:
        lines[-1] = lines[-1][:40]
    path.write_text("".join(lines))
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m")
    assert "of its share missing (its row counts 15 requests, requests.jsonl holds 14" in line
    assert ("torn line" in line) == (how == "torn") and "--accept-lost merges them as lost" in line
    done = kvbench_here("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m", "--accept-lost")
    assert done.returncode == 0, done.stderr
    (cell,) = rows(tmp_path / "m" / "cells.jsonl")
    assert (cell["n_requests"], cell["n_ok"], cell["n_lost"], cell["status"]) == (30, 29, 1, "flagged")
    assert "a line deleted or torn" in cell["flags"][0]


def test_a_share_that_wrote_no_row_for_a_cell_keeps_the_requests_it_recorded(shares, tmp_path):
    """A share's pod killed after its requests were written but before the cell's row: with --accept-lost its
    recorded requests were turned into lost ones (and, the cell duration-bound, the last dropped outright); now
    they are kept as measured and the cell is flagged, saying which share wrote no row."""
    exp = copied(shares, tmp_path / "exp")
    write_rows(exp / "share-1" / "cells.jsonl", [])
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m")
    assert "has no row for it" in line and "--accept-lost merges them as lost" in line
    done = kvbench_here("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m", "--accept-lost")
    assert done.returncode == 0, done.stderr
    (cell,) = rows(tmp_path / "m" / "cells.jsonl")
    assert (cell["n_requests"], cell["n_ok"], cell["n_lost"], cell["status"]) == (30, 30, 0, "flagged")
    assert any(f.startswith("load share 1 (share-1) wrote no row for this cell") and "15 recorded requests are kept"
               in f for f in cell["flags"]), cell["flags"]
    merged = rows(tmp_path / "m" / "requests.jsonl")
    assert sorted(r["ordinal"] for r in merged if not r["warmup"]) == list(range(30))


def test_requests_of_a_cell_no_share_wrote_a_row_for_are_refused_or_left_out_and_said(shares, tmp_path):
    """Every share ended in a cell (no row anywhere): its requests cannot be accounted for (how many were
    planned, at what load, is not known). They were dropped without a word; now refused, or with --accept-lost
    left out with a warning and a line in run.json's merge_notes."""
    exp = copied(shares, tmp_path / "exp")
    for share in ("share-0", "share-1"):  # a second cell, cut off in every share: its requests, no row
        path = exp / share / "requests.jsonl"
        write_rows(path, rows(path) + [{**r, "cell_id": "cut-off"} for r in rows(path) if not r["warmup"]])
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m")
    assert "requests of cell cut-off (30 requests) but no share's row for the cell" in line
    assert "--accept-lost merges the other cells and leaves them out" in line
    done = kvbench_here("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m", "--accept-lost")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ("warning: left out cell cut-off (30 requests): no share wrote the cell's row "
                                   "(every share ended in it)")
    assert [c["n_requests"] for c in rows(tmp_path / "m" / "cells.jsonl")] == [30]
    assert json.loads((tmp_path / "m" / "run.json").read_text())["merge_notes"] == [done.stderr.strip()[9:]]
    for share in ("share-0", "share-1"):  # with no row in any share at all, nothing is merged
        write_rows(exp / share / "cells.jsonl", [])
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m2", "--accept-lost")
    assert "no share folder holds a cell's row" in line and not (tmp_path / "m2").exists()


def test_a_cell_row_of_10_12_streams_is_refused_not_dealt_out(shares, tmp_path):
    """A cells.jsonl claiming 10^12 closed-loop streams: the split was made again stream by stream and held
    kvbench merge for ever (found by the property test below); now one line, at once."""
    exp = copied(shares, tmp_path / "exp")
    cells = rows(exp / "share-0" / "cells.jsonl")
    cells[0]["concurrency"] = 10**12
    write_rows(exp / "share-0" / "cells.jsonl", cells)
    t0 = time.monotonic()
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m", "--accept-lost")
    assert "its concurrency 1,000,000,000,000 is more than a workload may give (100,000" in line
    assert time.monotonic() - t0 < 30


def shifted(share: Path, by: float, unix_only: bool = False) -> None:
    """Every time a share recorded moved by ``by`` seconds (its wall clock only: ``unix_only``)."""
    cells = rows(share / "cells.jsonl")
    for c in cells:
        c["t_cell_start_unix"] += by
        if not unix_only:
            c["t_cell_start"] += by
    write_rows(share / "cells.jsonl", cells)
    if unix_only:
        return
    requests = rows(share / "requests.jsonl")
    for r in requests:
        for key in ("t_sent", "t_done", "t_scheduled"):
            if r[key] is not None:
                r[key] += by
        r["chunk_times"] = [t + by for t in r["chunk_times"]]
    write_rows(share / "requests.jsonl", requests)


def test_shares_an_hour_apart_on_the_owners_clock_are_refused_and_wall_clocks_apart_flagged(shares, tmp_path):
    """Merged without a word before: a cell an hour long (wall_s 3,600 s, a rate 1/1,000 of the real one)."""
    exp = copied(shares, tmp_path / "exp")
    shifted(exp / "share-1", 3600.0)
    line = refused("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m")
    assert "started cell" in line and "+3,600 s from" in line and "on the run owner's clock" in line
    exp = copied(shares, tmp_path / "exp2")
    shifted(exp / "share-1", 3600.0, unix_only=True)  # a pod whose wall clock is an hour off: times of day only
    done = kvbench_here("merge", exp / "share-0", exp / "share-1", "--into", tmp_path / "m2")
    assert done.returncode == 0, done.stderr
    (cell,) = rows(tmp_path / "m2" / "cells.jsonl")
    assert cell["status"] == "flagged" and cell["n_requests"] == 30
    assert any(f.startswith("load shares' wall clocks disagree: share 1 started the cell +3,600 s") for f in
               cell["flags"]), cell["flags"]


# --- kvbench merge: hostile share folders, generated -------------------------------------------------------

FIELDS = {  # (file, field) -> hostile values
    ("cells.jsonl", "requests_planned"): [10**15, -1, "x", None, 0],
    ("cells.jsonl", "n_requests"): [10**15, -1, 0, 1000],
    ("cells.jsonl", "concurrency"): [0, 10**12, -3, "c"],
    ("cells.jsonl", "t_cell_start"): [1e300, -1e9, 3600.0],
    ("requests.jsonl", "ordinal"): [10**12, -1, 0, "o"],
    ("requests.jsonl", "t_sent"): [-1e9, 1e300, "t"],
    ("run.json", "load_share"): [{"index": 0, "of": 10**20}, {"index": -1, "of": 2}, {"index": 5, "of": 2},
                                 "0/2", {"index": True, "of": 2}, None],
}
EDITS = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(sorted(FIELDS, key=str)), st.integers(0, 10), st.integers(0, 40)),
    st.tuples(st.just("drop line"), st.sampled_from(["cells.jsonl", "requests.jsonl"]), st.integers(0, 40)),
    st.tuples(st.just("tear line"), st.sampled_from(["cells.jsonl", "requests.jsonl"]), st.integers(0, 40),
              st.integers(1, 60)),
    st.tuples(st.just("twice"), st.integers(0, 40)),
    st.tuples(st.just("link"), st.sampled_from(["timelines/up", "logs/out.log", "requests.jsonl", "timelines",
                                                "logprobs/c.json"]), st.sampled_from(["ancestor", "outside"])),
    st.tuples(st.just("fifo"), st.sampled_from(["logs/f", "telemetry/f", "logprobs/f.json", "cells.jsonl"])),
    st.tuples(st.just("logprobs"), st.sampled_from(['{"requests": 3}', "[", '{"requests": []}' * 2, "x" * 10])),
)


def regular(path: Path) -> bool:
    """``path`` is a regular file of its own (an earlier edit may have made it a link or a FIFO: reading
    through those would read another file, or wait for ever)."""
    return os.path.lexists(path) and stat.S_ISREG(os.lstat(path).st_mode)


def through_a_link(share: Path, path: Path) -> bool:
    """A folder between ``share`` and ``path`` is a link (an earlier edit's): an edit there would write
    outside the share."""
    return any(p.is_symlink() for p in path.parents if share in p.parents)


def edit(share: Path, change: tuple, tmp: Path) -> None:
    """One hostile change to a share folder; a change an earlier one made meaningless (a record file now a
    link or a FIFO, a folder now a link) is left out, so that no edit writes outside the share."""
    kind = change[0]
    if kind == "field":
        _, (name, key), value_i, line_i = change
        values = FIELDS[(name, key)]
        value = values[value_i % len(values)]
        if not regular(share / name):
            return
        if name == "run.json":
            info = json.loads((share / name).read_text())
            info[key] = value
            (share / name).write_text(json.dumps(info))
            return
        lines = (share / name).read_text().splitlines(keepends=True)
        whole = [i for i, line in enumerate(lines) if is_row(line)]  # a torn line (an earlier edit's) kept as is
        if whole:
            i = whole[line_i % len(whole)]
            lines[i] = json.dumps({**json.loads(lines[i]), key: value}) + "\n"
            (share / name).write_text("".join(lines))
    elif kind in ("drop line", "tear line"):
        path = share / change[1]
        if not regular(path):
            return
        lines = path.read_text().splitlines(keepends=True)
        if lines:
            i = change[2] % len(lines)
            if kind == "drop line":
                del lines[i]
            else:
                lines[i] = lines[i][:change[3]]
            path.write_text("".join(lines))
    elif kind == "twice":
        if not regular(share / "requests.jsonl"):
            return
        lines = (share / "requests.jsonl").read_text().splitlines(keepends=True)
        if lines:
            (share / "requests.jsonl").write_text("".join(lines + [lines[change[1] % len(lines)]]))
    elif kind == "link":
        path = share / change[1]
        if through_a_link(share, path):
            return
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(share.parent.parent if change[2] == "ancestor" else tmp / "outside.txt")
    elif kind == "fifo":
        path = share / change[1]
        if through_a_link(share, path):
            return
        if os.path.lexists(path):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    elif kind == "logprobs":
        path = share / "logprobs" / "c.json"
        if through_a_link(share, path):
            return
        path.parent.mkdir(exist_ok=True)
        if os.path.lexists(path):  # a link or a FIFO an earlier edit left there: replaced, not written through
            path.unlink()
        path.write_text(change[1])


def is_row(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(changes=st.lists(st.tuples(st.integers(0, 1), EDITS), min_size=1, max_size=3),
       into=st.sampled_from(["new", "parent", "inside"]))
def test_hostile_share_folders_are_one_line_or_a_complete_flagged_merge(shares, changes, into):
    """Whatever the share folders hold, merge answers one line and exit 2, or a merge that accounts for
    every request (each ordinal of the cell once, the missing ones recorded lost and flagged, every one a share
    recorded kept; a cell no share wrote a row for left out with a warning); it writes nothing outside its
    output folder, never through a link, and never hangs on a FIFO."""
    tmp = Path(tempfile.mkdtemp(prefix="merge-hostile-"))
    try:
        (tmp / "outside.txt").write_text("outside")
        exp = copied(shares, tmp / "exp")
        for index, change in changes:
            edit(exp / f"share-{index}", change, tmp)
        target = {"new": tmp / "merged", "parent": exp, "inside": exp / "share-1" / "m"}[into]
        before = files_under(tmp, but=tmp / "merged")
        done = kvbench_here("merge", exp / "share-0", exp / "share-1", "--into", target, "--accept-lost")
        assert files_under(tmp, but=tmp / "merged") == before  # nothing written outside the output folder
        if done.returncode == 2:
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
            assert not (tmp / "merged").exists()
            return
        assert done.returncode == 0 and into == "new", done.stdout + done.stderr
        merged = tmp / "merged"
        assert not any(p.is_symlink() for p in merged.rglob("*"))
        assert "outside" not in [p.read_text(errors="replace") for p in merged.rglob("*") if p.is_file()]
        cells = rows(merged / "cells.jsonl")
        recorded = [r for s in ("share-0", "share-1") for r in whole_rows(exp / s / "requests.jsonl")
                    if not r.get("warmup")]
        for r in recorded:  # a cell no share wrote a row for is left out, and said so
            if r.get("cell_id") not in {c["cell_id"] for c in cells}:
                assert f"warning: left out cell {r['cell_id']}" in done.stderr, done.stderr
        for cell in cells:
            requests = [r for r in rows(merged / "requests.jsonl") if r["cell_id"] == cell["cell_id"]
                        and not r["warmup"]]
            ordinals = sorted(r["ordinal"] for r in requests)
            assert ordinals == sorted(set(ordinals)) and cell["n_requests"] == len(requests)
            assert cell["n_lost"] == sum(1 for r in requests if (r["error"] or "").startswith("lost: "))
            if cell["n_lost"]:
                assert cell["status"] == "flagged"
            kept = {r["ordinal"] for r in recorded if r.get("cell_id") == cell["cell_id"]
                    and isinstance(r.get("ordinal"), int)}
            assert kept <= set(ordinals)  # nothing a share recorded is lost in the merge
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
