"""The multi-process load generator (bench/load/workers.py) against the fake OpenAI server: every request
once, from more than one process, chunk times on the parent's clock and inside the cell's window, and the
open-loop schedule kept exactly."""
from __future__ import annotations

import contextlib
import os
import zlib
import time
from dataclasses import replace

import numpy as np
import pytest

from kvbench.backends.openai.adapter import OpenAIBackend
from kvbench.backends.types import RequestResult
from kvbench.load import LoadPoint, LoadSettings, constant, run, run_async, split, workers
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.testkit import prompt, spec
from tests.helpers import REPO


class PidOpenAI(OpenAIBackend):
    """The OpenAI adapter, unchanged, plus the pid of the process that streamed each request."""

    async def stream(self, client, prompt):
        result = await super().stream(client, prompt)
        result.engine_details["pid"] = os.getpid()
        return result


def attached(tmp_path, fake) -> PidOpenAI:
    backend = PidOpenAI("v1", tmp_path, {"token_ids": True, "ignore_eos": True, "return_token_ids": True})
    backend.attach(spec(tmp_path), fake.url, timeout_s=5)
    return backend


def drive(backend, prompts, point, n_workers, seed=0):
    before = time.perf_counter()
    load = run_async(run(backend, prompts, point, LoadSettings(30.0, seed=seed, workers=n_workers)))
    return load, before, time.perf_counter()


def check_requests(load, prompts, before, after, n_out):
    ids = [r.request_id for r in load.results]
    assert sorted(ids) == sorted(p.request_id for p in prompts) and len(set(ids)) == len(ids)  # each exactly once
    assert before < load.t_start <= load.t_end < after
    for r in load.results:
        assert r.error is None, r.error
        assert r.chunk_tokens == [1] * n_out and r.output_tokens_reported == n_out
        times = [r.t_sent, *r.chunk_times, r.t_done]
        assert all(a <= b for a, b in zip(times, times[1:])), r.request_id  # monotonic, one clock
        # stamped in a worker, compared on the parent's perf_counter: one clock across processes
        assert load.t_start <= r.t_sent and r.t_done <= load.t_end
    pids = {r.engine_details["pid"] for r in load.results}
    assert len(pids) == 2 and os.getpid() not in pids  # two worker processes, not this one


def test_closed_loop_on_two_workers_returns_every_request_once(tmp_path):
    prompts = [prompt(20, 6, f"r{i}") for i in range(24)]
    with FakeOpenAI(token_delay_s=0.003) as fake:
        backend = attached(tmp_path, fake)
        load, before, after = drive(backend, prompts, LoadPoint("concurrent", 3), 2)
    check_requests(load, prompts, before, after, 6)
    # concurrency 3 over two workers: 2 + 1 streams, and never more than 3 requests out at once
    assert 2 <= load.max_in_flight <= 3
    assert load.loop_lag_s_max is not None and load.offered_request_rate is None
    per_pid = {}
    for r in load.results:
        per_pid.setdefault(r.engine_details["pid"], []).append(int(r.request_id[1:]))
    # one shared queue: each stream took the next request when free, so the worker with two streams took
    # about twice as many (2:1, give or take a request at the end)
    small, large = sorted(len(v) for v in per_pid.values())
    assert small + large == 24 and 6 <= small <= 10
    assert sorted(r.ordinal for r in load.results) == list(range(24))  # each place in the queue once
    assert {r.load_process.split(":")[1] for r in load.results} == {str(pid) for pid in per_pid}


def test_open_loop_on_two_workers_keeps_the_schedule(tmp_path):
    rate, n = 40.0, 16
    prompts = [prompt(20, 4, f"r{i}") for i in range(n)]
    with FakeOpenAI(token_delay_s=0.002) as fake:
        backend = attached(tmp_path, fake)
        load, before, after = drive(backend, prompts, LoadPoint("constant", None, rate), 2)
    check_requests(load, prompts, before, after, 4)
    # every request kept its place in the one schedule of the cell (25 ms apart), whichever worker sent it (on
    # the parent's clock: each worker's offset to it is measured, to microseconds on a quiet machine and to
    # 0.1-0.3 ms beside eight test workers on two cores)
    due = {r.request_id: r.t_scheduled - load.t_start for r in load.results}
    expected = constant.Constant.arrival_offsets(n, rate)
    assert np.allclose([due[f"r{i}"] for i in range(n)], expected, atol=2e-3)
    assert len(load.send_lags) == n and load.offered_request_rate == rate
    for r in load.results:
        # none left before its time, give or take the event loop's timer (uvloop's round to 1 ms: the
        # single-process open loop, bench/load/open_loop.py, can wake that much early too)
        assert r.t_sent >= r.t_scheduled - 0.0015


def test_the_splits():
    assert split.split_count(5, 2) == [3, 2] and split.split_count(4, 4) == [1, 1, 1, 1]
    assert split.deal(list(range(10)), [3, 2]) == [[0, 2, 4, 5, 7, 9], [1, 3, 6, 8]]
    prompts = list(range(7))
    shares = workers.plan(prompts, LoadPoint("concurrent", 5), LoadSettings(1.0), 8)  # never more than 5
    assert [p.concurrency for _, p, _ in shares] == [1] * 5 and sorted(sum((s for s, _, _ in shares), [])) == prompts
    shares = workers.plan(prompts, LoadPoint("poisson", 3, 2.0), LoadSettings(1.0, seed=7), 2)
    assert [p.concurrency for _, p, _ in shares] == [2, 1] and [s for s, _, _ in shares] == [[0, 2, 4, 6], [1, 3, 5]]
    from kvbench.load import poisson
    offsets = poisson.Poisson.arrival_offsets(7, 2.0, 7)  # the profile's own schedule, with the cell's seed
    assert np.array_equal(np.concatenate([o for _, _, o in shares]), np.concatenate([offsets[0::2], offsets[1::2]]))


def test_a_closed_loop_profile_keeps_its_own_loop_on_every_worker(monkeypatch):
    """Split over workers, a closed-loop profile's shares are driven by that profile, not by "concurrent"."""
    from typing import Literal

    from kvbench.load import profile
    from kvbench.load.concurrent import Concurrent

    monkeypatch.setattr(profile, "_REGISTERED", dict(profile._REGISTERED))  # the classes are forgotten afterwards

    class Paired(Concurrent):
        profile: Literal["paired"] = "paired"

    class Solo(Concurrent):
        profile: Literal["solo"] = "solo"
        splits_over_workers = False

    shares = workers.plan(list(range(6)), LoadPoint("paired", 4), LoadSettings(1.0), 2)
    assert [(p.profile, p.concurrency) for _, p, _ in shares] == [("paired", 2), ("paired", 2)]
    with pytest.raises(workers.WorkerError, match="^load profile 'solo' runs from one load process only"):
        workers.plan(list(range(6)), LoadPoint("solo", 4), LoadSettings(1.0), 2)
    from kvbench.workloads import Workload

    w = Workload(name="w", seed=1, prompt_tokens=[16], output_tokens=4, load={"profile": "solo", "concurrency": [2]})
    w.load.check_workers(1)
    with pytest.raises(ValueError, match="--load-workers 2: load profile 'solo' runs from one load process only"):
        w.load.check_workers(2)


def test_merge_counts_in_flight_from_the_requests_and_keeps_the_worst_loop_lag():
    def req(i, sent, done):
        r = RequestResult(f"r{i}", 1, 1, sent)
        r.t_done = done
        return r

    a = workers.LoadResult([req(0, 1.0, 2.0), req(1, 2.0, 3.0)], 1.0, 3.0, loop_lag_s_max=0.004)
    b = workers.LoadResult([req(2, 1.5, 2.5)], 1.0, 2.6, loop_lag_s_max=0.02)
    merged = workers.merge([a, b], 1.0, None)
    assert [r.request_id for r in merged.results] == ["r0", "r2", "r1"] and merged.t_end == 3.0
    assert merged.max_in_flight == 2  # r0 ends as r1 starts: never 3 at once
    merged.loop_lag_s_max = 0.001  # what run_async sets from the parent's waiting loop
    assert merged.loop_lag_s_max == 0.02


def test_a_worker_that_cannot_stream_says_why(tmp_path):
    backend = PidOpenAI("v1", tmp_path, {})
    backend.spec, backend.base_url = spec(tmp_path), "http://127.0.0.1:9"
    backend.broken = lambda: None  # a local function does not pickle: left out of the worker's copy
    clone, dropped = workers.portable_backend(backend)
    assert dropped == ["broken"] and not hasattr(clone, "broken") and clone.base_url == backend.base_url
    load = run_async(run(backend, [prompt(4, 2, "r0"), prompt(4, 2, "r1")], LoadPoint("concurrent", 2),
                         LoadSettings(5.0, workers=2)))
    assert len(load.results) == 2 and all("ConnectionRefusedError" in r.error for r in load.results)


@pytest.mark.parametrize("clock", ["perf_counter"])
def test_perf_counter_is_the_system_wide_monotonic_clock(clock):
    """Why the workers' stamps compare with the parent's: on Linux perf_counter is CLOCK_MONOTONIC."""
    info = time.get_clock_info(clock)
    assert info.implementation == "clock_gettime(CLOCK_MONOTONIC)" and info.monotonic


def test_workers_bench_quick(tmp_path):
    """selfcheck/workers_bench.py end to end in its quick mode (its figures are measurements, in the README:
    no speed thresholds here)."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "workers.json"
    proc = subprocess.run([sys.executable, "-m", "kvbench.selfcheck.workers_bench", "--quick", "--workers", "1,2",
                           "--concurrency", "8", "--tokens", "16", "--accuracy-concurrency", "4", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["workers"] for r in data["rows"]] == [1, 2] and data["command"].startswith("python -m kvbench.selfcheck")
    for row in data["rows"]:
        assert row["failed"] == 0 and row["requests"] > 0
        for key in ("tokens_per_s", "requests_per_s", "ttft_p50_err_ms", "ttft_p99_err_ms"):
            assert math.isfinite(row[key]), key
        assert row["ttft_p50_err_ms"] > -1.0  # no token seen before the mock sent it
    proc = subprocess.run([sys.executable, "-m", "kvbench.selfcheck.workers_bench", "--quick", "--split", "--workers",
                           "1,2", "--accuracy-concurrency", "4", "--split-tokens", "2,8", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    split = json.loads(out.read_text())["split_rows"]
    assert [(r["workers"], r["split"]) for r in split] == [(1, "one process"), (2, "dealt"), (2, "shared queue")]
    assert all(r["failed"] == 0 and 0 < r["mean_in_flight"] <= 4 for r in split)


def test_a_cancelled_load_ends_its_workers_at_once(tmp_path):
    """Ctrl-C or SIGTERM cancels the load's task: the workers are ended, not waited for (their requests
    would take 10 s here)."""
    import asyncio
    import multiprocessing

    import psutil

    prompts = [prompt(8, 1000, f"r{i}") for i in range(4)]
    with FakeOpenAI(token_delay_s=0.01) as fake:
        backend = attached(tmp_path, fake)

        def streaming(p: multiprocessing.Process) -> bool:
            with contextlib.suppress(psutil.Error):
                return any(c.raddr and c.raddr.port == fake.port for c in psutil.Process(p.pid).net_connections("tcp"))
            return False

        async def cancel_once_both_stream():
            task = asyncio.create_task(run(backend, prompts, LoadPoint("concurrent", 2), LoadSettings(60.0, workers=2)))
            deadline = time.monotonic() + 30
            while not (len(children := multiprocessing.active_children()) == 2 and all(map(streaming, children))):
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.05)
            task.cancel()
            t = time.perf_counter()
            with pytest.raises(asyncio.CancelledError):
                await task
            return time.perf_counter() - t

        took = asyncio.run(cancel_once_both_stream())
    assert took < 4.0  # the workers ended (their requests alone would take 10 s)
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


HARNESS = """
import sys
from pathlib import Path
from kvbench.backends.openai.adapter import OpenAIBackend
from kvbench.load import LoadPoint, LoadSettings, run, run_async
from tests.fakes.testkit import prompt, spec
tmp = Path(sys.argv[2])
backend = OpenAIBackend("v1", tmp, {"token_ids": True, "ignore_eos": True, "return_token_ids": True})
backend.attach(spec(tmp), sys.argv[1], timeout_s=5)
print("attached", flush=True)
run_async(run(backend, [prompt(8, 1000, f"r{i}") for i in range(4)], LoadPoint("concurrent", 2),
              LoadSettings(60.0, workers=2)))
"""


def test_a_killed_harness_takes_its_load_workers_with_it(tmp_path):
    """SIGKILL of the harness mid-cell: its load workers stop within seconds (they used to finish their
    share, sending to the server, with nobody to read the results)."""
    import signal
    import subprocess
    import sys

    import psutil

    with FakeOpenAI(token_delay_s=0.01) as fake:  # each request 10 s
        harness = subprocess.Popen([sys.executable, "-c", HARNESS, fake.url, str(tmp_path)], stdout=subprocess.PIPE,
                                   text=True, cwd=str(REPO))
        try:
            assert harness.stdout.readline().strip() == "attached"
            deadline = time.monotonic() + 60
            workers_seen = []
            while len(workers_seen) < 2 and time.monotonic() < deadline:
                workers_seen = [p for p in psutil.Process(harness.pid).children()
                                if "spawn_main" in " ".join(p.cmdline())]
                time.sleep(0.2)
            assert len(workers_seen) == 2

            def sending(p):  # a connection open to the server: the worker is streaming a request
                return any(c.raddr and c.raddr.port == fake.port for c in p.net_connections(kind="tcp"))

            while not all(sending(p) for p in workers_seen) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert all(sending(p) for p in workers_seen)
            harness.send_signal(signal.SIGKILL)
            harness.wait(10)
            gone, alive = psutil.wait_procs(workers_seen, timeout=5)
            assert not alive, [p.pid for p in alive]
        finally:
            harness.kill()
            harness.wait()


# --- one load over several processes, as one process would send it ----------------------------------------

def spread_ttft(prompt) -> float:
    """The fake's first-token delay: 5-35 ms by the prompt's first token id, the same for the same prompt
    whichever process sends it (a spread of TTFTs far wider than a client's own overhead)."""
    return 0.005 + 0.03 * (zlib.crc32(str(prompt).encode()) % 97) / 97


def numbered_prompts(n: int, n_out: int) -> list:
    return [replace(prompt(20, n_out, f"r{i}"), token_ids=tuple(range(100 + i, 120 + i)), ordinal=i)
            for i in range(n)]


def ttfts(load) -> list[float]:
    return [r.chunk_times[0] - r.t_sent for r in load.results if r.chunk_times]


@pytest.mark.parametrize("point", [LoadPoint("concurrent", 4), LoadPoint("constant", None, 60.0)],
                         ids=["closed", "open"])
def test_a_load_on_two_workers_is_the_load_of_one_process(tmp_path, point):
    """The same cell from one process and from two: the same requests (each ordinal once), the same token
    counts, and TTFT distributions a Mann-Whitney test does not tell apart."""
    from scipy.stats import mannwhitneyu

    prompts = numbered_prompts(48, 6)
    with FakeOpenAI(token_delay_s=0.002, first_token_delay_s=spread_ttft) as fake:
        backend = attached(tmp_path, fake)
        one, _, _ = drive(backend, prompts, point, 1)
        two, _, _ = drive(backend, prompts, point, 2)
    for load in (one, two):
        assert all(r.error is None for r in load.results)
        assert sorted(r.ordinal for r in load.results) == list(range(48))
        assert sum(sum(r.chunk_tokens) for r in load.results) == 48 * 6
    assert {r.clock_offset_start_s for r in one.results} == {0.0}  # one process: the owner itself
    assert two.processes == 2 and len({r.load_process for r in two.results}) == 2
    # the workers' offsets to the parent's clock: measured, and small (one CLOCK_MONOTONIC on this machine)
    assert all(abs(r.clock_offset_start_s) < 0.005 and abs(r.clock_offset_end_s) < 0.005 for r in two.results)
    assert mannwhitneyu(ttfts(one), ttfts(two)).pvalue > 0.01


def skewed_worker_main(conn, index=0, queue=None):
    """A load worker whose clock reads 1000 s ahead (worker 1 only): what a process on a machine with
    another clock would stamp."""
    if index == 1:
        from kvbench.backends import streaming

        real = time.perf_counter
        skewed = lambda: real() + 1000.0  # noqa: E731
        time.perf_counter = skewed
        streaming.perf_counter = skewed
    workers._worker_main(conn, index, queue)


def test_a_worker_clock_set_off_is_put_back_on_the_owners(tmp_path, monkeypatch):
    """Worker 1's clock 1000 s ahead: its offset is measured (-1000 s at the start and the end) and every
    time it stamped lands on the parent's clock, inside the cell's window, as worker 0's do."""
    monkeypatch.setattr(workers, "WORKER_MAIN", skewed_worker_main)
    prompts = numbered_prompts(16, 4)
    with FakeOpenAI(token_delay_s=0.002) as fake:
        backend = attached(tmp_path, fake)
        load, before, after = drive(backend, prompts, LoadPoint("concurrent", 2), 2)
    check_requests(load, prompts, before, after, 4)  # on the parent's clock, inside [before, after]
    offsets = {r.load_process: (r.clock_offset_start_s, r.clock_offset_end_s) for r in load.results}
    assert len(offsets) == 2
    assert sorted(round(start) for start, _ in offsets.values()) == [-1000, 0]
    assert all(start == pytest.approx(end, abs=0.005) for start, end in offsets.values())


def dying_worker_main(conn, index=0, queue=None):
    """A load worker (worker 1) that dies (os._exit) right after its third request has ended, before handing
    any back."""
    if index == 1:
        from kvbench.load import concurrent

        real, done = concurrent.send_one, []

        async def send_then_die(*args, **kwargs):
            result = await real(*args, **kwargs)
            done.append(result)
            if len(done) == 3:
                os._exit(17)
            return result

        concurrent.send_one = send_then_die
    workers._worker_main(conn, index, queue)


def test_a_dead_worker_loses_its_own_requests_and_no_one_elses(tmp_path, monkeypatch):
    """Worker 1 dies mid-cell: its three requests are recorded lost (named, with its process), worker 0
    takes the rest of the queue, and every request of the cell is there once; the cell's row counts them."""
    from kvbench.run.rows import request_figures
    from kvbench.store.schema import CellRow

    monkeypatch.setattr(workers, "WORKER_MAIN", dying_worker_main)
    prompts = numbered_prompts(20, 4)
    with FakeOpenAI(token_delay_s=0.002) as fake:
        backend = attached(tmp_path, fake)
        load, _, _ = drive(backend, prompts, LoadPoint("concurrent", 2), 2)
    assert sorted(r.ordinal for r in load.results) == list(range(20))
    lost = [r for r in load.results if r.error and r.error.startswith("lost: ")]
    kept = [r for r in load.results if r not in lost]
    assert len(lost) == 3 and all("exited (17)" in r.error for r in lost), [r.error for r in lost]
    assert len({r.load_process for r in lost}) == 1 and all(r.error is None for r in kept)
    assert lost[0].load_process not in {r.load_process for r in kept}
    row = CellRow(run_id="r", cell_id="c", backend="b", engine="openai", engine_version="v", model="m",
                  workload="w", prompt_tokens=20, output_tokens=4, concurrency=2, kv_dtype="auto", status="ok")
    request_figures(row, load)
    assert (row.n_requests, row.n_ok, row.n_failed, row.n_lost, row.status) == (20, 17, 3, 3, "flagged")
    assert row.flags[0].startswith("3 requests lost: load process ")
