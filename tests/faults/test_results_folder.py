"""The results folder under faults (issue 12): a full disk, a read-only folder, a torn last line, a corrupt
Parquet copy, reused run ids, run ids and workload names that are paths, a killed harness.

Full disk and read-only folders are real: a small tmpfs mounted for the test (the sandbox runs as root;
``chmod 0555`` does not stop root, so read-only is ``mount -o remount,ro``). Where ``mount`` is not
permitted (not root) those tests skip, saying so (-rs prints it), and the monkeypatched ones below still run
(they say so in their docstrings). CI runs as root: a skip there fails .ci/run (tests/expected_skips.txt).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.common.files import PlainNameError, append_line, atomic_write_text, check_plain_name
from kvbench.store.errors import (
    DamagedLinesWarning,
    ResultsReadError,
    ResultsWarning,
    ResultsWriteError,
    RunExistsError,
    RunFolderError,
)
from kvbench.store.readers import load, load_cells, load_run_info, parquet_is_current, write_parquet
from kvbench.store.writer import HARNESS_GONE, RunWriter, run_status
from kvbench.workloads import WorkloadError
from kvbench.workloads import load as load_workload

from tests.synth import make_run
from tests.store.test_writer import cell

INFO = {"run_id": "r1", "status": "running", "command": "kvbench run first", "started_at": "2026-12-01T10:00:00+00:00",
        "environment": {"cpu": "Test CPU", "cpu_count": 2, "memory_bytes": 2**34, "gpus": []},
        "model": {"name": "smollm2", "sha256": "ab" * 32, "max_context": 8192}, "workload": {"name": "w", "seed": 1}}
TINY = 'name = "{name}"\nseed = 3\nprompt_tokens = [64]\noutput_tokens = 8\nconcurrency = [1]\n'


def kvbench(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def request(cell_id: str, i: int = 0, warmup: bool = False) -> "RequestRow":  # noqa: F821
    from kvbench.store.schema import RequestRow

    return RequestRow(run_id="r1", cell_id=cell_id, backend="vllm-0.32.0", request_id=f"q{i}", warmup=warmup,
                      prompt_tokens_sent=8, prompt_tokens_reported=8, output_tokens_requested=2,
                      output_tokens_received=2, output_tokens_reported=2, t_sent=1.0, t_done=1.2,
                      chunk_times=[1.1, 1.2], chunk_tokens=[1, 1], ttft_s=0.1, e2e_s=0.2, error=None)


def tear(path: Path, fragment: bytes = b'{"schema_version": 3, "run_id": "r1", "cell_id": "half') -> None:
    """Append what a crash mid-append leaves: a line cut short, no newline."""
    with path.open("ab") as f:
        f.write(fragment)


def files_of(folder: Path, files_only: bool = False) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` (or every file) with its size and mtime."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file() or not files_only}


# --- a real small filesystem --------------------------------------------------------------------------

def mount_tmpfs(mount_point: Path, size: str, request) -> Path:
    """A tmpfs of ``size`` at ``mount_point``, unmounted after the test (skipped where mount is not permitted)."""
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode:
        # printed by -rs; on CI (root) this does not fire, and .ci/run fails if it does (not an expected skip)
        pytest.skip(f"real-disk test: cannot mount a tmpfs as uid {os.getuid()} (mount needs root; CI runs as root): "
                    f"{done.stderr.strip() or f'mount exited {done.returncode}'}; the monkeypatched tests cover the logic")
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(mount_point)], check=False))
    return mount_point


@pytest.fixture
def small_fs(tmp_path, request):
    """A 256 KiB tmpfs mounted for the test."""
    return mount_tmpfs(tmp_path / "fs", "256k", request)


def remount_read_only(mount_point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)


def fill(folder: Path) -> Path:
    """Write a filler file until the filesystem says ENOSPC; returns it (delete it to free the space)."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_full_disk_a_failed_append_leaves_no_partial_line_and_the_run_goes_on_once_space_is_back(small_fs):
    """Real tmpfs filled to the last page: the cell row is larger than the room left in cells.jsonl's last
    page, so the kernel takes part of the line, then refuses the rest."""
    writer = RunWriter(small_fs / "r1")
    writer.write_run_info(INFO)
    writer.write_cell(cell(cell_id="c1"))
    before = (writer.root / "cells.jsonl").read_bytes()
    filler = fill(small_fs)
    with pytest.raises(ResultsWriteError) as caught:
        writer.write_cell(cell(cell_id="c2", error="x" * 6000))  # longer than one page: cannot fit
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value) == (f"results folder {writer.root}: no space left on device (writing cells.jsonl); "
                                 "everything written before is intact")
    assert (writer.root / "cells.jsonl").read_bytes() == before  # cut back: no partial line
    assert writer.failed is caught.value
    filler.unlink()
    writer.write_cell(cell(cell_id="c3"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResultsWarning)  # not one damaged line
        assert list(load_cells(writer.root).cell_id) == ["c1", "c3"]
    assert writer.failed is caught.value  # the first error is kept


def test_full_disk_leaves_run_json_and_timelines_whole(small_fs):
    """Real tmpfs: the rewrite of run.json (and of a timeline) fails; the old file stays, no temp file."""
    import pandas as pd

    writer = RunWriter(small_fs / "r1")
    writer.write_run_info({**INFO, "notes": "n" * 20000})  # bigger than the room a page leaves
    writer.write_timeline("c1", pd.DataFrame({"t": [0.0, 0.1], "rss": [1, 2]}))
    run_json = (writer.root / "run.json").read_bytes()
    timeline = (writer.root / "timelines" / "c1.csv").read_bytes()
    fill(small_fs)
    with pytest.raises(ResultsWriteError, match=r"no space left on device \(writing run.json\)"):
        writer.update_run_info(status="finished", more="m" * 20000)
    with pytest.raises(ResultsWriteError, match=r"no space left on device \(writing timelines/c1.csv\)"):
        writer.write_timeline("c1", pd.DataFrame({"t": [0.0] * 5000}))
    assert (writer.root / "run.json").read_bytes() == run_json
    assert load_run_info(writer.root)["status"] == "running"
    assert (writer.root / "timelines" / "c1.csv").read_bytes() == timeline
    assert not [p for p in writer.root.rglob("*.tmp")]


def test_read_only_results_dir_is_one_clear_error(small_fs):
    """Real read-only mount (root ignores chmod): a new run folder, an append and the CLI."""
    old = RunWriter(small_fs / "old")
    old.write_run_info(INFO)
    remount_read_only(small_fs)
    with pytest.raises(ResultsWriteError, match=rf"results folder {small_fs / 'new'}: read-only file system "
                                                r"\(creating the run folder\)$"):
        RunWriter(small_fs / "new")
    with pytest.raises(ResultsWriteError, match=r"read-only file system \(writing cells.jsonl\); everything"):
        old.write_cell(cell())
    (small_fs.parent / "tiny.toml").write_text(TINY.format(name="tiny"))
    out = kvbench("run", "-b", "hf", "--workload", small_fs.parent / "tiny.toml", "--results-dir", small_fs / "runs",
                  "--run-id", "r")
    assert out.exit_code == 1, out.output
    assert f"error: results folder {small_fs / 'runs' / 'r'}: read-only file system (creating the run folder)" \
        in out.output
    assert "Traceback" not in out.output and isinstance(out.exception, SystemExit)


def test_a_run_stopped_by_a_full_disk_prints_the_first_error_once(small_fs, tmp_path, monkeypatch):
    """Real tmpfs, full during the run; the run itself is monkeypatched (Runner.run writes a cell onto the
    full disk, then tries run.json as a runner's cleanup would): no engine, the command's handling only."""
    from kvbench.run.runner import Runner

    def run_onto_a_full_disk(self):
        self.writer.write_run_info(INFO)
        self.writer.write_cell(cell(cell_id="c1"))
        fill(small_fs)
        try:
            self.writer.write_cell(cell(cell_id="c2", error="x" * 6000))
        finally:
            try:
                self.writer.update_run_info(status="x" * 20000)  # a second error on the way out
            except ResultsWriteError:
                pass

    monkeypatch.setattr(Runner, "run", run_onto_a_full_disk)
    (tmp_path / "tiny.toml").write_text(TINY.format(name="tiny"))
    out = kvbench("run", "-b", "hf", "--workload", tmp_path / "tiny.toml", "--results-dir", small_fs, "--run-id", "r")
    assert out.exit_code == 1, out.output
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert lines == [f"error: results folder {small_fs / 'r'}: no space left on device (writing cells.jsonl); "
                     "everything written before is intact"]
    assert list(load_cells(small_fs / "r").cell_id) == ["c1"]
    assert load_run_info(small_fs / "r")["status"] == "running"  # whole, as last written


def test_report_to_elsewhere_reads_a_read_only_run_and_writes_only_there(small_fs, tmp_path):
    """Real read-only mount holding the run: `kvbench report RUN -o OUT` needs nothing written into it."""
    run = make_run(small_fs, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    remount_read_only(small_fs)
    out = kvbench("report", run, "-o", tmp_path / "out" / "report.md", "--raw")
    assert out.exit_code == 0, out.output
    assert (tmp_path / "out" / "report.md").read_text().startswith("# kvbench run a")
    assert (tmp_path / "out" / "report.html").exists()
    assert (tmp_path / "out" / "plots" / "kv_vs_context.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in (tmp_path / "out").rglob("*") if ".tmp" in p.name]  # plots renamed into place


def test_a_report_onto_a_full_disk_keeps_the_previous_one(tmp_path, request):
    """Real tmpfs (4 MiB: a report with its plots): the second report of the run does not fit; the first
    stays whole."""
    small_fs = mount_tmpfs(tmp_path / "fs", "4m", request)
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    out = kvbench("report", run, "-o", small_fs / "report.md", "--raw")
    assert out.exit_code == 0, out.output
    before = files_of(small_fs, files_only=True)
    fill(small_fs)
    (run / "cells.jsonl").write_text((run / "cells.jsonl").read_text().replace('"error":null', '"error":"' + "e" * 9000 + '"'))
    out = kvbench("report", run, "-o", small_fs / "report.md", "--raw")
    assert out.exit_code == 1, out.output
    assert f"error: report folder {small_fs}: no space left on device (writing the report)" in out.output
    assert "Traceback" not in out.output
    (small_fs / "filler").unlink()
    assert files_of(small_fs, files_only=True) == before  # report.md, report.html and the plots as they were; no temp file


def test_report_to_elsewhere_leaves_the_run_folder_untouched(tmp_path):
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    before = files_of(run)
    out = kvbench("report", run, "-o", tmp_path / "elsewhere" / "r.md", "--no-plots", "--raw")
    assert out.exit_code == 0, out.output
    assert files_of(run) == before  # no Parquet copy, no report, no plots in the run folder
    assert (tmp_path / "elsewhere" / "r.md").exists()


# --- the same faults, monkeypatched (always run) ----------------------------------------------------

def test_permission_denied_on_append_is_the_same_error_and_leaves_the_file(tmp_path, monkeypatch):
    """Monkeypatched os.write raising EACCES (root cannot be denied a write for real)."""
    writer = RunWriter(tmp_path / "r1")
    writer.write_cell(cell(cell_id="c1"))
    before = (writer.root / "cells.jsonl").read_bytes()

    def denied(fd, data):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "write", denied)
    with pytest.raises(ResultsWriteError, match=r"permission denied \(writing cells.jsonl\)") as caught:
        writer.write_cell(cell(cell_id="c2"))
    assert caught.value.errno == errno.EACCES and isinstance(caught.value, OSError)
    monkeypatch.undo()
    assert (writer.root / "cells.jsonl").read_bytes() == before


def test_a_short_write_is_cut_back(tmp_path, monkeypatch):
    """Monkeypatched os.write: the first call takes 10 bytes, the next says ENOSPC (what a filling disk does)."""
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n')
    real_write, calls = os.write, []

    def filling(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", filling)
    with pytest.raises(OSError, match="No space left"):
        append_line(path, json.dumps({"b": "y" * 50}))
    monkeypatch.undo()
    assert path.read_text() == '{"a": 1}\n' and len(calls) == 2


def test_atomic_write_keeps_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text("old")
    path.chmod(0o640)

    def broken(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write_text(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["run.json"]
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640  # permissions kept


# --- torn lines and a corrupt Parquet copy ------------------------------------------------------------

def test_a_torn_last_line_is_skipped_counted_and_said(tmp_path):
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024, 2048), concurrency=(1,), n_requests=3)
    tear(run / "cells.jsonl")
    tear(run / "requests.jsonl")
    with pytest.warns(DamagedLinesWarning, match=r"cells.jsonl: 1 damaged line skipped \(line 3: ") as caught:
        cells = load(run)
    assert len(cells) == 2 and cells.attrs["damaged_lines"] == {str(run / "cells.jsonl"): [3]}
    assert caught[0].message.lines == [3]
    with pytest.warns(DamagedLinesWarning, match="requests.jsonl: 1 damaged line skipped"):
        assert len(load(run, what="requests")) == 6
    with pytest.warns(DamagedLinesWarning):
        assert len(load_cells(run)) == 2
    # the Parquet copy made from it still says so when read
    with pytest.warns(DamagedLinesWarning):
        write_parquet(run)
    with pytest.warns(DamagedLinesWarning, match=r"cells.jsonl: 1 damaged line skipped \(line 3"):
        assert parquet_is_current(run) and len(load(run)) == 2


def test_the_report_names_the_damaged_line(tmp_path):
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    tear(run / "cells.jsonl")
    out = kvbench("report", run, "--no-plots", "--raw")
    assert out.exit_code == 0, out.output
    assert f"warning: {run}/cells.jsonl: 1 damaged line skipped (line 2" in out.output
    text = (run / "report.md").read_text()
    assert "cells.jsonl: 1 damaged line skipped (line 2: not a whole JSON row" in text
    assert "| vllm-0.31.0 | 1024 |" in text


def test_an_append_after_a_torn_line_stays_whole(tmp_path):
    writer = RunWriter(tmp_path / "r1")
    writer.write_cell(cell(cell_id="c1"))
    tear(writer.root / "cells.jsonl")
    writer.write_cell(cell(cell_id="c2"))
    with pytest.warns(DamagedLinesWarning, match=r"line 2:"):
        assert list(load_cells(writer.root).cell_id) == ["c1", "c2"]


def test_a_row_of_the_wrong_shape_is_a_clear_error_naming_the_line(tmp_path):
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    with (run / "cells.jsonl").open("a") as f:
        f.write('{"run_id": "a", "cell_id": "odd"}\n')
    with pytest.raises(ResultsReadError, match=rf"^{run}/cells.jsonl line 2: cell_id|{run}/cells.jsonl line 2: "):
        load(run)


def test_a_corrupt_parquet_copy_is_never_preferred_to_the_jsonl(tmp_path):
    import pyarrow.parquet as pq

    run = make_run(tmp_path, "a", repeats=1, prompts=(1024, 2048), concurrency=(1,), n_requests=2)
    from_jsonl = load(run)
    write_parquet(run)
    # one flipped byte inside the data of the ttft_s_p50 column: the page checksum catches it
    data = bytearray((run / "cells.parquet").read_bytes())
    group = pq.read_metadata(run / "cells.parquet").row_group(0)
    column = next(group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema == "ttft_s_p50")
    start = min(column.data_page_offset, column.dictionary_page_offset or column.data_page_offset)
    data[start + column.total_compressed_size - 4] ^= 0xFF  # in the last page's values
    (run / "cells.parquet").write_bytes(bytes(data))
    assert parquet_is_current(run)  # its footer still reads
    with pytest.warns(ResultsWarning, match=r"cells.parquet: unreadable .*; read cells.jsonl instead"):
        cells = load(run)
    assert cells.ttft_s_p50.tolist() == from_jsonl.ttft_s_p50.tolist()
    # garbage from the first byte: not current, read from the JSONL without a word
    (run / "cells.parquet").write_bytes(b"PAR1 not really")
    assert not parquet_is_current(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(run).ttft_s_p50.tolist() == from_jsonl.ttft_s_p50.tolist()


def test_compare_skips_a_torn_line_and_says_bad_input_for_a_damaged_run(tmp_path):
    base = make_run(tmp_path, "base", repeats=3, prompts=(1024,), concurrency=(1,), n_requests=4, seed=1)
    cand = make_run(tmp_path, "cand", repeats=3, prompts=(1024,), concurrency=(1,), n_requests=4, seed=1)
    tear(cand / "cells.jsonl")
    tear(cand / "requests.jsonl")
    out = kvbench("compare", base, cand, "--format", "json")
    assert out.exit_code in (0, 3), out.output  # same seed: no regression; the torn lines are skipped
    with (cand / "cells.jsonl").open("a") as f:
        f.write('\n{"run_id": "cand", "cell_id": "odd"}\n')  # whole JSON, not a row: the run is damaged
    out = kvbench("compare", base, cand)
    assert out.exit_code == 2, out.output
    assert f"error: {cand}/cells.jsonl line 5: " in out.output


# --- plain names --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../x", "/abs/run", "a/b", ".hidden", "..", "", "a b", "x" * 201, "é"])
def test_paths_are_not_plain_names(name):
    with pytest.raises(PlainNameError, match="run id .* is not a plain name"):
        check_plain_name(name, "run id")


def test_plain_names_pass():
    for name in ("20261201-101500-smoke-host.local", "r1", "-x", "a_b.c-d", "x" * 200):
        assert check_plain_name(name, "run id") == name


def test_run_ids_and_workload_names_that_are_paths_are_refused(tmp_path):
    results = tmp_path / "results"
    for run_id in ("../x", str(tmp_path / "abs")):
        out = kvbench("run", "-b", "hf", "--results-dir", results, "--run-id", run_id, "--workload", "smoke")
        assert out.exit_code == 2 and "is not a plain name" in out.output, out.output
    (tmp_path / "bad.toml").write_text(TINY.format(name="../../x"))
    with pytest.raises(WorkloadError, match=r"bad.toml: name: workload name '../../x' is not a plain name"):
        load_workload(str(tmp_path / "bad.toml"))
    out = kvbench("run", "-b", "hf", "--results-dir", results, "--workload", tmp_path / "bad.toml")
    assert out.exit_code == 2 and "is not a plain name" in out.output, out.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]  # nothing written anywhere
    with pytest.raises(ValueError, match="cannot be a file name"):
        RunWriter(tmp_path / "r").write_timeline("../../escape", None)


# --- reused run ids -------------------------------------------------------------------------------------

def test_a_new_run_refuses_an_existing_one(tmp_path):
    writer = RunWriter(tmp_path / "r1")
    writer.write_run_info(INFO)
    writer.write_cell(cell())
    before = files_of(writer.root)
    with pytest.raises(RunExistsError, match=rf"^run r1 already exists in {tmp_path}: use --resume to finish its "
                                             "missing cells or --overwrite to replace it$"):
        RunWriter(tmp_path / "r1")
    assert files_of(writer.root) == before
    (tmp_path / "empty").mkdir()
    RunWriter(tmp_path / "empty")  # an empty folder is no run


def test_the_cli_refuses_a_reused_run_id_and_contradictory_flags(tmp_path):
    RunWriter(tmp_path / "r1").write_run_info(INFO)
    out = kvbench("run", "-b", "hf", "--results-dir", tmp_path, "--run-id", "r1", "--workload", "smoke")
    assert out.exit_code == 2, out.output
    assert "run r1 already exists in" in out.output and "--resume" in out.output
    assert load_run_info(tmp_path / "r1")["command"] == "kvbench run first"
    out = kvbench("run", "--results-dir", tmp_path, "--run-id", "r1", "--resume", "--overwrite")
    assert out.exit_code == 2 and "exclude each other" in out.output
    out = kvbench("run", "--results-dir", tmp_path, "--resume")
    assert out.exit_code == 2 and "--resume needs --run-id" in out.output


def test_overwrite_replaces_a_run_and_refuses_other_folders(tmp_path):
    old = RunWriter(tmp_path / "r1")
    old.write_run_info(INFO)
    old.write_cell(cell(cell_id="old"))
    (old.root / "timelines" / "old.csv").write_text("t\n0\n")
    new = RunWriter(tmp_path / "r1", mode="overwrite")
    assert not (new.root / "cells.jsonl").exists() and not (new.root / "run.json").exists()
    assert list((new.root / "timelines").iterdir()) == []
    new.write_cell(cell(cell_id="new"))
    assert list(load_cells(new.root).cell_id) == ["new"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("keep me")
    with pytest.raises(RunFolderError, match="not a kvbench run folder .* refusing to overwrite it"):
        RunWriter(tmp_path / "mine", mode="overwrite")
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "keep me"


def test_resume_keeps_finished_cells_drops_cut_off_requests_and_records_both_invocations(tmp_path):
    first = RunWriter(tmp_path / "r1")
    first.write_run_info(INFO)
    first.write_request(request("vllm-0.32.0_warmup", warmup=True))
    for i in range(2):
        first.write_request(request("done", i))
    first.write_cell(cell(cell_id="done"))
    first.write_cell(cell(cell_id="broken", status="failed", error="engine died"))
    first.write_request(request("cut-off", 0))  # the harness was killed during this cell
    tear(first.root / "requests.jsonl")
    first.update_run_info(status="interrupted", error="killed")

    with pytest.raises(RunFolderError, match="run nope not found .* nothing to resume"):
        RunWriter(tmp_path / "nope", mode="resume")
    again = RunWriter(tmp_path / "r1", mode="resume")
    assert again.finished_cell_ids() == {"done", "broken"}  # any status
    assert again.discard_unfinished_requests() == 2  # the cut-off cell's request and the torn line
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResultsWarning)
        requests = load(again.root, what="requests")
    assert sorted(requests.cell_id) == ["done", "done", "vllm-0.32.0_warmup"]
    again.write_run_info({**INFO, "command": "kvbench run --resume", "started_at": "2026-12-01T11:00:00+00:00"})
    again.record_invocation({"note": "from the runner"})  # merged into this invocation, not a third one
    again.update_run_info(status="finished", finished_at="2026-12-01T11:30:00+00:00")
    info = load_run_info(again.root)
    assert info["started_at"] == "2026-12-01T10:00:00+00:00" and info["status"] == "finished"
    assert "error" not in info  # the first invocation's error stays with it
    first_call, second_call = info["invocations"]
    assert (first_call["command"], first_call["status"], first_call["error"]) == ("kvbench run first", "interrupted",
                                                                                   "killed")
    assert (second_call["command"], second_call["mode"], second_call["status"], second_call["note"]) == (
        "kvbench run --resume", "resume", "finished", "from the runner")
    assert second_call["harness_pid"] == os.getpid()
    again.write_cell(cell(cell_id="cut-off"))
    assert list(load_cells(again.root).cell_id) == ["done", "broken", "cut-off"]


# --- a killed harness -----------------------------------------------------------------------------------

def test_run_json_records_the_harness_and_run_status_sees_it_gone(tmp_path):
    writer = RunWriter(tmp_path / "r1")
    writer.write_run_info(INFO)
    info = load_run_info(writer.root)
    assert info["harness_pid"] == os.getpid() and info["harness_host"]
    assert run_status(info) == "running"  # this process wrote it and is alive
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert run_status({**info, "harness_pid": dead.pid, "harness_started_at": None}) == HARNESS_GONE
    assert run_status({**info, "harness_started_at": info["harness_started_at"] - 3600}) == HARNESS_GONE  # pid reused
    assert run_status({**info, "harness_pid": dead.pid, "harness_host": "elsewhere"}) == "running"  # cannot tell
    assert run_status({**info, "harness_pid": dead.pid, "status": "finished"}) == "finished"
    assert run_status({"status": "running"}) == "running"  # runs from before the field

    writer.update_run_info(harness_pid=dead.pid)
    writer.write_cell(cell())
    out = kvbench("report", writer.root, "--no-plots", "--raw")
    assert out.exit_code == 0, out.output
    assert "`r1` (interrupted (harness gone))" in (writer.root / "report.md").read_text()


def test_a_truncated_run_json_still_reports_and_is_not_resumed(tmp_path):
    """What the old in-place rewrite left on a full disk: run.json cut at 4096 bytes (here: 100)."""
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    (run / "run.json").write_bytes((run / "run.json").read_bytes()[:100])
    out = kvbench("report", run, "--no-plots", "--raw")
    assert out.exit_code == 0, out.output
    text = (run / "report.md").read_text()
    assert f"`a` (unknown: {run}/run.json: not valid JSON" in text and "| vllm-0.31.0 | 1024 |" in text
    with pytest.raises(ResultsReadError, match=r"run.json: not valid JSON"):
        RunWriter(run, mode="resume")
    out = kvbench("run", "-b", "hf", "--results-dir", tmp_path, "--run-id", "a", "--resume", "--workload", "smoke")
    assert out.exit_code == 2 and "run.json: not valid JSON" in out.output, out.output


def test_a_torn_kv_validation_line_is_skipped_in_the_report(tmp_path):
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    row = {"engine": "hf", "case": "smollm2 bf16, 2 x (300 + 8)", "quantity": "cache tensor bytes",
           "predicted": 14146560, "engine_reported": None, "measured": 14146560, "tolerance": 0,
           "note": "transformers 5.24.0", "error_pct": 0.0, "ok": True}
    (run / "kv_validation.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row)[:40])
    out = kvbench("report", run, "--no-plots", "--raw")
    assert out.exit_code == 0, out.output
    assert "kv_validation.jsonl: 1 damaged line skipped (line 2" in out.output
    assert "smollm2 bf16, 2 x (300 + 8)" in (run / "report.md").read_text()
