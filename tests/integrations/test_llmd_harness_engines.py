"""kvbench's llm-d-benchmark harness against a real engine: a llama-server on the embedded model stands in for
the stack's model server, the harness script runs with the environment llm-d-benchmark's harness pod gives it,
on a profile rendered from the shipped templates, and every output is checked: kvbench's exit status as the
script's, stdout.log and stderr.log, run_metadata.yaml, the Benchmark Reports (the llmd-benchmark-report
package's own loader and validators) and the analyzer, after a failed try and on its retry in the same folder.
(A SIGTERM passed on to kvbench: test_llmd_harness.py, against an endpoint that never answers.)"""
from __future__ import annotations

import socket
import time
import uuid

import pandas as pd
import pytest
from llmd_benchmark_report import BenchmarkReportV02, import_benchmark_report

from kvbench.integrations import llmd_harness as harness
from kvbench.integrations.llmd_profile import RUNS_FOLDER
from kvbench.reports import benchmark_report as br

from tests.helpers import engine_env
from tests.integrations.llmd import (ANALYZER_SCRIPT, EXPERIMENT_ID, HARNESS_SCRIPT, POD_UID, metadata,
                                     pod_environment, report_files, run_script, workspace_with)

pytestmark = pytest.mark.engine
MAX_MODEL_LEN = 1024  # the server's context per sequence: what llm-d-benchmark renders for maxModelLen


@pytest.fixture(scope="module")
def llama_server(smollm2, tmp_path_factory):
    """One llama-server for the module, two sequences of 1,024 tokens (the sanity profile's concurrency 2)."""
    from kvbench.backends.llamacpp.adapter import LlamaCppBackend
    from kvbench.backends.types import ServerSpec

    server = LlamaCppBackend(LlamaCppBackend.default_version, engine_env("llamacpp"))
    server.start(ServerSpec(model=smollm2, max_context=MAX_MODEL_LEN, max_concurrency=2, kv_dtype="auto"),
                 tmp_path_factory.mktemp("server") / "llama.log", 120)
    try:
        yield server
    finally:
        server.stop()
    assert not server.alive()


def values(endpoint: str) -> dict[str, str]:
    return {"LLMDBENCH_DEPLOY_CURRENT_MODEL": "smollm2", "LLMDBENCH_DEPLOY_CURRENT_TOKENIZER": "smollm2",
            "LLMDBENCH_HARNESS_STACK_ENDPOINT_URL": endpoint, "LLMDBENCH_DEPLOY_CURRENT_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_try_then_the_sanity_profile_on_its_retry(llama_server, tmp_path):
    """llm-d-benchmark retries a failed harness in the same results folder. The first try finds no server:
    every cell fails, kvbench exits 1 and so does the script; its reports say the engine was unhealthy and
    validate. The retry runs the default profile with a treatment's overrides (the engine named: the stand-in
    server is no vLLM; one prompt length and 8 output tokens, to keep the suite's time) in a run folder of its
    own: exit 0; kvbench's output in stdout.log after the first try's; run_metadata.yaml with llm-d-benchmark's
    keys; one Benchmark Report per cell, each loaded and validated by the package from its file, carrying the
    experiment, the pod and kvbench's figures, its request counts those of requests.jsonl, the first try's
    reports gone (cells this try did not make again); the analyzer passes them."""
    results = tmp_path / "requests" / f"{EXPERIMENT_ID}_1"
    nowhere = f"http://127.0.0.1:{closed_port()}"
    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values(nowhere), {"engine": "llamacpp"})
    env = pod_environment(results, workspace, name)
    failed = run_script(HARNESS_SCRIPT, env)
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    meta = metadata(results)
    first_try = [p.name for p in report_files(results)]
    assert meta["harness_rc"] == "1" and meta["benchmark_reports"] == first_try and len(first_try) == 4
    for path in report_files(results):
        report = import_benchmark_report(str(path))
        assert report.results.component_health[0].replica_health[0].healthy is False
        assert report.results.request_performance is None
    assert run_script(ANALYZER_SCRIPT, env).returncode == 0  # failed cells, valid reports

    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values(llama_server.base_url),
                                     {"engine": "llamacpp", "workload.prompt_tokens": [128],
                                      "workload.output_tokens": 8})
    started = time.time()
    done = run_script(HARNESS_SCRIPT, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    stdout_log = (results / "stdout.log").read_text()
    assert stdout_log == failed.stdout + done.stdout  # all of it, appended, as the pod's own output showed it
    assert stdout_log.count("kvbench-harness: running ") == 2 and "--max-context 1024" in done.stdout
    assert "results: " in done.stdout and "kvbench-harness: kvbench run exited 0" in done.stdout
    assert (results / "stderr.log").read_text() == failed.stderr + done.stderr
    assert (results / name).read_text() == (workspace / "profiles" / "kvbench" / name).read_text()
    assert sorted(p.name for p in (results / RUNS_FOLDER).iterdir()) == [
        f"{EXPERIMENT_ID}_1", f"{EXPERIMENT_ID}_1_try2"]

    meta = metadata(results)
    run_dir = results / RUNS_FOLDER / f"{EXPERIMENT_ID}_1_try2"
    assert meta["harness_rc"] == "0" and meta["harness_name"] == "kvbench" and meta["harness_workload"] == name
    assert meta["experiment_id"] == EXPERIMENT_ID and meta["model"] == "smollm2"
    assert meta["endpoint_url"] == llama_server.base_url and meta["namespace"] == "llmdbench"
    assert meta["harness_version"] == harness.kvbench_version() != "unknown"
    assert meta["kvbench_run"] == f"{RUNS_FOLDER}/{run_dir.name}"
    assert meta["harness_args"].startswith(f"run --backend llamacpp:url={llama_server.base_url} --model smollm2 ")
    start, stop = (pd.Timestamp(meta[k]).timestamp() for k in ("harness_start", "harness_stop"))
    assert started - 1 <= start <= stop <= time.time() + 1
    assert abs(float(meta["harness_delta"][2:-1]) - (stop - start)) <= 1.0

    cells = pd.read_json(run_dir / "cells.jsonl", lines=True)
    assert len(cells) == 2 and (cells.status == "ok").all(), cells[["cell_id", "status", "error"]].to_string()
    requests = pd.read_json(run_dir / "requests.jsonl", lines=True)
    files = report_files(results)
    assert [p.name for p in files] == meta["benchmark_reports"] == sorted(br.file_name(c) for c in cells.cell_id)
    # the first try's cells were another backend's (its label names its endpoint): their reports removed
    assert not set(first_try) & set(meta["benchmark_reports"]) and not any((results / n).exists() for n in first_try)
    stages = set()
    for path in files:
        report = import_benchmark_report(str(path))  # the package's own file loader: version detected, validated
        assert isinstance(report, BenchmarkReportV02)
        cell_id = path.name[len(br.FILE_PREFIX):-len(".yaml")]
        assert report.run.eid == str(uuid.uuid5(uuid.NAMESPACE_URL, EXPERIMENT_ID))
        assert (report.run.pid, report.run.keywords) == (POD_UID, ["kvbench", "ci"])
        engine = report.scenario.stack[0].standardized
        assert (engine.tool, engine.model.name) == ("llamacpp", "smollm2")
        load = report.scenario.load.standardized
        assert load.tool == "kvbench" and (load.input_seq_len.value, load.output_seq_len.value) == (128, 8)
        stages.add(load.stage)
        sent = requests[(requests.cell_id == cell_id) & ~requests.warmup]
        aggregate = report.results.request_performance.aggregate
        assert aggregate.requests.total == len(sent) == load.concurrency and aggregate.requests.failures == 0
        assert aggregate.latency.time_to_first_token.p50 > 0
        assert report.results.component_health[0].replica_health[0].healthy
        kv = report.results.observability.model_extra[br.KV_KEY]
        # 8-token requests can finish between two /slots polls: then the row says so instead of a zero
        assert kv.get("peak_bytes_in_use", 0) > 0 or kv["in_use_source"].startswith("not measured: none of "), kv
    assert stages == {0, 1}

    analyzed = run_script(ANALYZER_SCRIPT, env)
    assert analyzed.returncode == 0, analyzed.stderr
    assert analyzed.stdout.count("valid Benchmark Report v0.2") == 2
