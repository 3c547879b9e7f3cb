"""The fault matrix, part one: servers that misbehave (docs/fault-matrix.md lists every case with the command
that runs it). A broken server makes failed rows with a clear error; the run goes on to the next backend and
ends "finished"; a wedged server costs a few request timeouts, not one per remaining request.

The engines' own faults (SIGKILL mid-cell and while starting, the harness killed) are in
tests/faults/test_failures_engines.py with real engines; the results folder's (full disk, torn lines, reused run ids) in
tests/faults/test_results_folder.py.
"""
import io
import logging
import time

import pytest
from rich.console import Console

from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells, load_run_info
from kvbench.workloads import load

from tests.fakes.misbehaving_server import FakeMisbehaving
from tests.fakes.openai_server import FakeOpenAI

SMOKE_CELLS = 4  # workloads/smoke.toml: 2 lengths x 2 concurrencies


def run(tmp_path, *urls, request_timeout_s=10.0, **options):
    """A smoke run on each url; the servers are not asked what they support first (probe=false): each fault is
    met by the cells' own requests, and a server's count of completions is the run's requests."""
    console = io.StringIO()
    opts = RunOptions(model="smollm2", workload=load("smoke"), results_dir=tmp_path, run_id="run",
                      backends=[BackendConfig.parse(f"openai:url={u},probe=false") for u in urls],
                      request_timeout_s=request_timeout_s, **options)
    run_dir = Runner(opts, Console(file=console, width=200)).run()
    return run_dir, load_cells(run_dir), console.getvalue()


# fault -> what the failed rows say
BROKEN = {
    "list": "bad response",
    "null": "bad response",
    "choices_str": "bad response",
    "not_json": "bad response",
    "http_500": "EngineCore encountered an issue",
    "http_429": "Too many requests",
    "reset": "connection closed",
    "html": "text/html",
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_a_broken_server_fails_its_rows_and_the_next_backend_still_runs(tmp_path, smollm2, fault):
    with FakeMisbehaving(fault) as bad, FakeOpenAI() as good:
        run_dir, cells, console = run(tmp_path, bad.url, good.url)
    broken = cells[cells.backend == f"openai@127.0.0.1:{bad.port}"]
    fine = cells[cells.backend == f"openai@127.0.0.1:{good.port}"]
    assert len(broken) == len(fine) == SMOKE_CELLS  # every cell has its row, on both backends
    assert (broken.status == "failed").all()
    assert broken.error.str.contains(BROKEN[fault], regex=False).all(), broken.error.tolist()
    assert (fine.status == "ok").all()
    assert load_run_info(run_dir)["status"] == "finished"
    assert "Traceback" not in console


def test_one_bad_event_among_good_requests_fails_only_that_request(tmp_path, smollm2):
    from kvbench.store.readers import load

    with FakeMisbehaving("list", fault_every=3) as server:
        run_dir, cells, _ = run(tmp_path, server.url)
        served = server.completions
    assert len(cells) == SMOKE_CELLS
    requests = load(run_dir, what="requests")
    assert len(requests) == served  # every completion the server answered is recorded (warmups too)
    failed = requests[requests.error.notna()]
    # exactly the faulty completions (every third) failed, each with the parser's error; no other request did
    assert len(failed) == served // 3 >= 2, requests[["request_id", "error"]]
    assert failed.error.str.startswith("bad response").all(), failed.error.tolist()
    # each cell counts its own failed requests, no more and no fewer, and measured the rest
    measured = requests[~requests.warmup]
    per_cell = {cid: int(g.error.notna().sum()) for cid, g in measured.groupby("cell_id")}
    assert dict(zip(cells.cell_id, cells.n_failed)) == per_cell
    assert cells.n_failed.sum() == (~failed.warmup).sum() >= 1
    assert (cells.n_ok + cells.n_failed == cells.n_requests).all()
    assert (cells.n_ok > 0).all()  # the other requests of each cell were measured
    assert set(cells.status[cells.n_failed > 0]) == {"flagged"} and set(cells.status[cells.n_failed == 0]) == {"ok"}


@pytest.mark.parametrize("fault", ["hang", "stall", "infinite"])
def test_a_wedged_server_costs_a_few_timeouts_not_one_per_request(tmp_path, smollm2, fault, caplog):
    timeout_s = 1.0
    with FakeMisbehaving(fault) as bad, FakeOpenAI() as good:
        t0 = time.monotonic()
        with caplog.at_level(logging.DEBUG):
            run_dir, cells, console = run(tmp_path, bad.url, good.url, request_timeout_s=timeout_s)
        took = time.monotonic() - t0
    broken = cells[cells.backend == f"openai@127.0.0.1:{bad.port}"]
    assert len(broken) == SMOKE_CELLS and (broken.status == "failed").all()
    assert broken.error.str.contains("stopped answering|timed out").all(), broken.error.tolist()
    assert (cells[cells.backend == f"openai@127.0.0.1:{good.port}"].status == "ok").all()
    # 3 timeouts in a row trip the backend: well under the 1 + 4 + 6 = 11 requests x 1 s it would take; each
    # later cell first probes the server once (half the request timeout; a second for the probe's own load)
    assert took < 3 * timeout_s + (SMOKE_CELLS - 1) * (timeout_s / 2 + 1) + 6, took
    # a request timeout is a failed request, not a CancelledError traceback on the console or in the log
    assert "CancelledError" not in console and "Traceback" not in console
    assert not [r for r in caplog.records if "CancelledError" in r.getMessage() or r.exc_info]


def test_a_server_refusing_connections_fails_the_backend_in_seconds(tmp_path, smollm2):
    with FakeOpenAI() as gone:
        url = gone.url
    t0 = time.monotonic()
    run_dir, cells, console = run(tmp_path, url, start_timeout_s=60)
    assert time.monotonic() - t0 < 10
    assert len(cells) == SMOKE_CELLS and (cells.status == "failed").all()
    assert cells.error.str.contains("refused").all(), cells.error.tolist()


# --- reused run ids and resume (the results folder's own faults: tests/faults/test_results_folder.py) -------------

def test_a_reused_run_id_is_refused_and_resume_finishes_only_the_missing_cells(tmp_path, smollm2):
    from kvbench.store.errors import RunExistsError
    from kvbench.store.readers import load

    with FakeOpenAI() as server:
        run_dir, cells, _ = run(tmp_path, server.url)
        assert len(cells) == SMOKE_CELLS
        with pytest.raises(RunExistsError, match="--resume"):
            run(tmp_path, server.url)
        # what an interrupted run leaves: the last cell had sent its requests but had no row yet
        lines = (run_dir / "cells.jsonl").read_text().splitlines(keepends=True)
        (run_dir / "cells.jsonl").write_text("".join(lines[:-1]))
        kept = lines[:-1]
        before = load(run_dir, what="requests")
        requests_before, warmups = len(before[~before.warmup]), before.warmup.sum()
        _, cells, console = run(tmp_path, server.url, results_mode="resume")
    assert len(cells) == SMOKE_CELLS and cells.cell_id.is_unique and (cells.status == "ok").all()
    assert (run_dir / "cells.jsonl").read_text().splitlines(keepends=True)[:-1] == kept  # kept as they were
    requests = load(run_dir, what="requests")
    measured = requests[~requests.warmup]
    assert len(measured) == requests_before  # the cut-off cell's requests were replaced, not doubled
    assert measured.groupby("cell_id").request_id.apply(lambda ids: ids.is_unique).all()
    assert requests.warmup.sum() == 2 * warmups  # each invocation warmed the engine up
    info = load_run_info(run_dir)
    assert info["status"] == "finished" and len(info["invocations"]) == 2
