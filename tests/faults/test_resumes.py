"""The third fault matrix's resumes (docs/fault-matrix.md, "Resumes that mix or redo runs"): `kvbench run
--resume` finishes a run as it was started or refuses in one line (exit 2) naming what differs with its two
values, before anything in the folder is written and before any engine is contacted. A run of an older
results schema is refused (its cell ids lack today's `_r0`: its finished cells would be measured again), and
a run under results/published is never rewritten. The engine is a fake OpenAI server (`-b openai:url=...`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvbench.common import models
from kvbench.store.schema import SCHEMA_VERSION
from tests.fakes.openai_server import FakeOpenAI
from tests.helpers import REPO, kvbench_here
from tests.test_cli import kvbench

PUBLISHED = REPO / "results" / "published"
OLD_SCHEMA_RUN = PUBLISHED / "20261129-143003-cpu-default"  # run.json schema v1: cell ids without "_r0"


def model_folder(where: Path) -> Path:
    """An HF model folder of the embedded model's config and tokenizer (no weights: the server is a fake)."""
    hf = models.hf_copy_dir(models.embedded_gguf("smollm2"))
    if not (hf / "tokenizer.json").exists():
        pytest.skip("the embedded model's HF copy is made by `make test` (kvbench setup)")
    where.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, where / name)
    return where


def args(url: str, model: Path, *extra: str) -> list[str]:
    # --no-report: what a resume keeps and adds is in the folder (a report took half of each run's CPU)
    return ["run", "-b", f"openai:url={url}", "--workload", "smoke", "--model", str(model), "--allow-model-mismatch",
            "--request-timeout", "20", "--start-timeout", "20", "--no-report", *extra]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A run finished against a fake server with --max-context 1024, its last cell's row then removed (what an
    interrupted run leaves), and the server's URL: copied into each test's folder."""
    root = tmp_path_factory.mktemp("resumes")
    model = model_folder(root / "model")
    with FakeOpenAI() as server:
        out = kvbench(*args(server.url, model, "--max-context", "1024", "--results-dir", str(root / "runs"),
                            "--run-id", "r"), timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        cells = (root / "runs" / "r" / "cells.jsonl").read_text().splitlines(keepends=True)
        (root / "runs" / "r" / "cells.jsonl").write_text("".join(cells[:-1]))
        yield root, server.url, server


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def copy(started, tmp_path):
    root, url, _ = started
    shutil.copytree(root / "runs", tmp_path / "runs")
    return tmp_path / "runs", root / "model", url


def refused(out, says: str) -> None:
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and says in text, out.stdout + out.stderr
    assert len([line for line in (out.stdout + out.stderr).splitlines() if line.strip()]) == 1, out.stdout + out.stderr
    assert "Traceback" not in text


NOWHERE = "http://127.0.0.1:9"  # nothing listens: a resume that got as far as the engine would fail its cells


def test_resume_with_another_model_folder_is_refused_with_both_paths_and_hashes(copy, tmp_path):
    runs, model, url = copy
    other = shutil.copytree(model, tmp_path / "other")
    (other / "notes.txt").write_text("another file: another sha256")
    before = snapshot(runs / "r")
    then = models.sha256_folder(model)[:12]
    now = models.sha256_folder(other)[:12]
    out = kvbench_here(*args(url, other, "--max-context", "1024", "--results-dir", str(runs), "--run-id", "r",
                             "--resume"))
    refused(out, f"another model ({model} sha256 {then} then, {other} sha256 {now} now)")
    assert snapshot(runs / "r") == before


def test_resume_with_the_same_path_but_changed_files_is_refused(copy):
    runs, model, url = copy
    changed = runs.parent / "model"
    shutil.copytree(model, changed)
    info = json.loads((runs / "r" / "run.json").read_text())
    info["model"]["hf_dir"] = str(changed)  # the run as if started on this folder, whose files then changed
    (runs / "r" / "run.json").write_text(json.dumps(info))
    (changed / "notes.txt").write_text("changed since")
    before = snapshot(runs / "r")
    out = kvbench_here(*args(url, changed, "--max-context", "1024", "--results-dir", str(runs), "--run-id", "r",
                             "--resume"))
    refused(out, f"another model ({changed} sha256 {info['model']['sha256'][:12]} then, {changed} sha256 "
                 f"{models.sha256_folder(changed)[:12]} now)")
    assert snapshot(runs / "r") == before


@pytest.mark.parametrize("extra, says", [
    ([], "another --max-context (1024 then, none now)"),
    (["--max-context", "512"], "another --max-context (1024 then, 512 now)"),
    (["--max-context", "1024", "--repeats", "2"], "another repeats (1 then, 2 now)"),
    (["--max-context", "1024", "--interleave"], "another interleaved (false then, true now)"),
    (["--max-context", "1024", "--reset-cache-between-cells"], None),  # openai cannot: refused as an option
])
def test_resume_with_another_max_context_or_option_is_refused(copy, extra, says):
    runs, model, url = copy
    before = snapshot(runs / "r")
    out = kvbench_here(*args(url, model, *extra, "--results-dir", str(runs), "--run-id", "r", "--resume"))
    if says is None:
        assert out.returncode == 2 and "cannot empty a prefix cache" in out.stderr, out.stderr
    else:
        refused(out, says)
    assert snapshot(runs / "r") == before


def test_a_run_that_recorded_no_max_context_asked_is_held_to_its_context_limit(copy):
    """Runs from before run.json recorded the flag: the limit it used (model.max_context) against this plan's."""
    runs, model, url = copy
    info = json.loads((runs / "r" / "run.json").read_text())
    del info["max_context_asked"]
    (runs / "r" / "run.json").write_text(json.dumps(info))
    before = snapshot(runs / "r")
    out = kvbench_here(*args(url, model, "--results-dir", str(runs), "--run-id", "r", "--resume"))
    refused(out, "another context limit (1024 then, 8192 now: give the --max-context it was started with)")
    assert snapshot(runs / "r") == before


def test_resume_as_started_finishes_only_the_missing_cell(copy):
    runs, model, url = copy
    kept = (runs / "r" / "cells.jsonl").read_text()
    out = kvbench(*args(url, model, "--max-context", "1024", "--results-dir", str(runs), "--run-id", "r",
                        "--resume"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (runs / "r" / "cells.jsonl").read_text()
    assert text.startswith(kept) and len(text.splitlines()) == len(kept.splitlines()) + 1
    info = json.loads((runs / "r" / "run.json").read_text())
    assert info["status"] == "finished" and [i["mode"] for i in info["invocations"]] == ["new", "resume"]
    assert info["max_context_asked"] == 1024 and info["model"]["max_context"] == 1024


def old_run(into: Path) -> Path:
    """The first published CPU default run (schema v1) as a run folder: its run.json and cells."""
    into.mkdir(parents=True)
    for name in ("run.json", "cells.jsonl"):
        shutil.copy(OLD_SCHEMA_RUN / name, into / name)
    return into


def test_resume_of_an_older_schema_run_is_refused_never_measured_again(tmp_path):
    run = old_run(tmp_path / "runs" / OLD_SCHEMA_RUN.name)
    assert all("_r0" not in json.loads(line)["cell_id"] for line in (run / "cells.jsonl").read_text().splitlines())
    before = snapshot(run)
    out = kvbench_here("run", "-b", "hf", "-b", "vllm", "-b", "llamacpp", "--results-dir", str(run.parent),
                       "--run-id", run.name, "--resume")
    refused(out, f"run {run.name} was written under results schema v1, an older one than this kvbench's "
                 f"v{SCHEMA_VERSION}")
    assert snapshot(run) == before and sorted(p.name for p in run.iterdir()) == ["cells.jsonl", "run.json"]
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("mode", ["--resume", "--overwrite"])
def test_a_published_run_is_never_rewritten(tmp_path, mode):
    run = old_run(tmp_path / "results" / "published" / OLD_SCHEMA_RUN.name)
    before = snapshot(run)
    out = kvbench_here("run", "-b", "hf", "-b", "vllm", "-b", "llamacpp", "--results-dir", str(run.parent),
                       "--run-id", run.name, mode)
    refused(out, f"run {run.name} in {run.parent} is a published run: it is never rewritten ({mode})")
    assert snapshot(run) == before and sorted(p.name for p in run.iterdir()) == ["cells.jsonl", "run.json"]


def test_resume_refuses_before_the_engine_is_contacted(copy):
    """The refusals above come before any request: the same resume with the server's URL changed to a port
    where nothing listens is refused as another backend, not failed cells."""
    runs, model, _ = copy
    before = snapshot(runs / "r")
    out = kvbench_here(*args(NOWHERE, model, "--max-context", "1024", "--results-dir", str(runs), "--run-id", "r",
                             "--resume"))
    refused(out, "another backends (openai@127.0.0.1:")
    assert snapshot(runs / "r") == before


def test_resume_on_another_machine_is_refused_with_both(copy):
    runs, model, url = copy
    info = json.loads((runs / "r" / "run.json").read_text())
    now = info["environment"]["cpu"]
    info["environment"]["cpu"] = "Another CPU(R) @ 1.00GHz"
    info["environment"]["cpu_count"] += 64
    (runs / "r" / "run.json").write_text(json.dumps(info))
    before = snapshot(runs / "r")
    out = kvbench_here(*args(url, model, "--max-context", "1024", "--results-dir", str(runs), "--run-id", "r",
                             "--resume"))
    refused(out, f"another machine (cpu: Another CPU(R) @ 1.00GHz vs {now}; cpu_count: ")
    assert snapshot(runs / "r") == before


def test_resume_keeps_the_machine_record_and_notes_this_invocation_s(copy):
    """run.json's environment is the one the run's cells were measured on; a resume's own (the same machine,
    another kvbench commit here) goes to its invocation's entry, not over it."""
    runs, model, url = copy
    info = json.loads((runs / "r" / "run.json").read_text())
    info["environment"]["kvbench_commit"] = "0" * 40
    (runs / "r" / "run.json").write_text(json.dumps(info))
    out = kvbench(*args(url, model, "--max-context", "1024", "--results-dir", str(runs), "--run-id", "r",
                        "--resume"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    after = json.loads((runs / "r" / "run.json").read_text())
    assert after["environment"] == info["environment"]
    assert after["invocations"][-1]["environment"]["kvbench_commit"] != "0" * 40
    assert "environment" not in after["invocations"][0]


def test_resume_on_a_server_that_now_reports_another_version_is_refused(started, copy):
    """The same URL, another engine behind it: refused with both versions once the server says which, the
    run's rows and status as they were, the invocation recorded as refused."""
    runs, model, url = copy
    server = started[2]
    cells_before = (runs / "r" / "cells.jsonl").read_bytes()
    requests_before = set((runs / "r" / "requests.jsonl").read_bytes().splitlines())
    status_before = json.loads((runs / "r" / "run.json").read_text())["status"]
    server.version = "0.33.0"
    try:
        out = kvbench_here(*args(url, model, "--max-context", "1024", "--results-dir", str(runs), "--run-id", "r",
                                 "--resume"))
    finally:
        server.version = "0.32.0"
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "Traceback" not in text, out.stdout + out.stderr
    host = url.removeprefix("http://")
    assert (f"error: --resume: openai@{host} at {url} now reports version 0.33.0; the run's cells of it ran on "
            "version 0.32.0") in text
    assert (runs / "r" / "cells.jsonl").read_bytes() == cells_before
    # nothing measured: no row added (the cut-off cell's requests go, as on every resume)
    assert set((runs / "r" / "requests.jsonl").read_bytes().splitlines()) <= requests_before
    info = json.loads((runs / "r" / "run.json").read_text())
    assert info["status"] == status_before and info["invocations"][-1]["status"] == "refused"
    assert "0.33.0" in info["invocations"][-1]["error"]
