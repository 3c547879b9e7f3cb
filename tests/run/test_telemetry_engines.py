"""Telemetry from Prometheus against real vLLM CPU servers: one server beside kvbench's own poll, and a
deployment of two replicas scraped with a DCGM stand-in. Unit tests of the telemetry: tests/run/test_telemetry.py.

Tests that start a real engine live in modules named *_engines.py: tests/conftest.py runs them on one xdist
worker, one after another."""
from __future__ import annotations

import pandas as pd
import pytest

from kvbench.run.telemetry import MIB
from tests.fakes.dcgm_exporter import GPU, FakeDCGMExporter
from tests.run.test_telemetry import RealPrometheus, run_kvbench


@pytest.mark.engine
def test_vllm_through_prometheus_beside_kvbenchs_own_poll(tmp_path, smollm2):
    """A real vLLM CPU server (started by the adapter, attached by URL as a cluster's server would be) and
    the DCGM stand-in, both scraped every second by a real Prometheus; `kvbench run --prometheus` reads
    them back: the row's GPU figures are what the stand-in served, and vLLM's KV usage seen through
    Prometheus is above zero and, as kvbench's own 10 Hz poll of the same gauge, within what the requests hold."""
    from kvbench.backends.types import ServerSpec
    from kvbench.backends.vllm.adapter import VLLMBackend
    from kvbench.workloads import Workload
    from tests.helpers import engine_env

    # one process: about 20 s a start instead of 38; its /metrics are the same code's
    server = VLLMBackend(VLLMBackend.default_version, engine_env("vllm"), {"single_process": True})
    server.start(ServerSpec(model=smollm2, max_context=512, max_concurrency=2, kv_dtype="auto"),
                 tmp_path / "vllm.log", 300)
    gpus = [GPU(0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "00000000:3B:00.0", fb_used=61_440),
            GPU(1, "GPU-1b2c3d4e-0000-1111-2222-333344445555", "00000000:5E:00.0", fb_used=1_024)]
    # 256-token prompts, 96 tokens out, two at a time, twice: several seconds of decoding per cell
    wl = Workload(name="prom-vllm", seed=11, prompt_tokens=[256], output_tokens=96, concurrency=[2], rounds=2,
                  warmup_requests=1, warmup_prompt_tokens=32)
    try:
        with FakeDCGMExporter(gpus) as dcgm:
            prom = RealPrometheus(tmp_path, {"dcgm": f"127.0.0.1:{dcgm.port}",
                                             "vllm": server.base_url.split("//")[1]})
            try:
                prom.wait_scraped(60)
                run_dir, cells = run_kvbench(tmp_path, wl, f"vllm:url={server.base_url}", prom.url,
                                             '{job=~"vllm|dcgm"}', load_workers=2)
            finally:
                prom.stop()
    finally:
        server.stop()
    (row,) = cells.itertuples()
    assert row.status == "ok" and row.attached, (row.error, row.flags)
    assert row.wall_s > 2.0, "the cell must span several scrapes"
    # the GPU figures are exactly what the stand-in served, per device and on the fullest one
    assert [(d["device"], d["used_peak_bytes"]) for d in row.prom_gpu_devices] == [
        (gpus[0].uuid, 61_440 * MIB), (gpus[1].uuid, 1_024 * MIB)]
    assert row.prom_gpu_used_peak_bytes == 61_440 * MIB
    # vLLM's own gauge, through Prometheus: above zero during the cell, on vLLM's block grid, and within what
    # two requests of 256 + 95 cached tokens can hold (3 blocks each), as kvbench's own poll of the same gauge is.
    # Which of the two saw more is the machine's timing, not a fault: on a busy machine the harness's 10 Hz poll
    # has missed the moment Prometheus' 1 s scrape caught (6 blocks against 3, beside a CPU hog).
    block = 128
    blocks_total = row.kv_pool_tokens_engine // block
    most = 2 * -(-(256 + 96 - 1) // block) * block
    assert row.prom_kv_usage_peak > 0, row.prom_source
    blocks = row.prom_kv_usage_peak * (blocks_total - 1)
    assert abs(blocks - round(blocks)) < 1e-6
    assert 1 <= round(blocks) * block <= most and 1 <= row.kv_in_use_peak_tokens <= most, (
        row.prom_kv_usage_peak, row.kv_in_use_peak_tokens)
    assert 1 <= row.prom_requests_running_peak <= 2 and row.prom_preemptions == 0
    (engine,) = row.prom_engines
    assert engine["instance"] == server.base_url.split("//")[1] and engine["kv_usage_peak"] == row.prom_kv_usage_peak
    reqs = pd.read_json(run_dir / "requests.jsonl", lines=True)
    reqs = reqs[~reqs.warmup]
    assert len(reqs) == 4 and reqs.error.isna().all()
    first_sent, last_done = reqs.t_sent.min() - row.t_cell_start, reqs.t_done.max() - row.t_cell_start
    samples = pd.read_csv(run_dir / "telemetry" / f"{row.cell_id}.csv")
    kv = samples[samples.metric == "kv_usage"]
    # the cell's window: from its start (before the two load workers were spawned) to its last request's end
    assert len(kv) >= 2 and kv.t_s.between(0, last_done + 0.5).all() and (kv.value > 0).any()
    # the samples that saw KV in use, placed on the cell's axis, fall while kvbench's requests were in flight
    busy = kv[kv.value > 0]
    assert busy.t_s.between(first_sent - 0.5, last_done + 0.5).all(), (busy.t_s.tolist(), first_sent, last_done)


@pytest.mark.engine
def test_a_deployment_of_two_vllm_replicas_with_prometheus_and_dcgm(tmp_path, smollm2):
    """The issue's whole picture: two real vLLM CPU replicas attached as one deployment, a real Prometheus
    scraping both and the DCGM stand-in, `kvbench run --prometheus --load-workers 2`: the rows per replica
    and in total, each replica's KV through Prometheus beside its own poll, the GPUs as served, and the
    report's KV table per replica and in total."""
    from kvbench import reports
    from kvbench.backends.types import ServerSpec
    from kvbench.backends.vllm.adapter import VLLMBackend
    from kvbench.store.readers import load
    from kvbench.workloads import Workload
    from tests.helpers import engine_env

    env = engine_env("vllm")
    servers = [VLLMBackend(VLLMBackend.default_version, env, {"single_process": True}) for _ in range(2)]
    gpus = [GPU(0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "00000000:3B:00.0", fb_used=70_123),
            GPU(1, "GPU-1b2c3d4e-0000-1111-2222-333344445555", "00000000:5E:00.0", fb_used=69_001)]
    # 260-token prompts hold their third 128-token block from the prefill on, so a request's peak lasts its
    # whole decode
    wl = Workload(name="deploy-prom", seed=5, prompt_tokens=[260], output_tokens=64, concurrency=[4], rounds=1,
                  warmup_requests=2, warmup_prompt_tokens=32)
    try:
        for i, server in enumerate(servers):  # from this thread: see tests/backends/test_deployment.py
            server.start(ServerSpec(model=smollm2, max_context=512, max_concurrency=3, kv_dtype="auto"),
                         tmp_path / f"vllm{i}.log", 300)
        labels = [s.base_url.split("//")[1] for s in servers]
        with FakeDCGMExporter(gpus) as dcgm:
            prom = RealPrometheus(tmp_path, {"dcgm": f"127.0.0.1:{dcgm.port}", "vllm": labels[0], "vllm2": labels[1]})
            try:
                prom.wait_scraped(60)
                run_dir, _ = run_kvbench(tmp_path, wl, f"vllm:url={servers[0].base_url},url={servers[1].base_url}",
                                         prom.url, "", load_workers=2)
            finally:
                prom.stop()
        assert all(s.alive() for s in servers)
    finally:
        for server in servers:
            server.stop()
    cells = load(run_dir)
    assert list(cells.replica) == ["", *labels]
    assert (cells.status == "ok").all(), cells[["cell_id", "status", "error", "flags"]].to_string()
    total, r0, r1 = (cells.iloc[i] for i in range(3))
    assert (r0.n_ok, r1.n_ok, total.n_ok) == (2, 2, 4)  # round-robin over both replicas, from two workers
    # each replica's pool read from its own /metrics; the deployment's pool and KV boundary are their sums
    assert r0.kv_pool_tokens_engine == r1.kv_pool_tokens_engine > 0
    assert total.kv_pool_tokens_engine == r0.kv_pool_tokens_engine + r1.kv_pool_tokens_engine
    assert total.kv_pool_sequences_predicted == r0.kv_pool_sequences_predicted + r1.kv_pool_sequences_predicted > 0
    assert total.prom_gpu_used_peak_bytes == 70_123 * MIB
    assert [(d["device"], d["used_peak_bytes"]) for d in total.prom_gpu_devices] == [
        (gpus[0].uuid, 70_123 * MIB), (gpus[1].uuid, 69_001 * MIB)]
    engines = {e["instance"]: e for e in total.prom_engines}
    assert set(engines) == set(labels)
    most = 2 * -(-(260 + 64 - 1) // 128) * 128  # a replica's two requests, 3 blocks each
    for label, replica in zip(labels, (r0, r1)):  # each replica's gauge through Prometheus beside its own poll
        usage = engines[label]["kv_usage_peak"]
        blocks = usage * (replica.kv_pool_tokens_engine // 128 - 1)
        assert usage > 0 and abs(blocks - round(blocks)) < 1e-6, (label, usage)
        # both within what its requests hold: which saw more is the machine's timing (the single server's test)
        assert round(blocks) * 128 <= most and 1 <= replica.kv_in_use_peak_tokens <= most, (
            label, usage, replica.kv_in_use_peak_tokens)
    assert total.prom_kv_usage_peak == max(e["kv_usage_peak"] for e in engines.values())
    samples = pd.read_csv(run_dir / "telemetry" / f"{total.cell_id}.csv")
    assert set(samples.instance[samples.metric == "kv_usage"]) == set(labels)
    _, _, text = reports.write([run_dir], output=run_dir / "report.md", plots=False)
    kv_section = text.split("## KV cache")[1].split("\n## ")[0]
    rows = [line for line in kv_section.splitlines() if line.startswith("| vllm@")]
    assert "| total (2 replicas) |" in rows[0] and f"| {labels[0]} |" in rows[1] and f"| {labels[1]} |" in rows[2]
