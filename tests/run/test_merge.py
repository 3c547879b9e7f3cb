"""``kvbench merge`` (bench/run/merge.py) of load shares run as separate ``kvbench run`` processes, the way the
Kubernetes example runs them (integrations/kubernetes/kvbench-load.yaml's share.sh, each share a process of its
own, share 0 the owner), against the fake OpenAI server: the merged run is the run one process makes (the same
requests and tokens, TTFTs a Mann-Whitney test does not tell apart), a share whose clock reads 1000 s ahead is
put back on the owner's clock, and folders that are not one experiment's shares are refused in one line; a
share that died mid-run is refused, or with --accept-lost merged with its requests recorded as lost."""
from __future__ import annotations

import json
import os
import zlib
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvbench.cli import app
from tests.fakes.openai_server import FakeOpenAI
from tests.helpers import REPO

WORKLOAD = """name = "shares"
seed = 5
prompt_tokens = [32]
output_tokens = 4
warmup_requests = 1
[load]
profile = "concurrent"
concurrency = [2, 4]
requests = 24
"""
SALT = "merge-test"
SKEW_S = 1000.0


def spread_ttft(prompt) -> float:
    """5-35 ms before the first token, by the prompt's first token id: the same for the same prompt in any
    process, a spread far wider than a client's own overhead."""
    return 0.005 + 0.03 * (zlib.crc32(str(prompt).encode()) % 97) / 97


def share_script() -> str:
    docs = list(yaml.safe_load_all((REPO / "integrations/kubernetes/kvbench-load.yaml").read_text()))
    return next(d for d in docs if d["kind"] == "ConfigMap")["data"]["share.sh"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvbench(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=240, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """Two shares run by the Kubernetes example's script (share 1's clock 1000 s ahead; share 0 merges),
    and the same workload from one process."""
    tmp = tmp_path_factory.mktemp("merge")
    (tmp / "w.toml").write_text(WORKLOAD)
    with FakeOpenAI(token_delay_s=0.002, first_token_delay_s=spread_ttft) as fake:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "SHARES": "2", "ENGINE": "openai", "ENGINE_URL": fake.url, "MODEL": "smollm2", "SALT": SALT,
               "EXPERIMENT": "exp", "RESULTS": str(tmp), "WORKLOAD": str(tmp / "w.toml"),
               "OWNER_HOST": "127.0.0.1", "OWNER_BIND": "127.0.0.1", "OWNER_PORT": str(free_port())}
        skewed = {"PYTHONPATH": str(REPO / "tests/run/skewed_clock"), "KVBENCH_TEST_CLOCK_SKEW_S": str(SKEW_S)}
        shares = [subprocess.Popen(["/bin/sh", "-c", share_script()], cwd=tmp, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT,
                                   env={**env, "JOB_COMPLETION_INDEX": str(i), **(skewed if i == 1 else {})})
                  for i in (0, 1)]
        outputs = [p.communicate(timeout=300)[0] for p in shares]
        single = kvbench("run", "--workload", tmp / "w.toml", "-b", f"openai:url={fake.url}", "--prompt-salt", SALT,
                         "--results-dir", tmp, "--run-id", "single", "--no-report")
    for p, out in zip(shares, outputs):
        assert p.returncode == 0, out[-4000:]
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-2000:]
    return tmp


def rows(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines() if line.strip()]


def measured(run: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows(run, "requests.jsonl"):
        if not r["warmup"]:
            out.setdefault(r["cell_id"], []).append(r)
    return out


def test_two_shares_merged_are_the_run_one_process_makes(experiment):
    from scipy.stats import mannwhitneyu

    merged, single = experiment / "exp" / "merged", experiment / "single"
    m_cells, s_cells = {c["cell_id"]: c for c in rows(merged, "cells.jsonl")}, \
        {c["cell_id"]: c for c in rows(single, "cells.jsonl")}
    assert sorted(m_cells) == sorted(s_cells) and len(m_cells) == 2
    m_req, s_req = measured(merged), measured(single)
    for cell_id, cell in m_cells.items():
        one = s_cells[cell_id]
        assert (cell["status"], cell["n_requests"], cell["n_ok"], cell["n_lost"]) == ("ok", 24, 24, 0), cell["flags"]
        assert (cell["load_processes"], cell["requests_planned"], one["load_processes"]) == (2, 24, 1)
        assert sorted(r["ordinal"] for r in m_req[cell_id]) == list(range(24))  # every request once
        tokens = [sum(sum(r["chunk_tokens"]) for r in req[cell_id]) for req in (m_req, s_req)]
        assert tokens == [24 * 4, 24 * 4]
        assert len({r["load_process"] for r in m_req[cell_id]}) == 2
        # share 1's clock read 1000 s ahead: measured, and its requests put back on the owner's clock
        offsets = sorted(round(r["clock_offset_start_s"]) for r in m_req[cell_id])
        assert offsets[0] == -SKEW_S and offsets[-1] == 0
        assert all(cell["t_cell_start"] - 1 < r["t_sent"] < cell["t_cell_start"] + 60 for r in m_req[cell_id])
        assert 0 < cell["wall_s"] < 60 and cell["max_in_flight"] <= cell["concurrency"]
        for figure in ("ttft_s_p50", "e2e_s_p50"):  # every percentile remade from the joined requests
            ttft = sorted(r["ttft_s"] if figure == "ttft_s_p50" else r["e2e_s"] for r in m_req[cell_id])
            assert cell[figure] == pytest.approx((ttft[11] + ttft[12]) / 2)
    ttft = [[r["ttft_s"] for c in sorted(req) for r in req[c]] for req in (m_req, s_req)]
    assert mannwhitneyu(*ttft).pvalue > 0.01
    info = json.loads((merged / "run.json").read_text())
    assert [s["share"] for s in info["merged_from"]] == [0, 1] and info["status"] == "finished"
    assert (merged / "cells.parquet").exists() and (merged / "timelines").is_dir()
    done = CliRunner().invoke(app, ["report", str(merged), "--format", "br"])  # a merged run is a run
    assert done.exit_code == 0, done.output
    from llmd_benchmark_report import import_benchmark_report

    for path in sorted(merged.glob("benchmark_report_v0.2,_*.yaml")):  # every cell's start was recorded (v8)
        report = import_benchmark_report(str(path))
        cell = next(c for c in m_cells.values() if c["cell_id"] in path.name)
        assert report.scenario.load.standardized.parallelism == 2
        assert report.run.time.start.timestamp() == pytest.approx(cell["t_cell_start_unix"])
        assert report.results.request_performance.time_series is not None


def edited_copy(source: Path, dest: Path, info: dict | None = None, drop_cell: str | None = None) -> Path:
    shutil.copytree(source, dest)
    if info:
        (dest / "run.json").write_text(json.dumps({**json.loads((dest / "run.json").read_text()), **info}))
    if drop_cell:
        for name in ("cells.jsonl", "requests.jsonl"):
            kept = [r for r in rows(dest, name) if r["cell_id"] != drop_cell]
            (dest / name).write_text("".join(json.dumps(r) + "\n" for r in kept))
        for derived in dest.glob("*.parquet"):
            derived.unlink()
    return dest


def merge(*args):
    """``kvbench merge`` in this process: the experiment's shares merge in processes of their own, and these
    refusals are the merge's checks, not its process's (each process was 0.8 s of CPU, mostly imports)."""
    return CliRunner().invoke(app, ["merge", *map(str, args)])


def refused(*args) -> str:
    done = merge(*args)
    assert done.exit_code == 2, done.output
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: "), done.stderr
    return done.stderr


def test_folders_not_of_one_experiment_are_refused_naming_the_difference(experiment, tmp_path):
    exp = experiment / "exp"
    into = tmp_path / "m"
    assert "shares [1] of 2 have no folder" in refused(exp / "share-0", "--into", into)
    assert "is a share of 1 processes" in refused(exp / "share-0", experiment / "single", "--into", into)
    salted = edited_copy(exp / "share-1", tmp_path / "salted", {"prompt_salt": {"value": "other"}})
    assert "in its prompt salt" in refused(exp / "share-0", salted, "--into", into)
    info = json.loads((exp / "share-1" / "run.json").read_text())
    seeded = edited_copy(exp / "share-1", tmp_path / "seeded", {"workload": {**info["workload"], "seed": 6}})
    assert "in its workload (seed)" in refused(exp / "share-0", seeded, "--into", into)
    assert "both share 0 of 2" in refused(exp / "share-0", edited_copy(exp / "share-0", tmp_path / "again"),
                                          "--into", into)
    assert "already exists" in refused(exp / "share-0", exp / "share-1", "--into", exp / "merged")
    assert not into.exists()  # nothing written


def test_a_share_that_died_mid_run_is_refused_or_merged_with_its_requests_lost(experiment, tmp_path):
    exp = experiment / "exp"
    last = rows(exp / "share-1", "cells.jsonl")[-1]["cell_id"]
    dead = edited_copy(exp / "share-1", tmp_path / "dead", {"status": "running"}, drop_cell=last)
    message = refused(exp / "share-0", dead, "--into", tmp_path / "m")
    assert f"share 1 of 2 ({dead}) has no row for it (its run: running) for cell {last}" in message
    assert "--accept-lost" in message
    done = merge(exp / "share-0", dead, "--into", tmp_path / "m", "--accept-lost")
    assert done.exit_code == 0, done.output
    assert "12 of them lost" in done.stdout
    cells = {c["cell_id"]: c for c in rows(tmp_path / "m", "cells.jsonl")}
    whole, cut = [c for c in cells.values() if c["cell_id"] != last][0], cells[last]
    assert (whole["n_requests"], whole["n_lost"], whole["status"]) == (24, 0, "ok")
    assert (cut["n_requests"], cut["n_ok"], cut["n_failed"], cut["n_lost"]) == (24, 12, 12, 12)
    assert cut["status"] == "flagged" and cut["flags"][0].startswith("12 requests lost: load process share 1")
    requests = measured(tmp_path / "m")[last]
    assert sorted(r["ordinal"] for r in requests) == list(range(24))  # the lost ones keep their places
    assert sum(1 for r in requests if (r["error"] or "").startswith("lost: ")) == 12
