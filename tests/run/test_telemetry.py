"""Telemetry from Prometheus (bench/run/telemetry.py): parsing and alignment on canned API answers (in the shape a
real Prometheus 2.42 returned for the DCGM stand-in), a real Prometheus (Debian's package) scraping the DCGM
stand-in, and (engine) a real vLLM CPU server attached by `kvbench run --prometheus`."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from kvbench.backends.process import free_port
from kvbench.run import telemetry
from kvbench.run.telemetry import MIB, Prometheus, TelemetryError, cell_figures, parse_matrix, samples_frame
from tests.fakes.dcgm_exporter import GPU, FakeDCGMExporter
from tests.helpers import REPO

T0 = 1796064517.0  # a cell's start, Unix seconds


def dcgm_series(name, gpu, uuid, points, host_label="Hostname"):
    return {"metric": {"__name__": name, "gpu": str(gpu), "UUID": uuid, "pci_bus_id": "00000000:3B:00.0",
                       "device": f"nvidia{gpu}", "modelName": "NVIDIA H100 80GB HBM3", host_label: "gpu-node-1",
                       "DCGM_FI_DRIVER_VERSION": "550.54.15", "instance": "127.0.0.1:38179", "job": "dcgm"},
            "values": [[ts, str(v)] for ts, v in points]}


def vllm_series(name, points, instance="127.0.0.1:8000"):
    return {"metric": {"__name__": name, "engine": "0", "model_name": "smollm2", "instance": instance,
                       "job": "vllm"}, "values": [[ts, str(v)] for ts, v in points]}


def answer(*series):
    return {"status": "success", "data": {"resultType": "matrix", "result": list(series)}}


CANNED = answer(
    # GPU 0: 70000 MiB before the cell (the previous cell's peak: must not count), 4845 then 5000 inside, 9000 after
    dcgm_series("DCGM_FI_DEV_FB_USED", 0, "GPU-aaaa", [(T0 - 1.2, 70000), (T0 + 0.19, 4845), (T0 + 1.19, 5000),
                                                         (T0 + 2.6, 9000)]),
    dcgm_series("DCGM_FI_DEV_FB_USED", 1, "GPU-bbbb", [(T0 + 0.19, 100), (T0 + 1.19, 120)], host_label="hostname"),
    dcgm_series("DCGM_FI_DEV_FB_FREE", 0, "GPU-aaaa", [(T0 + 0.19, 76714)]),
    vllm_series("vllm:kv_cache_usage_perc", [(T0 - 0.5, 0.9), (T0 + 0.5, 0.25), (T0 + 1.5, 0.5), (T0 + 2.8, 0.95)]),
    vllm_series("vllm:num_requests_running", [(T0 + 0.5, 2), (T0 + 1.5, 1)]),
    vllm_series("vllm:num_requests_waiting", [(T0 + 0.5, 0), (T0 + 1.5, 3)]),
    # preemptions: 5 before the cell, 7 then (engine restarted) 1 inside: 2 + 1 during the cell
    vllm_series("vllm:num_preemptions_total", [(T0 - 0.5, 5), (T0 + 0.5, 7), (T0 + 1.5, 1)]),
    vllm_series("vllm:kv_cache_usage_perc", [(T0 + 0.7, 0.125)], instance="127.0.0.1:8001"),
)


def test_parse_and_figures_of_the_cell_window_only():
    series = parse_matrix(json.loads(json.dumps(CANNED)))
    assert len(series) == 8 and series[0].name == "DCGM_FI_DEV_FB_USED" and series[0].points[1] == (T0 + 0.19, 4845.0)
    f = cell_figures(series, T0, T0 + 2.0)
    assert [(d["device"], d["gpu"], d["hostname"], d["used_peak_bytes"]) for d in f["prom_gpu_devices"]] == [
        ("GPU-aaaa", "0", "gpu-node-1", 5000 * MIB), ("GPU-bbbb", "1", "gpu-node-1", 120 * MIB)]
    assert f["prom_gpu_used_peak_bytes"] == 5000 * MIB  # not the 70000 MiB before the cell, nor 9000 after
    assert f["prom_kv_usage_peak"] == 0.5 and f["prom_engines"] == [
        {"instance": "127.0.0.1:8000", "kv_usage_peak": 0.5, "requests_running_peak": 2, "requests_waiting_peak": 3},
        {"instance": "127.0.0.1:8001", "kv_usage_peak": 0.125, "requests_running_peak": None,
         "requests_waiting_peak": None}]
    assert f["prom_requests_running_peak"] == 2 and f["prom_requests_waiting_peak"] == 3
    assert f["prom_preemptions"] == 3  # 5 -> 7 (+2), then a reset to 1 (+1)
    assert f["prom_samples"] == 14  # inside the window only


def test_samples_on_the_cells_time_axis():
    series = parse_matrix(CANNED)
    frame = samples_frame(series, T0 - 0.25, T0, T0 + 2.0)  # the cell's t_s=0 a quarter second before T0
    used = frame[(frame.metric == "gpu_used") & (frame.UUID == "GPU-aaaa")]
    assert list(used.t_s.round(6)) == [0.44, 1.44] and list(used.value) == [4845 * MIB, 5000 * MIB]
    assert set(frame.unit[frame.metric == "gpu_used"]) == {"bytes"}
    assert set(frame.hostname.dropna()) == {"gpu-node-1"}  # Hostname (released) and hostname (renamed) alike
    kv = frame[frame.metric == "kv_usage"]
    assert list(kv.value) == [0.25, 0.125, 0.5] and list(kv.source_metric.unique()) == ["vllm:kv_cache_usage_perc"]
    assert frame.t_s.is_monotonic_increasing and list(frame.columns) == telemetry.SAMPLE_COLUMNS


def test_error_answers_and_selectors():
    with pytest.raises(TelemetryError, match="bad_data"):
        parse_matrix({"status": "error", "errorType": "bad_data", "error": "parse error at char 3"})
    with pytest.raises(TelemetryError, match="matrix"):
        parse_matrix({"status": "success", "data": {"resultType": "vector", "result": []}})
    assert telemetry.selector_matchers('{job="vllm", namespace=~"llm.*"}') == 'job="vllm", namespace=~"llm.*"'
    assert telemetry.selector_matchers("") == ""
    for bad in ('job="vllm"', '{job=vllm}', '{job="a" gpu="0"}', '{job="a"} or up'):
        with pytest.raises(ValueError):
            telemetry.selector_matchers(bad)
    q = telemetry.series_query(["vllm:kv_cache_usage_perc", "vllm:num_requests_running"], 'job="vllm"')
    assert q == '{__name__=~"vllm:kv_cache_usage_perc|vllm:num_requests_running",job="vllm"}'


def test_an_unreachable_prometheus_is_not_measured_and_says_why():
    prom = Prometheus(f"http://127.0.0.1:{free_port()}", settle_s=0.1, timeout_s=1.0)
    t = time.perf_counter()
    cell = prom.cell(t - 1.0, t)
    assert cell.figures["prom_source"].startswith("not measured: http://127.0.0.1:") and "ConnectError" in \
        cell.figures["prom_source"]
    assert cell.samples.empty and abs(cell.figures["t_cell_start_unix"] - (time.time() - 1.0)) < 0.5


def test_the_wait_after_a_cell_follows_the_scrape_interval():
    """A cluster scraping every 15 s: after the cell kvbench waits up to 1.5 intervals + 1 s for the series'
    next scrape (read from the targets API), and says so when it does not come."""
    import httpx as _httpx

    assert telemetry.parse_duration("15s") == 15 and telemetry.parse_duration("1m30s") == 90
    assert telemetry.parse_duration("500ms") == 0.5 and telemetry.parse_duration("soon") is None
    targets = {"status": "success", "data": {"activeTargets": [
        {"labels": {"job": "vllm", "instance": "a:8000"}, "scrapeInterval": "15s", "health": "up"},
        {"labels": {"job": "dcgm", "instance": "n:9400"}, "scrapeInterval": "30s", "health": "up"}]}}
    old = [dcgm_series("DCGM_FI_DEV_FB_USED", 0, "GPU-aaaa", [(T0 + 0.5, 100)])]
    old[0]["metric"]["job"] = "vllm"

    def handler(request):
        if request.url.path == "/api/v1/targets":
            return _httpx.Response(200, json=targets)
        return _httpx.Response(200, json=answer(*old) if "FB_USED" in request.url.params["query"] else answer())

    prom = Prometheus("http://prom:9090")
    prom._http = _httpx.Client(transport=_httpx.MockTransport(handler))
    series = parse_matrix(answer(*old))
    assert prom.settle_for(series) == 1.5 * 15 + 1  # the vllm job's interval, not dcgm's (no series of it)
    prom.settle_s = 0.3  # given: used as is
    got, note = prom.read(T0, T0 + 2.0)
    assert len(got) == 1 and "1 series without a scrape after the cell's end within 0.3 s" in note


def test_credentials_in_the_prometheus_url_stay_out_of_the_row():
    prom = Prometheus(f"http://kvbench:s3cret@127.0.0.1:{free_port()}", '{job="vllm"}', settle_s=0.1, timeout_s=1.0)
    t = time.perf_counter()
    source = prom.cell(t - 1.0, t).figures["prom_source"]
    assert "s3cret" not in source and "kvbench:" not in source and '{job="vllm"}' in source


def test_wall_clock_offset_maps_perf_counter_to_unix_time():
    offset = telemetry.wall_clock_offset()
    assert abs(time.perf_counter() + offset - time.time()) < 0.005


# --- a real Prometheus ---------------------------------------------------------------------------------

def prometheus_binary() -> str:
    """Debian's prometheus (the Makefile's `prometheus` target installs it); a skip that says so otherwise."""
    found = shutil.which("prometheus")
    if not found:
        pytest.skip("no prometheus executable: `make prometheus` installs Debian's package (apt-get install "
                    "prometheus); it could not be installed on this machine")
    return found


class RealPrometheus:
    """Prometheus on 127.0.0.1, scraping ``targets`` ({job: "host:port"}) every second."""

    def __init__(self, tmp: Path, targets: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n"
                       for job, addr in targets.items())
        (tmp / "prometheus.yml").write_text(f"global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n{jobs}")
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen([prometheus_binary(), f"--config.file={tmp / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        self.jobs = set(targets)

    def wait_scraped(self, timeout_s: float = 30.0) -> None:
        """Until every target was scraped and is up (Prometheus sends its first scrapes about 5 s after start)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                targets = httpx.get(self.url + "/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError, KeyError):
                targets = []
            up = {t["labels"]["job"] for t in targets if t["health"] == "up"}
            if up >= self.jobs:
                return
            time.sleep(0.2)
        raise AssertionError(f"Prometheus did not scrape {self.jobs} within {timeout_s} s:\n"
                             f"{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_real_prometheus_scraping_the_dcgm_stand_in(tmp_path):
    """The GPU figures through a real Prometheus equal what the stand-in served inside the window."""
    gpus = [GPU(0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "00000000:3B:00.0"),
            GPU(1, "GPU-1b2c3d4e-0000-1111-2222-333344445555", "00000000:5E:00.0", fb_used=20_480)]
    with FakeDCGMExporter(gpus) as dcgm:
        dcgm.used_by_scrape[0] = lambda n: 4000 + 10 * n  # rises by 10 MiB a scrape: the window's last one is its peak
        prom = RealPrometheus(tmp_path, {"dcgm": f"127.0.0.1:{dcgm.port}"})
        try:
            prom.wait_scraped()
            t0 = time.perf_counter()
            time.sleep(3.0)
            t1 = time.perf_counter()
            cell = Prometheus(prom.url, '{job="dcgm"}').cell(t0, t1)
        finally:
            prom.stop()
    start, end = cell.figures["t_cell_start_unix"], cell.figures["t_cell_start_unix"] + (t1 - t0)
    # Prometheus stamps a sample when its scrape starts, the stand-in when it answers: a scrape at an edge of
    # the window can fall on either side of it, so each sample is paired with the scrape answered nearest it.
    used0 = cell.samples[(cell.samples.metric == "gpu_used") & (cell.samples.gpu == "0")]
    assert len(used0) >= 2
    paired = []
    for t_s, value in zip(used0.t_s, used0.value):
        assert 0 <= t_s <= t1 - t0
        t_served, used = min(dcgm.scrapes, key=lambda scrape: abs(scrape[0] - (start + t_s)))
        assert abs(t_served - (start + t_s)) < 0.25 and value == used[0] * MIB
        paired.append(t_served)
    inside = [t for t, _ in dcgm.scrapes if start + 0.25 <= t <= end - 0.25]
    assert set(inside) <= set(paired), "a scrape well inside the cell is missing from its samples"
    by_device = {d["device"]: d["used_peak_bytes"] for d in cell.figures["prom_gpu_devices"]}
    assert by_device == {gpus[0].uuid: max(used0.value), gpus[1].uuid: 20_480 * MIB}
    assert {d["model"] for d in cell.figures["prom_gpu_devices"]} == {"NVIDIA H100 80GB HBM3"}
    assert cell.figures["prom_gpu_used_peak_bytes"] == 20_480 * MIB
    assert cell.figures["prom_kv_usage_peak"] is None and "DCGM_FI_DEV_FB_USED" in cell.figures["prom_source"]
    assert set(cell.samples.metric) == {"gpu_used", "gpu_free", "gpu_reserved"}
    assert isinstance(cell.samples, pd.DataFrame)


# --- kvbench run --prometheus ------------------------------------------------------------------------------

def run_kvbench(tmp_path, workload, backend: str, prom_url: str, selector: str, load_workers: int = 1):
    import io

    from rich.console import Console

    from kvbench.run.backend_config import BackendConfig
    from kvbench.run.runner import Runner, RunOptions
    from kvbench.store.readers import load_cells

    opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse(backend)],
                      results_dir=tmp_path / "runs", run_id="run", start_timeout_s=300, request_timeout_s=300,
                      load_workers=load_workers, prometheus=Prometheus(prom_url, selector), estimate=False)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir)


def test_kvbench_run_reads_prometheus_into_the_row_and_telemetry_csv(tmp_path):
    """The runner's integration without an engine: the fake OpenAI server, two load workers, a real
    Prometheus scraping the DCGM stand-in: the row's GPU figures, the samples file, and the Parquet copy."""
    from kvbench.store.readers import load
    from kvbench.workloads import Workload
    from tests.fakes.openai_server import FakeOpenAI

    gpus = [GPU(0, "GPU-aaaa0000-0000-0000-0000-000000000000", "00000000:3B:00.0"),
            GPU(1, "GPU-bbbb0000-0000-0000-0000-000000000000", "00000000:5E:00.0", fb_used=30_000)]
    wl = Workload(name="prom", seed=3, prompt_tokens=[32], output_tokens=200, concurrency=[2], rounds=2,
                  warmup_requests=0)
    with FakeDCGMExporter(gpus) as dcgm, FakeOpenAI(token_delay_s=0.01) as fake:  # 200 tokens: 2 s a request
        dcgm.used_by_scrape[0] = lambda n: 1000 + n
        prom = RealPrometheus(tmp_path, {"dcgm": f"127.0.0.1:{dcgm.port}"})
        try:
            prom.wait_scraped()
            run_dir, cells = run_kvbench(tmp_path, wl, f"openai:url={fake.url}", prom.url, '{job="dcgm"}', 2)
        finally:
            prom.stop()
    (row,) = cells.itertuples()
    assert row.status in ("ok", "flagged") and row.n_requests == 4, row.error
    assert row.prom_samples > 0 and row.prom_source.endswith("from " + prom.url + ' {job="dcgm"}'), row.prom_source
    devices = {d["device"]: d["used_peak_bytes"] for d in row.prom_gpu_devices}
    assert devices[gpus[1].uuid] == 30_000 * MIB and row.prom_gpu_used_peak_bytes == 30_000 * MIB
    samples = pd.read_csv(run_dir / "telemetry" / f"{row.cell_id}.csv")
    assert set(samples.metric) == {"gpu_used", "gpu_free", "gpu_reserved"} and len(samples) == row.prom_samples
    reqs = pd.read_json(run_dir / "requests.jsonl", lines=True)
    assert samples.t_s.between(0, reqs.t_done.max() - row.t_cell_start + 0.5).all()
    # GPU 0 rose by 1 MiB a scrape: the cell's samples are consecutive scrapes, none missed, each at the
    # time (on the cell's axis) and with the value the stand-in served it, and the row's peak is the last.
    # The value names the scrape; its time is Prometheus's start of the scrape, which the stand-in answers
    # later by however long the busy cores kept either waiting (over 0.05 s once, in a full suite): a quarter of
    # the 1 s interval still tells a right time axis from one off by a scrape or by the wait before the cell
    used0 = samples[(samples.metric == "gpu_used") & (samples.gpu == 0)]
    values = [int(v // MIB) for v in used0.value]
    assert len(values) >= 2 and values == list(range(values[0], values[0] + len(values)))
    for t_s, value in zip(used0.t_s, values):
        assert any(abs(row.t_cell_start_unix + t_s - t) < 0.25 and used[0] == value for t, used in dcgm.scrapes)
    assert devices[gpus[0].uuid] == values[-1] * MIB
    parquet = load(run_dir)  # the Parquet copy keeps the list of dicts as written
    assert parquet.prom_gpu_devices.iloc[0] == row.prom_gpu_devices


def test_the_cli_flags_reach_the_run(tmp_path):
    """`kvbench run --prometheus ... --load-workers 2` end to end through the CLI: a selector that is not label
    matchers is refused before anything runs; an unreachable Prometheus leaves the cell measured and its
    Prometheus figures "not measured", saying why."""
    import os
    import subprocess
    import sys

    from kvbench.store.readers import load_cells
    from tests.fakes.openai_server import FakeOpenAI

    def kvbench(*args):
        return subprocess.run([sys.executable, "-m", "kvbench.cli", "run", *args], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env={**os.environ, "COLUMNS": "300"})

    dead = f"http://127.0.0.1:{free_port()}"
    bad = kvbench("-b", "openai:url=http://127.0.0.1:9", "--prometheus", dead, "--prometheus-selector", 'job="x"',
                  "--results-dir", str(tmp_path))
    assert bad.returncode == 2 and "label matchers in braces" in bad.stdout + bad.stderr
    (tmp_path / "tiny.toml").write_text('name = "tiny"\nseed = 1\nprompt_tokens = [16]\noutput_tokens = 4\n'
                                        'concurrency = [2]\nrounds = 2\nwarmup_requests = 0\n')
    with FakeOpenAI() as fake:
        done = kvbench("-b", f"openai:url={fake.url}", "--workload", str(tmp_path / "tiny.toml"), "--load-workers", "2",
                       "--prometheus", dead, "--results-dir", str(tmp_path), "--run-id", "r", "--no-report")
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = load_cells(tmp_path / "r").itertuples()
    assert row.status == "ok" and row.n_ok == 4 and row.max_in_flight <= 2
    assert row.prom_source.startswith(f"not measured: {dead}: ConnectError") and row.prom_samples == 0
    assert row.prom_gpu_used_peak_bytes is None or pd.isna(row.prom_gpu_used_peak_bytes)
    assert not (tmp_path / "r" / "telemetry").exists()  # no samples, no file
