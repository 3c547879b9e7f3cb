"""The fourth fault matrix, B: kvbench's llm-d-benchmark harness (bench/integrations/) against what its pod gives
it: llm-d-benchmark's collect_metrics.sh that never returns, a profile (or a results folder's YAML) of nested
aliases, a description that is not UTF-8. The harness runs in this process, its kvbench run as a process of
its own against tests/fakes/openai_server.py (docs/fault-matrix.md, "The fourth matrix, B")."""
from __future__ import annotations

import io
import os
import time

import psutil
import pytest
import yaml

from kvbench.integrations import llmd_harness as harness
from kvbench.integrations import llmd_profile as profiles
from kvbench.kv import bounded
from kvbench.reports import benchmark_report as br
from tests.fakes.openai_server import FakeOpenAI
from tests.integrations.llmd import EXPERIMENT_ID, metadata, pod_environment, report_files, workspace_with

# a bomb of 9 levels of 9 aliases: 9^9 (387 million) strings once expanded, in 396 bytes (the issue's: 620)
BOMB = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                 + [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]) + "\n"
TINY = {"engine": "openai", "workload.prompt_tokens": [32], "workload.load.concurrency": [1],
        "workload.warmup_requests": 0, "run.no-report": True}


@pytest.fixture(scope="module")
def server():
    with FakeOpenAI(model="smollm2", max_model_len=1024) as fake:
        yield fake


def harness_run(tmp_path, server, overrides=None, **extra):
    values = {"LLMDBENCH_HARNESS_STACK_ENDPOINT_URL": server.url, "LLMDBENCH_DEPLOY_CURRENT_MODEL": "smollm2",
              "LLMDBENCH_DEPLOY_CURRENT_MAX_MODEL_LEN": "1024"}
    workspace, name = workspace_with(tmp_path, "sanity_random.yaml.in", values, {**TINY, **(overrides or {})})
    results = tmp_path / "requests" / f"{EXPERIMENT_ID}_1"
    out, err = io.BytesIO(), io.BytesIO()
    rc = harness.run(pod_environment(results, workspace, name, **extra), out, err)
    return rc, err.getvalue().decode(errors="replace"), results


def test_a_metrics_script_that_never_returns_meets_a_deadline_and_the_run_is_still_written(tmp_path, server,
                                                                                        monkeypatch):
    """collect_metrics.sh whose stop and process never return (and a start that ignores SIGTERM) held the
    harness for ever: no report, no run_metadata.yaml. Each call now has a deadline: its group is ended, the
    harness says so, and writes the reports and run_metadata.yaml of what kvbench measured."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "collect_metrics.sh"
    script.write_text("#!/bin/sh\ntrap '' TERM\nsleep 1000 & wait\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")  # the harness's own PATH finds the script
    started = time.monotonic()
    rc, err, results = harness_run(tmp_path, server,
                                   LLMDBENCH_VLLM_COMMON_METRICS_SCRAPE_ENABLED="true",
                                   KVBENCH_METRICS_DEADLINE_S="1")
    took = time.monotonic() - started
    assert rc == 0, (results / "stderr.log").read_text()
    assert took < 30, took  # three 1 s deadlines (stop, the collector, process), 1 s grace each: SIGTERM ignored
    assert "collect_metrics.sh stop did not return within 1 s: ended" in err
    assert "collect_metrics.sh process did not return within 1 s" in err
    meta = metadata(results)
    assert meta["harness_rc"] == "0" and "did not return within 1 s" in meta["metrics_collection"]
    assert len(report_files(results)) == len(meta["benchmark_reports"]) == 1  # the one cell
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]
    assert not left  # every call's group ended


def test_a_bad_metrics_deadline_is_a_refusal(tmp_path, server):
    rc, err, results = harness_run(tmp_path, server, LLMDBENCH_VLLM_COMMON_METRICS_SCRAPE_ENABLED="true",
                                   KVBENCH_METRICS_DEADLINE_S="nan")
    assert rc == 2 and "KVBENCH_METRICS_DEADLINE_S is 'nan'" in err and len(err.splitlines()) == 1
    assert metadata(results)["harness_rc"] == "2"


def test_a_profile_of_nested_aliases_is_refused_at_once_in_one_line(tmp_path, server):
    """620 bytes of nested YAML aliases ("billion laughs") used to hang the harness silently (its checks walked
    the expanded data); refused now before anything is built from it: one line, exit 2."""
    folder = tmp_path / "workspace" / "profiles" / "kvbench"
    folder.mkdir(parents=True)
    (folder / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 700
    results = tmp_path / "results"
    err = io.BytesIO()
    started = time.monotonic()
    assert harness.run(pod_environment(results, tmp_path / "workspace", "bomb.yaml"), io.BytesIO(), err) == 2
    assert time.monotonic() - started < 5
    line = err.getvalue().decode()
    assert len(line.splitlines()) == 1 and "aliases expand it to" in line and "alias bomb" in line, line
    assert metadata(results)["harness_rc"] == "2"


@pytest.mark.parametrize("name", ["run_metadata.yaml", "benchmark_report_v0.2,_bomb.yaml"])
def test_the_analyzer_refuses_alias_bombs_in_the_results_folder(tmp_path, name, capsys):
    """The analyzer (kvbench-analyze_results.sh) read run_metadata.yaml and every report with PyYAML's loader:
    a bomb there held it for ever; now a report of aliases is one invalid report, a metadata file is unread."""
    (tmp_path / name).write_text(BOMB)
    started = time.monotonic()
    rc = harness.analyze({"LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR": str(tmp_path)})
    assert time.monotonic() - started < 5
    out = capsys.readouterr()
    if name.startswith("benchmark"):
        assert rc == 1 and "alias bomb" in out.err and len(out.err.splitlines()) == 1
    else:
        assert rc == 0 and "harness_rc not recorded" in out.out


@pytest.mark.parametrize("text, refused", [
    ("a: &a [*a]", "an alias contains itself"),
    ("a:" + " [" * 80 + " ]" * 80, "nests deeper than 64 levels"),
    ("a: {<<: &m {k: 1}}\nb: {<<: *m}", None),  # aliases within bounds, merge keys included, still read
])
def test_the_yaml_reader_bounds_aliases_and_depth(text, refused):
    if refused is None:
        assert bounded.parse_yaml(text.encode(), "x") == {"a": {"k": 1}, "b": {"k": 1}}
    else:
        with pytest.raises(bounded.InputError, match=refused):
            bounded.parse_yaml(text.encode(), "x")


def test_a_description_that_is_not_utf8_keeps_every_report(tmp_path, server):
    """LLMDBENCH_DESCRIPTION_TEXT with bytes that are not UTF-8 (Python keeps them as lone surrogates): every
    Benchmark Report of the finished run failed to be written and the harness exited 1, so llm-d-benchmark ran
    the whole run again, three times. The bytes are now read as U+FFFD: the reports are written, exit 0."""
    description = os.fsdecode(b"caf\xe9 \xff\xfe run")  # what os.environ holds for those bytes
    keywords = os.fsdecode(b"ok,\xc3(")
    rc, err, results = harness_run(tmp_path, server, LLMDBENCH_DESCRIPTION_TEXT=description,
                                   LLMDBENCH_DESCRIPTION_KEYWORDS=keywords)
    assert rc == 0, err
    files = report_files(results)
    assert len(files) == 1
    for path in files:
        report = br.read_back(path.read_text())
        assert report.run.description == "caf\ufffd \ufffd\ufffd run" and report.run.keywords == ["ok", "\ufffd("]
    meta = metadata(results)
    assert meta["description_text"] == "caf\ufffd \ufffd\ufffd run" and meta["harness_rc"] == "0"
    assert yaml.safe_load((results / "run_metadata.yaml").read_bytes())  # UTF-8 YAML throughout


def test_the_environment_keeps_an_undecodable_path_as_its_bytes(tmp_path):
    """Only the text is replaced: a results folder whose name is not UTF-8 is still that folder."""
    results = tmp_path / os.fsdecode(b"r\xe9sults")
    env = profiles.Environment.read(pod_environment(results, tmp_path, "x.yaml"))
    assert os.fsencode(env.results_dir) == os.fsencode(results)
