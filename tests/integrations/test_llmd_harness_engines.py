"""kvbench's llm-d-benchmark harness against a real engine: a llama-server on the embedded model stands in for
the stack's model server, the harness script runs with the environment llm-d-benchmark's harness pod gives it,
on a profile rendered from the shipped templates, and every output is checked: kvbench's exit status as the
script's, stdout.log and stderr.log, run_metadata.yaml, the Benchmark Reports (the llmd-benchmark-report
package's own loader and validators) and the analyzer; a failed try then a retry in the same folder; a SIGTERM
passed on to kvbench."""
from __future__ import annotations

import signal
import socket
import subprocess
import time
import uuid

import pandas as pd
import pytest
from llmd_benchmark_report import BenchmarkReportV02, import_benchmark_report

from kvbench.integrations import llmd_harness as harness
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


def test_the_sanity_profile_against_a_running_engine(llama_server, tmp_path):
    """The default profile as shipped (the engine named: the stand-in server is no vLLM): exit 0; kvbench's
    output in stdout.log; run_metadata.yaml with llm-d-benchmark's keys; one Benchmark Report per cell, each
    loaded and validated by the package from its file, carrying the experiment, the pod and kvbench's
    figures, its request counts those of requests.jsonl; the analyzer passes them."""
    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values(llama_server.base_url),
                                     {"engine": "llamacpp"})
    results = tmp_path / "requests" / f"{EXPERIMENT_ID}_1"
    env = pod_environment(results, workspace, name)
    started = time.time()
    done = run_script(HARNESS_SCRIPT, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    stdout_log = (results / "stdout.log").read_text()
    assert stdout_log == done.stdout  # all of it, as the pod's own output showed it
    assert "kvbench-harness: running " in stdout_log and "--max-context 1024" in stdout_log
    assert "results: " in stdout_log and "kvbench-harness: kvbench run exited 0" in stdout_log
    assert (results / "stderr.log").read_text() == done.stderr
    assert (results / name).read_text() == (workspace / "profiles" / "kvbench" / name).read_text()

    meta = metadata(results)
    run_dir = results / harness.RUNS_FOLDER / f"{EXPERIMENT_ID}_1"
    assert meta["harness_rc"] == "0" and meta["harness_name"] == "kvbench" and meta["harness_workload"] == name
    assert meta["experiment_id"] == EXPERIMENT_ID and meta["model"] == "smollm2"
    assert meta["endpoint_url"] == llama_server.base_url and meta["namespace"] == "llmdbench"
    assert meta["harness_version"] == harness.kvbench_version() != "unknown"
    assert meta["kvbench_run"] == f"{harness.RUNS_FOLDER}/{EXPERIMENT_ID}_1"
    assert meta["harness_args"].startswith(f"run --backend llamacpp:url={llama_server.base_url} --model smollm2 ")
    start, stop = (pd.Timestamp(meta[k]).timestamp() for k in ("harness_start", "harness_stop"))
    assert started - 1 <= start <= stop <= time.time() + 1
    assert abs(float(meta["harness_delta"][2:-1]) - (stop - start)) <= 1.0

    cells = pd.read_json(run_dir / "cells.jsonl", lines=True)
    assert len(cells) == 4 and (cells.status == "ok").all(), cells[["cell_id", "status", "error"]].to_string()
    requests = pd.read_json(run_dir / "requests.jsonl", lines=True)
    files = report_files(results)
    assert [p.name for p in files] == meta["benchmark_reports"] == sorted(br.file_name(c) for c in cells.cell_id)
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
        assert load.tool == "kvbench" and load.input_seq_len.value in (128, 512)
        stages.add(load.stage)
        sent = requests[(requests.cell_id == cell_id) & ~requests.warmup]
        aggregate = report.results.request_performance.aggregate
        assert aggregate.requests.total == len(sent) == load.concurrency and aggregate.requests.failures == 0
        assert aggregate.latency.time_to_first_token.p50 > 0
        assert report.results.component_health[0].replica_health[0].healthy
        assert report.results.observability.model_extra[br.KV_KEY]["peak_bytes_in_use"] > 0
    assert stages == {0, 1, 2, 3}

    analyzed = run_script(ANALYZER_SCRIPT, env)
    assert analyzed.returncode == 0, analyzed.stderr
    assert analyzed.stdout.count("valid Benchmark Report v0.2") == 4


def test_a_failed_try_then_a_retry_in_the_same_folder(llama_server, tmp_path):
    """llm-d-benchmark retries a failed harness in the same results folder. The first try finds no server:
    every cell fails, kvbench exits 1 and so does the script, its reports say the engine was unhealthy and
    validate. The retry (a smaller workload, as a treatment's overrides give it) runs in a run folder of its
    own; its report replaces the first try's; both tries' output is in the logs."""
    results = tmp_path / "requests" / f"{EXPERIMENT_ID}_2"
    nowhere = f"http://127.0.0.1:{closed_port()}"
    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values(nowhere), {"engine": "llamacpp"})
    env = pod_environment(results, workspace, name)
    done = run_script(HARNESS_SCRIPT, env)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    meta = metadata(results)
    assert meta["harness_rc"] == "1" and len(meta["benchmark_reports"]) == 4
    for path in report_files(results):
        report = import_benchmark_report(str(path))
        assert report.results.component_health[0].replica_health[0].healthy is False
        assert report.results.request_performance is None
    assert run_script(ANALYZER_SCRIPT, env).returncode == 0  # failed cells, valid reports

    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values(llama_server.base_url),
                                     {"engine": "llamacpp", "workload.prompt_tokens": [64],
                                      "workload.load.concurrency": [1]})
    retry = run_script(HARNESS_SCRIPT, env)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert sorted(p.name for p in (results / harness.RUNS_FOLDER).iterdir()) == [
        f"{EXPERIMENT_ID}_2", f"{EXPERIMENT_ID}_2_try2"]
    meta = metadata(results)
    assert meta["harness_rc"] == "0" and meta["kvbench_run"].endswith("_try2")
    (path,) = report_files(results)
    assert [path.name] == meta["benchmark_reports"]
    report = import_benchmark_report(str(path))
    assert report.results.request_performance.aggregate.requests.total == 1
    assert report.scenario.load.standardized.input_seq_len.value == 64
    assert (results / "stdout.log").read_text().count("kvbench-harness: running ") == 2


def test_sigterm_is_passed_on_to_kvbench(llama_server, tmp_path):
    """A pod being deleted: SIGTERM to the harness reaches kvbench, which stops its run (exit 130); the
    harness still writes run_metadata.yaml saying so."""
    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values(llama_server.base_url),
                                     {"engine": "llamacpp", "workload.prompt_tokens": [64],
                                      "workload.load.concurrency": [1], "workload.load.rounds": 500})
    results = tmp_path / "requests" / f"{EXPERIMENT_ID}_3"
    env = pod_environment(results, workspace, name)
    proc = subprocess.Popen(["bash", str(HARNESS_SCRIPT)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    requests = results / harness.RUNS_FOLDER / f"{EXPERIMENT_ID}_3" / "requests.jsonl"
    deadline = time.monotonic() + 120
    while not (requests.exists() and len(requests.read_text().splitlines()) >= 6):  # warm-ups and a few
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # `exec`: the script's process is the harness's
    assert proc.wait(timeout=120) == 130
    assert metadata(results)["harness_rc"] == "130"
    assert "kvbench-harness: kvbench run exited 130" in (results / "stdout.log").read_text()
