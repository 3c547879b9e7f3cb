"""kvbench's llm-d-benchmark harness without an engine: its files where llm-d-benchmark looks for them, every
profile template rendered as llm-d-benchmark renders it and read into a kvbench run kvbench's own parser
takes, the refusals (one line, exit 2, the logs and run_metadata.yaml still written), kvbench's own refusal
and status passed through, the reports of a run (an earlier try's replaced, another program's file refused),
the analyzer, the metrics collection hook and the image recipe. A real engine: test_llmd_harness_engines.py."""
from __future__ import annotations

import io
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from kvbench.common.files import OutputRefused
from kvbench.integrations import llmd_harness as harness
from kvbench.integrations import llmd_profile as profiles
from kvbench.reports import benchmark_report as br
from kvbench.workloads import load as load_workload

from tests.helpers import REPO
from tests.integrations.llmd import (ANALYZER_SCRIPT, EXPERIMENT_ID, HARNESS_SCRIPT, INTEGRATION, POD_UID, PROFILES,
                                     TEMPLATES, metadata, pod_environment, render, report_files, run_script,
                                     workspace_with)
from tests.synth import make_run

VALUES = {"LLMDBENCH_DEPLOY_CURRENT_MODEL": "Qwen/Qwen3-0.6B", "LLMDBENCH_DEPLOY_CURRENT_TOKENIZER": "Qwen/Qwen3-0.6B",
          "LLMDBENCH_HARNESS_STACK_ENDPOINT_URL": "http://10.131.0.42:80",
          "LLMDBENCH_DEPLOY_CURRENT_MAX_MODEL_LEN": "16000"}


def in_process(tmp_path, template="sanity_random.yaml.in", overrides=None, values=VALUES, **extra):
    """The harness run in this process (refusals happen before kvbench would start): status, console, folder."""
    workspace, name = workspace_with(tmp_path, template, values, overrides)
    results = tmp_path / "requests" / f"{EXPERIMENT_ID}_1"
    env = pod_environment(results, workspace, name, **extra)
    out, err = io.BytesIO(), io.BytesIO()
    return harness.run(env, out, err), out.getvalue().decode(), err.getvalue().decode(), results


# --- the files ---------------------------------------------------------------------------------------------

def test_the_files_are_where_llm_d_benchmark_looks():
    """Its run step runs /usr/local/bin/<harness>-llm-d-benchmark.sh, then <harness>-analyze_results.sh; its
    profiles are workload/profiles/<harness>/*.yaml.in, and sanity_random.yaml is its default profile name."""
    for script in (HARNESS_SCRIPT, ANALYZER_SCRIPT):
        assert script.read_text().startswith("#!/usr/bin/env bash\n")
        assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable (its ConfigMap mounts 0755)"
    assert HARNESS_SCRIPT.name == f"{profiles.HARNESS}-llm-d-benchmark.sh"
    assert ANALYZER_SCRIPT.name == f"{profiles.HARNESS}-analyze_results.sh"
    assert PROFILES.name == profiles.HARNESS and PROFILES / "sanity_random.yaml.in" in TEMPLATES
    assert len(TEMPLATES) >= 4


@pytest.mark.parametrize("template", [t.name for t in TEMPLATES])
def test_every_template_renders_into_a_run_kvbench_takes(tmp_path, template):
    """Rendered with the values llm-d-benchmark has for a stood-up stack, a template has no token left, reads
    as a profile, its workload as a kvbench workload (kvbench's own loader), and the whole command parses as
    `kvbench run` parses its flags."""
    from kvbench.cli import load_command

    text = render((PROFILES / template).read_text(), VALUES)
    assert not re.search(r"REPLACE_ENV_\w+", text)
    workspace, name = workspace_with(tmp_path, template, VALUES)
    results = tmp_path / "results"
    results.mkdir()
    env = profiles.Environment.read(pod_environment(results, workspace, name))
    profile, _ = profiles.read_profile(env)
    assert (profile.endpoint, profile.model) == ("http://10.131.0.42:80", "Qwen/Qwen3-0.6B")
    workload = profiles.workload_argument(profile, env)
    assert load_workload(workload).name == template.removesuffix(".yaml.in")
    notes = []
    command = profiles.kvbench_command(profile, env, workload, profiles.run_folder(env), notes)
    assert notes == []
    assert command[1:4] == ["run", "--backend", "vllm:url=http://10.131.0.42:80"]  # vllm-prod: a vLLM service
    assert command[command.index("--max-context") + 1] == "16000"
    load_command("run").make_context("run", command[2:])  # kvbench run's own parser: every flag and value


def test_the_engine_follows_the_stack_and_an_unrendered_limit_is_left_out(tmp_path):
    """The templates name vLLM for a standalone stack and the OpenAI-compatible adapter for llm-d's gateway; a
    run-only stack without maxModelLen leaves that token unrendered: the flag is left out, and said."""
    values = {k: v for k, v in VALUES.items() if k != "LLMDBENCH_DEPLOY_CURRENT_MAX_MODEL_LEN"}
    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values)
    results = tmp_path / "results"
    results.mkdir()
    env = profiles.Environment.read(pod_environment(results, workspace, name, LLMDBENCH_HARNESS_STACK_TYPE="llm-d"))
    profile, _ = profiles.read_profile(env)
    notes = []
    command = profiles.kvbench_command(profile, env, "smoke", profiles.run_folder(env), notes)
    assert command[3] == "openai:url=http://10.131.0.42:80" and "--max-context" not in command
    assert notes == ["run.max-context is REPLACE_ENV_LLMDBENCH_DEPLOY_CURRENT_MAX_MODEL_LEN, which llm-d-benchmark "
                     "did not render: left to kvbench's default"]


# --- refusals ----------------------------------------------------------------------------------------------

def test_no_results_folder_is_refused_and_nothing_is_written(tmp_path, capsys):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMDBENCH_")}
    assert harness.run(env) == 2
    assert "LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR is not set" in capsys.readouterr().err
    env["LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR"] = str(tmp_path / "r")
    env["LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME"] = "../../etc/profile"
    assert harness.run(env) == 2
    assert "not a plain name" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("overrides, said", [
    ({"surprise": 1}, "surprise: Extra inputs are not permitted"),
    ({"run.results-dir": "/tmp"}, "run.results-dir: the harness sets --results-dir itself"),
    ({"run.request-timeot": 5}, "run.request-timeot is not a kvbench run flag; did you mean 'request-timeout'?"),
    ({"run.interleave": "yes please"}, "run.interleave is a switch: true or false"),
    ({"endpoint": "REPLACE_ENV_LLMDBENCH_HARNESS_STACK_ENDPOINT_URL"}, "endpoint is 'REPLACE_ENV_LLMDBENCH_HARNESS_"
                                                                       "STACK_ENDPOINT_URL': llm-d-benchmark did not"),
    ({"workload.slo_ttft_s": None}, "workload: its settings have no TOML form"),
    ({"engine_options.url": "http://elsewhere"}, "engine_options.url: the endpoint is the profile's endpoint"),
])
def test_a_bad_profile_is_one_line_exit_2_with_its_logs(tmp_path, overrides, said):
    """Before kvbench runs: one line on stderr and in stderr.log, run_metadata.yaml with harness_rc 2, the
    profile copied beside them, no kvbench run folder."""
    rc, out, err, results = in_process(tmp_path, overrides=overrides)
    assert rc == 2
    assert said in err and len(err.strip().splitlines()) == 1
    assert (results / "stderr.log").read_text() == err and (results / "stdout.log").exists()
    meta = metadata(results)
    assert meta["harness_rc"] == "2" and meta["kvbench_run"] == "" and meta["benchmark_reports"] == []
    assert not (results / profiles.RUNS_FOLDER).exists() and not report_files(results)


def test_an_engine_per_stack_type_needs_the_stack_type(tmp_path):
    rc, _, err, _ = in_process(tmp_path, LLMDBENCH_HARNESS_STACK_TYPE="")
    assert rc == 2 and "engine: the profile names one for the stack types vllm-prod, llm-d" in err
    assert "LLMDBENCH_HARNESS_STACK_TYPE is not set" in err


def test_a_missing_profile_is_refused(tmp_path):
    workspace, _ = workspace_with(tmp_path, "sanity_random.yaml.in", VALUES)
    results = tmp_path / "results"
    env = pod_environment(results, workspace, "no_such_profile")  # the entrypoint adds .yaml
    err = io.BytesIO()
    assert harness.run(env, io.BytesIO(), err) == 2
    assert "no_such_profile.yaml" in err.getvalue().decode()
    assert metadata(results)["harness_workload"] == "no_such_profile.yaml"


def test_kvbenchs_own_refusal_and_status_come_through_with_metrics_collected(tmp_path):
    """The script end to end where kvbench itself refuses (an engine it does not know): its one line in
    stderr.log, its exit 2 as the script's, run_metadata.yaml saying so; llm-d-benchmark's collect_metrics.sh
    (a stand-in that records its calls) started before the load and stopped and processed after it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    stand_in = bin_dir / "collect_metrics.sh"
    stand_in.write_text(f"#!/bin/sh\necho \"$1\" >> {shlex.quote(str(calls))}\necho collected \"$1\"\n")
    stand_in.chmod(0o755)
    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", VALUES, {"engine": "nosuchengine"})
    results = tmp_path / "requests" / f"{EXPERIMENT_ID}_1"
    env = pod_environment(results, workspace, name, PATH=f"{bin_dir}:{os.environ['PATH']}",
                          LLMDBENCH_VLLM_COMMON_METRICS_SCRAPE_ENABLED="true")
    done = run_script(HARNESS_SCRIPT, env)
    assert done.returncode == 2, done.stderr
    stderr_log = (results / "stderr.log").read_text()
    assert "error: backend 'nosuchengine' is not known" in stderr_log and stderr_log in done.stderr
    stdout_log = (results / "stdout.log").read_text()
    assert "kvbench-harness: running " in stdout_log and "kvbench-harness: kvbench run exited 2" in stdout_log
    meta = metadata(results)
    assert meta["harness_rc"] == "2" and meta["benchmark_reports"] == []
    assert meta["harness_args"].startswith("run --backend nosuchengine:url=http://10.131.0.42:80 --model Qwen/Qwen3")
    calls = calls.read_text().split()  # start runs in the background: stop and then process, after the load
    assert sorted(calls) == ["process", "start", "stop"] and calls[-1] == "process"
    assert "collected process" in (results / "metrics_collection.log").read_text()
    assert run_script(ANALYZER_SCRIPT, env).returncode == 0  # nothing to validate after a failed harness


def test_sigterm_is_passed_on_to_kvbench(tmp_path, smollm2):
    """A pod deleted while kvbench waits for an endpoint that takes connections and never answers: SIGTERM to
    the harness reaches kvbench, which ends its run (exit 130, the script's status: `exec`, so the script's
    process is the harness's); run_metadata.yaml says so, and no cell means no report."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # never accepted: the kernel completes the connections, nobody answers
        values = {**VALUES, "LLMDBENCH_HARNESS_STACK_ENDPOINT_URL": f"http://127.0.0.1:{listener.getsockname()[1]}",
                  "LLMDBENCH_DEPLOY_CURRENT_MODEL": "smollm2", "LLMDBENCH_DEPLOY_CURRENT_MAX_MODEL_LEN": "1024"}
        workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values,
                                         {"engine": "openai", "run.start-timeout": 120})
        results = tmp_path / "requests" / f"{EXPERIMENT_ID}_1"
        proc = subprocess.Popen(["bash", str(HARNESS_SCRIPT)], env=pod_environment(results, workspace, name),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run_json = results / profiles.RUNS_FOLDER / f"{EXPERIMENT_ID}_1" / "run.json"
        deadline = time.monotonic() + 120
        while not run_json.exists():  # written once kvbench's run handles SIGTERM
            assert proc.poll() is None and time.monotonic() < deadline, (results / "stderr.log").read_text()
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    meta = metadata(results)
    assert meta["harness_rc"] == "130" and meta["benchmark_reports"] == [] and not report_files(results)
    assert "kvbench-harness: kvbench run exited 130" in (results / "stdout.log").read_text()
    assert yaml.safe_load(run_json.read_text())["status"] == "interrupted"


def test_without_kvbench_the_script_says_so_in_its_log(tmp_path):
    results = tmp_path / "results"
    env = pod_environment(results, tmp_path, "sanity_random.yaml", KVBENCH_PYTHON=str(tmp_path / "no-python"))
    done = run_script(HARNESS_SCRIPT, env)
    assert done.returncode == 127 and "no kvbench Python at" in (results / "stderr.log").read_text()


# --- the reports and the analyzer ---------------------------------------------------------------------------

def test_reports_carry_the_experiment_and_replace_an_earlier_trys(tmp_path):
    """The run's cells as Benchmark Reports at the top of the results folder: the experiment's eid (as
    llm-d-benchmark makes it), the pod, the description and keywords; a report an earlier try left and this
    one did not make is removed; another program's file there is refused before anything is written."""
    results = tmp_path / f"{EXPERIMENT_ID}_1"
    env = profiles.Environment.read(pod_environment(results, tmp_path, "sanity_random.yaml"))
    run = make_run(results / profiles.RUNS_FOLDER, f"{EXPERIMENT_ID}_1", prompts=(1024,), concurrency=(1, 4),
                   repeats=1, n_requests=3)
    stale = results / br.file_name("vllm-0.31.0_p2048_c1_r0")
    stale.write_text(f"{br.HEADER} left by an earlier try\n")
    foreign = results / br.file_name("vllm-0.31.0_p1024_c4_r0")
    foreign.write_text("someone else's\n")
    with pytest.raises(OutputRefused):
        harness.write_reports(run, env)
    assert stale.exists() and foreign.read_text() == "someone else's\n"
    foreign.unlink()
    names = harness.write_reports(run, env)
    assert [p.name for p in report_files(results)] == names == sorted(
        br.file_name(f"vllm-0.31.0_p1024_c{c}_r0") for c in (1, 4))
    for path in report_files(results):
        report = br.read_back(path.read_text())
        assert report.run.eid == str(uuid.uuid5(uuid.NAMESPACE_URL, EXPERIMENT_ID))
        assert (report.run.pid, report.run.description, report.run.keywords) == (
            POD_UID, "kvbench on the embedded model", ["kvbench", "ci"])
        assert report.run.uid == str(uuid.uuid5(br.NAMESPACE, f"{EXPERIMENT_ID}_1/{path.name[len(br.FILE_PREFIX):-5]}/0"))


def test_the_analyzer_validates_every_report(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    env = {"LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR": str(results)}
    (results / "run_metadata.yaml").write_text(yaml.safe_dump({"harness_rc": "0"}))
    assert harness.analyze(env) == 1  # kvbench succeeded: a missing report is an error
    assert "has no Benchmark Report" in capsys.readouterr().err
    run = make_run(tmp_path / "runs", "a", prompts=(1024,), concurrency=(1,), repeats=1, n_requests=3)
    harness.write_reports(run, profiles.Environment.read(pod_environment(results, tmp_path, "x")))
    assert harness.analyze(env) == 0
    assert "valid Benchmark Report v0.2" in capsys.readouterr().out
    (path,) = report_files(results)
    path.write_text(path.read_text().replace("units: s\n", "units: fortnights\n", 1))
    assert "units: fortnights" in path.read_text()
    assert harness.analyze(env) == 1
    assert path.name in capsys.readouterr().err


# --- the image -----------------------------------------------------------------------------------------------

def test_the_containerfile_copies_what_exists_and_installs_the_harness():
    """Every source its COPY lines name is in the repository, the folders are the packages pyproject.toml maps
    (a wheel built from them has the harness module), and the scripts go where the entrypoint runs them."""
    import tomllib

    text = (INTEGRATION / "Containerfile").read_text()
    copies = [line.split()[1:] for line in text.splitlines() if line.startswith("COPY ")]
    sources = [s for *srcs, _ in copies for s in srcs]
    for source in sources:
        assert (REPO / source).exists(), source
    package_dirs = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= set(sources) and "pyproject.toml" in sources
    assert {Path(s).name for s in sources} >= {HARNESS_SCRIPT.name, ANALYZER_SCRIPT.name}
    assert "kvbench.integrations" in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "ENV KVBENCH_PYTHON=/opt/kvbench/bin/python" in text and "/workspace/repos.txt" in text
