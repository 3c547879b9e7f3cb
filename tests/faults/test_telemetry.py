"""Telemetry garbage never fails a cell (issue 22): an engine's /metrics (polled through the real vLLM adapter
against tests/fakes/replica_server.py's vLLM page, as a deployment's tests do) or a Prometheus API answer with
a sample that is not a number, NaN, +Inf, an answer of 137 MB, or one that never comes. The cell stays ok,
the bad samples are dropped and counted in the row's sources, a peak is the finite samples' peak, the
harness's memory and the cell's time stay bounded."""
from __future__ import annotations

import gzip
import io
import json
import re
import threading
import time

import httpx
import psutil
import pytest
from rich.console import Console

from kvbench.backends.prometheus import (RESPONSE_CAP_BYTES, ResponseTooLarge, capped_get, metric_samples,
                                         take_dropped)
from kvbench.run import telemetry
from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.run.telemetry import Prometheus, parse_matrix
from kvbench.store.readers import load_cells
from kvbench.workloads import Workload
from tests.fakes.replica_server import FakeReplica, ReplicaHandler, set_sample

RUNNING = 'vllm:num_requests_running{engine="0",model_name="smollm2"} '
USAGE = 'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} '
HUGE_MB = 137
MIB = 1 << 20


class GarbageHandler(ReplicaHandler):
    def do_GET(self):
        fake: FaultyReplica = self.server.fake
        if self.path != "/metrics" or fake.fault not in ("huge", "hang"):
            return super().do_GET()
        if fake.fault == "hang":  # headers never come: a server stuck rendering its page
            fake.released.wait(30)
            return None
        self.start_stream("text/plain; version=0.0.4")  # chunked, no length: the cap must count as it reads
        block = fake.metrics_page().encode() + (b"# padding " + b"x" * 1000 + b"\n") * (MIB // 1011)
        try:
            for _ in range(HUGE_MB * MIB // len(block)):
                self.chunk(block)
            self.end_stream()
        except OSError:  # the client stopped reading at its cap and closed the connection
            self.close_connection = True
        return None


class FaultyReplica(FakeReplica):
    """A vLLM replica whose /metrics has one fault: ``stale`` (its gauges read idle while it serves),
    ``text`` (the running gauge's value is not a number), ``nan`` / ``inf`` (the KV usage gauge of a second
    engine is NaN / +Inf, beside the real one), ``huge`` (137 MB), ``hang`` (no answer)."""

    handler = GarbageHandler

    def __init__(self, fault: str, **kwargs):
        super().__init__(num_gpu_blocks=33, block_size=32, max_running=4, token_delay_s=0.02, **kwargs)
        self.fault, self.released = fault, threading.Event()

    def metrics_page(self) -> str:
        page = super().metrics_page()
        if self.fault == "text":
            head, _, tail = page.partition(RUNNING)
            return head + RUNNING + "abc" + tail[tail.index("\n"):]
        if self.fault == "stale":  # every gauge as if idle: a page that never caught up with the engine
            for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
                page = set_sample(page, gauge, 0)
            return page
        if self.fault in ("nan", "inf"):
            value = "NaN" if self.fault == "nan" else "+Inf"
            return page + f'vllm:kv_cache_usage_perc{{engine="1",model_name="smollm2"}} {value}\n'
        return page

    def stop(self):
        self.released.set()
        super().stop()


WORKLOAD = Workload(name="faults", seed=5, prompt_tokens=[48], output_tokens=16, concurrency=[1, 2], rounds=2,
                    warmup_requests=0)


def run_against(tmp_path, fake: FakeReplica, prometheus: Prometheus | None = None):
    opts = RunOptions(model="smollm2", workload=WORKLOAD, backends=[BackendConfig.parse(f"vllm:url={fake.url}")],
                      results_dir=tmp_path, run_id="run", estimate=False, prometheus=prometheus)
    started = time.perf_counter()
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return load_cells(run_dir), time.perf_counter() - started


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, smollm2):
    with FaultyReplica("none") as fake:
        cells, took = run_against(tmp_path_factory.mktemp("clean"), fake)
    assert (cells.status == "ok").all(), cells.error.tolist()
    return cells, took


def test_gauges_that_never_show_the_served_requests_are_not_measured_not_zero(tmp_path, smollm2):
    """Each request was served, so it held KV and ran in the engine's queue; polls that read only zeros
    missed it (vLLM's gauge behind a CPU-starved engine): the peaks are "not measured", and say why."""
    with FaultyReplica("stale") as fake:
        cells, _ = run_against(tmp_path, fake)
    assert (cells.status == "ok").all() and cells.n_requests.tolist() == [2, 4], cells.error.tolist()
    assert cells.kv_in_use_peak_bytes.isna().all() and cells.requests_running_peak.isna().all()
    assert cells.kv_pool_tokens_engine.tolist() == [33 * 32] * 2  # the pool is read all the same
    for row in cells.itertuples():
        assert re.fullmatch(rf"not measured: none of \d+ polls of .* read the KV of the cell's {row.n_requests} "
                            r"served requests \(a gauge behind the engine, .*\)", row.kv_in_use_source), row
        assert f"saw the cell's {row.n_requests} served requests" in row.queue_source, row.queue_source


@pytest.mark.parametrize("fault, said", [
    ("text", r"\d+ samples dropped \(\d+ not a number: vllm:num_requests_running\)"),
    ("nan", "dropped .*NaN: vllm:kv_cache_usage_perc"),
    ("inf", r"dropped .*\+Inf: vllm:kv_cache_usage_perc"),
    ("huge", r"polls failed \(.*ResponseTooLarge: /metrics answered over 8 MiB"),
    ("hang", r"polls failed \(.*(ReadTimeout|ResponseTooLarge)"),
], ids=["non-numeric", "NaN", "+Inf", "137MB", "hang"])
def test_a_bad_metrics_page_leaves_every_cell_ok_and_says_what_was_dropped(tmp_path, clean_run, fault, said):
    clean, clean_took = clean_run
    rss_before = psutil.Process().memory_info().rss
    with FaultyReplica(fault) as fake:
        cells, took = run_against(tmp_path, fake)
    rss_growth = psutil.Process().memory_info().rss - rss_before
    assert (cells.status == "ok").all() and len(cells) == 2, cells.error.tolist()
    assert cells.n_requests.tolist() == [2, 4]
    for row in cells.itertuples():
        assert row.kv_in_use_source and re.search(said, row.kv_in_use_source), row.kv_in_use_source
    if fault in ("text", "nan", "inf"):  # the other samples read: the peaks are the finite ones'
        for source in cells.kv_in_use_source:  # one bad sample a page: one dropped a poll (the first poll
            # of the run also reads the whole page for the pool: one more)
            dropped, polls = re.search(r"; (\d+) samples? dropped .* in (\d+) polls", source).groups()
            assert int(polls) <= int(dropped) <= int(polls) + 1 and int(polls) >= 3, source
        assert cells.kv_in_use_peak_bytes.tolist() == clean.kv_in_use_peak_bytes.tolist()
        assert (cells.kv_in_use_peak_bytes > 0).all()
        if fault != "text":
            assert cells.requests_running_peak.tolist() == clean.requests_running_peak.tolist()
        assert cells.kv_pool_tokens_engine.tolist() == [33 * 32] * 2
    else:  # nothing could be read: not measured, and why
        assert cells.kv_in_use_peak_bytes.isna().all() and cells.kv_in_use_source.str.startswith("not measured").all()
    # 137 MB read whole at 10 Hz took the harness to 6.8 GB; read up to the cap, a few of them at once
    assert rss_growth < 300 * MIB, rss_growth
    # a hang costs one read's timeout (10 s), then /metrics is not asked for 5 s: not one per read and poll
    assert took < clean_took + (15 if fault == "hang" else 8), (took, clean_took)


def test_metric_samples_drop_and_count_bad_lines_and_non_finite_values():
    take_dropped()
    page = ("# TYPE a gauge\na{x=\"1\"} 1.5\na{x=\"2\"} NaN\na{x=\"3\"} +Inf\nb -Inf\nb 2\n"
            "c{x=\"1\"} abc\nc 3\nd{x=\"unterminated} 4\n")
    samples = metric_samples(page)
    assert samples == {"a": [({"x": "1"}, 1.5)], "b": [({}, 2.0)], "c": [({}, 3.0)]}
    dropped = take_dropped()
    assert dropped[("a", "NaN")] == 1 and dropped[("a", "+Inf")] == 1 and dropped[("b", "-Inf")] == 1
    assert dropped[("c", "not a number")] == 1 and sum(dropped.values()) == 5
    assert metric_samples(page, ["b"]) == {"b": [({}, 2.0)]} and take_dropped() == {("b", "-Inf"): 1}
    assert not take_dropped()  # taken: counted once


def test_capped_get_stops_reading_at_the_cap():
    body = b"x" * (RESPONSE_CAP_BYTES + 1)
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body))) as client:
        with pytest.raises(ResponseTooLarge, match="over the 8 MiB"):
            capped_get(client, "http://e/metrics")
    chunks = (b"y" * MIB for _ in range(20))  # streamed without a length

    def streamed(request):
        return httpx.Response(200, content=chunks)

    with httpx.Client(transport=httpx.MockTransport(streamed)) as client:
        with pytest.raises(ResponseTooLarge, match="over 8 MiB: not read further"):
            capped_get(client, "http://e/metrics")
        assert capped_get(client, "http://e/metrics", cap=100 * MIB).status_code == 200  # what is left
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, text="ok 1\n"))) as client:
        assert capped_get(client, "http://e/metrics").text == "ok 1\n"
    # prometheus_client gzips /metrics for a client that accepts it (httpx does): the cap counts what it
    # decodes to, so a small compressed answer that decodes past it is stopped too
    page, bomb = gzip.compress(b"ok 1\n"), gzip.compress(b"x" * (2 * RESPONSE_CAP_BYTES))

    def gzipped(request):
        body = bomb if request.url.path == "/bomb" else page
        return httpx.Response(200, content=body, headers={"Content-Encoding": "gzip"})

    with httpx.Client(transport=httpx.MockTransport(gzipped)) as client:
        assert capped_get(client, "http://e/metrics").text == "ok 1\n"
        with pytest.raises(ResponseTooLarge):
            capped_get(client, "http://e/bomb")


T0 = 1796064517.0


def _series(name, values, instance="127.0.0.1:8000"):
    return {"metric": {"__name__": name, "instance": instance, "job": "vllm"}, "values": values}


def _answer(*series):
    return {"status": "success", "data": {"resultType": "matrix", "result": list(series)}}


def test_a_prometheus_answer_with_garbage_gives_the_finite_peaks_and_says_what_was_dropped():
    take_dropped()
    series = parse_matrix(_answer(
        _series("vllm:kv_cache_usage_perc", [[T0 + 0.5, "0.25"], [T0 + 1.0, "NaN"], [T0 + 1.5, "+Inf"],
                                              [T0 + 1.7, "abc"], [T0 + 1.8, None], "junk", [T0 + 1.9, "0.5"]]),
        "not a series",
        _series("vllm:num_requests_running", [[T0 + 0.5, "2"], [T0 + 1.5, "-Inf"]])))
    dropped = take_dropped()
    assert dropped[("vllm:kv_cache_usage_perc", "not a number")] == 3 and dropped[("?", "series not readable")] == 1
    assert dropped[("vllm:kv_cache_usage_perc", "NaN")] == 1 and dropped[("vllm:num_requests_running", "-Inf")] == 1
    figures = telemetry.cell_figures(series, T0, T0 + 2.0)
    assert figures["prom_kv_usage_peak"] == 0.5 and figures["prom_requests_running_peak"] == 2.0
    assert figures["prom_samples"] == 3


@pytest.mark.parametrize("answer, said", [
    (lambda: httpx.Response(200, json=_answer(_series("vllm:kv_cache_usage_perc",
                                                      [[T0 + 0.5, "NaN"], [T0 + 0.7, "0.5"], [T0 + 2.5, "0.1"]]))),
     r"1 samples of vllm:kv_cache_usage_perc .*; 1 sample dropped \(1 NaN: vllm:kv_cache_usage_perc\)"),
    (lambda: httpx.Response(200, json=_answer(_series("vllm:kv_cache_usage_perc",
                                                      [[T0 + 0.5, "NaN"], [T0 + 2.5, "+Inf"]]))),
     r"not measured: no sample .*; 2 samples dropped \(1 \+Inf: .*; 1 NaN: "),
    (lambda: httpx.Response(200, content=b'{"status": "success", "data": {"resultType": "matrix", "result": ['
                            + b'{"metric": {}, "values": []},' * (3 * MIB) + b"]}}"),
     "not measured: .*ResponseTooLarge: .* over the 16 MiB"),
    (lambda: httpx.Response(200, json={"status": "success", "data": {"resultType": "matrix", "result": 7}}),
     "not measured: .*TypeError"),
], ids=["NaN-beside-finite", "only-non-finite", "over-16MiB", "unforeseen-shape"])
def test_a_prometheus_answer_never_fails_the_cell(answer, said):
    prom = Prometheus("http://prom:9090", settle_s=0.0)
    def handler(request):  # the engines' query only: the GPUs' answers nothing
        return answer() if "vllm" in request.url.params["query"] else httpx.Response(200, json=_answer())

    prom._http = httpx.Client(transport=httpx.MockTransport(handler))
    offset = telemetry.wall_clock_offset()
    cell = prom.cell(T0 - offset, T0 + 2.0 - offset)
    assert re.search(said, cell.figures["prom_source"]), cell.figures["prom_source"]
    json.dumps(cell.figures, allow_nan=False)  # no NaN or Inf reaches the row


def test_llamacpp_slots_and_log_figures_that_cannot_be_read_are_dropped():
    from kvbench.backends.llamacpp.adapter import parse_buffers, parse_kv_log, readable_slot_tokens

    take_dropped()
    good = {"id": 0, "is_processing": True, "n_prompt_tokens": 40, "next_token": [{"n_decoded": 3}]}
    slots = [good, "junk", {"is_processing": True, "n_prompt_tokens": "many"}, {"is_processing": False}]
    assert readable_slot_tokens(slots) == [40]
    assert take_dropped() == {("/slots", "slot not readable"): 2}
    assert readable_slot_tokens({"error": "no slots"}) == [] and take_dropped() == {("/slots", "not a list of slots"): 1}
    log = ("load_tensors:          CPU model buffer size =   1.2.3 MiB\n"
           "llama_kv_cache:        CPU KV buffer size =   720.00 MiB\n"
           "llama_kv_cache: size =  7x0.00 MiB (  8192 cells,  30 layers,  4/4 seqs), K (f16): 360.00 MiB, "
           "V (f16): 360.00 MiB\n")
    assert parse_buffers(log) == {"model": {}, "kv": {"CPU": 720 * MIB}}  # the garbled line not read
    assert parse_kv_log(log) == []
