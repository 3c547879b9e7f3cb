"""The fourth fault matrix, B, as properties (hypothesis): hostile server answers (a version string, the /metrics
pool's labels, SSE framings) and hostile run folders (a field of run.json or of a cell row replaced, garbage
appended) given to `kvbench run`, `report` and `compare`. Each answers with a complete result, or with one
clear line and exit 2; none raises, and none writes outside its output (docs/fault-matrix.md, "The fourth
matrix, B")."""
from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_run_info
from kvbench.workloads import Workload
from tests.faults.test_wire_formats import events_of
from tests.fakes.replica_server import FakeReplica
from tests.helpers import kvbench_here
from tests.synth import make_run

# text a server or a hand may put anywhere: Markdown, HTML, lone surrogates, control characters, very long
HOSTILE_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "0.1\udcff", "# H\n\n[x](http://e) <script>a</script>", "```", "| a | b |",
                     "\x00\x1b[31m", "x" * 20_000, "{{ x }}", "&amp;", "*_`~"]),
)
HOSTILE_NUMBER = st.one_of(st.sampled_from([10**30, -(10**30), 2**63, -1, 0, 1e300, -1e300, True]),
                           st.integers(), st.floats(allow_nan=False))
HOSTILE_VALUE = st.one_of(HOSTILE_TEXT, HOSTILE_NUMBER, st.none(),
                          st.lists(st.one_of(HOSTILE_TEXT, HOSTILE_NUMBER), max_size=3),
                          st.dictionaries(HOSTILE_TEXT, HOSTILE_TEXT, max_size=2))
RUN_JSON_FIELDS = ["engine_versions", "served_models", "capabilities", "command", "model", "workload", "run_id",
                   "environment", "status", "started_at", "engine_threads"]
CELL_FIELDS = ["error", "log_tail", "engine_version_reported", "kv_pool_tokens_engine", "kv_pool_source",
               "kv_pool_sequences_predicted", "kv_in_use_peak_bytes", "ttft_s_p50", "status", "n_requests"]
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def complete_or_one_line(done, ok_codes=(0,)) -> None:
    """A complete answer (one of ``ok_codes``), or exit 2 with one line saying why."""
    if done.returncode == 2:
        said = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        assert len(said) == 1 and said[0].startswith("error"), done.stderr + done.stdout
    else:
        assert done.returncode in ok_codes, done.stdout + done.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    base = make_run(root, "base", prompts=(1024,), concurrency=(1, 4), repeats=2, n_requests=4, seed=1)
    template = make_run(root, "cand", prompts=(1024,), concurrency=(1, 4), repeats=2, n_requests=4, seed=2,
                        failed={("vllm-0.31.0", 1024, 4)})
    return base, template


@SETTINGS
@given(where=st.sampled_from(["run.json", "cells.jsonl", "garbage"]), field=st.integers(0, 100),
       value=HOSTILE_VALUE, garbage=st.binary(max_size=200))
def test_report_and_compare_read_a_hostile_run_folder_or_refuse_it_in_one_line(tmp_path_factory, runs, where,
                                                                               field, value, garbage):
    base, template = runs
    work = tmp_path_factory.mktemp("hostile")
    run = work / "cand"
    shutil.copytree(template, run)
    for parquet in run.glob("*.parquet"):  # the records are read, not a copy made of the untouched ones
        parquet.unlink()
    if where == "run.json":
        info = json.loads((run / "run.json").read_text())
        info[RUN_JSON_FIELDS[field % len(RUN_JSON_FIELDS)]] = value
        (run / "run.json").write_text(json.dumps(info))  # json's own escapes, as kvbench writes
    elif where == "cells.jsonl":
        rows = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines()]
        rows[field % len(rows)][CELL_FIELDS[field % len(CELL_FIELDS)]] = value
        (run / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(run / "cells.jsonl", "ab") as f:
            f.write(garbage)
    before, base_before = snapshot(work), snapshot(base)
    out = work / "out"
    done = kvbench_here("report", run, "-o", out / "report.md", "--no-plots")
    complete_or_one_line(done)
    if done.returncode == 0:
        (out / "report.md").read_bytes().decode()  # UTF-8 throughout
    complete_or_one_line(kvbench_here("compare", base, run, "-o", out / "compare"), ok_codes=(0, 1, 3, 4))
    after = snapshot(work)
    assert {k: v for k, v in after.items() if not k.startswith("out/")} == before  # nothing written but -o
    assert snapshot(base) == base_before


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.one_of(
    st.sampled_from([b"data: {\"choices\": [{\"text\": \"a\", \"index\": 0}]}", b"data: [DONE]", b"data:", b"data",
                     b": comment", b"event: x", b"id: 1", b"retry: 5", b"", b"data: {\"choices\": [{\"text\": \"",
                     b"data: \"}]}", b"data: \xff\xfe", b"\xef\xbb\xbfdata: {}", b"data: {\"usage\": {\"prompt_tokens\": "
                     b"1e400}}", b"data: null", b"data: [1,2]"]),
    st.binary(max_size=30)), max_size=12),
    ends=st.sampled_from([b"\n", b"\r\n", b"\r"]), cuts=st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_any_sse_framing_gives_events_or_a_parse_error_never_a_crash(lines, ends, cuts):
    """Whatever the bytes, the splitter hands over JSON events or raises the parse error that fails only its
    request (a ValueError): no other exception, at any read boundary."""
    body = ends.join(lines) + ends + ends
    try:
        seen, _ = events_of(body, cuts)
    except ValueError:
        return
    assert all(isinstance(event, (dict, list, int, float, str, type(None))) for event in seen)


WORKLOAD = Workload(name="prop", seed=5, prompt_tokens=[32], output_tokens=2, concurrency=[1], rounds=1,
                    warmup_requests=0)


class HostileReplica(FakeReplica):
    """A vLLM replica whose /version and /metrics pool labels are set per example."""

    blocks_label, size_label = "67", "128"

    def metrics_page(self) -> str:
        page = super().metrics_page()
        return (page.replace(f'num_gpu_blocks="{self.num_gpu_blocks}"', f'num_gpu_blocks="{self.blocks_label}"')
                    .replace(f'block_size="{self.block_size}"', f'block_size="{self.size_label}"'))


@pytest.fixture(scope="module")
def replica():
    with HostileReplica(model="smollm2") as fake:
        yield fake


LABEL = st.one_of(st.sampled_from(["67", "1e30", "1" + "0" * 30, "-5", "0", "NaN", "abc", "", "1.5", "inf", "9" * 400]),
                  st.integers(-(2**70), 2**70).map(str))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(version=HOSTILE_TEXT, blocks=LABEL, size=LABEL)
def test_a_run_against_hostile_answers_finishes_and_its_report_reads(tmp_path_factory, smollm2, replica, version,
                                                                      blocks, size):
    """A version string and /metrics pool labels of any kind: the run finishes (its cells ok or failed with
    words), run.json and the records are written, and report reads the run."""
    replica.version, replica.blocks_label, replica.size_label = version, blocks, size
    work = tmp_path_factory.mktemp("answers")
    opts = RunOptions(model="smollm2", workload=WORKLOAD, backends=[BackendConfig.parse(f"vllm:url={replica.url}")],
                      results_dir=work, run_id="run", estimate=False, request_timeout_s=10)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    assert load_run_info(run_dir)["status"] in ("finished", "failed")
    assert os.listdir(work) == ["run"]
    done = kvbench_here("report", run_dir, "-o", work / "out" / "report.md", "--no-plots")
    assert done.returncode == 0, done.stdout + done.stderr
    (work / "out" / "report.md").read_bytes().decode()
