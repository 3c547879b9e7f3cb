"""`kvbench compare` on planted changes, end to end (the command in a process of its own, its exit code,
table and JSON).

Speed (issue 13's acceptance): a mock engine 10 % slower is caught at the repeats the README recommends (10,
interleaved), and an unchanged one is not flagged. The mock engines are tests/fakes/openai_server.py servers
whose every token (the first too) takes ``token_delay_s``: 10 ms against 11 ms is a 10 % slower engine, TTFT
and ITL alike (the harness's own overhead is well under a millisecond a token). The servers are not probed: they
are declared to take token ids and ignore_eos, and have no warm-up: each repeat's session is its five requests of two
tokens (with a warm-up of 8 tokens and four tokens a request, the fixture took 11 s instead of 5; without them
the 10 % engine's TTFT interval still started above +8 % in five runs, two of them beside a busy core).
The baseline, the slower engine and an unchanged copy of the baseline run in one interleaved run (ABC CBA ABC
...), which compare reads as paired repeats of whichever two it is given.

KV memory: synthetic runs (tests/synth.py) identical but for the candidate's KV bytes in use: more than the
1 % tolerance is a regression, less an improvement, a change within it unchanged.
"""
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.workloads import load

from tests.fakes.openai_server import FakeOpenAI
from tests.helpers import REPO

WORKLOAD = """name = "planted"
description = "one short rung, five requests a cell: for compare's acceptance test"
seed = 3
prompt_tokens = [64]
output_tokens = 2
concurrency = [1]
rounds = 5
warmup_requests = 0
"""
# each engine's token time: the baseline, one 10 % slower, and the baseline again (unchanged)
TOKEN_DELAYS_S = {"baseline": 0.010, "10%-slower": 0.011, "unchanged": 0.010}
DECLARED = "probe=false,token_ids=true,ignore_eos=true"  # what the stand-ins take, instead of probing them


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, smollm2) -> tuple[Path, dict[str, str]]:
    """One interleaved run of the three mock engines, 10 repeats each: (the run, each engine's backend label)."""
    tmp_path = tmp_path_factory.mktemp("planted")
    (tmp_path / "planted.toml").write_text(WORKLOAD)
    servers = {name: FakeOpenAI(token_delay_s=delay) for name, delay in TOKEN_DELAYS_S.items()}
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.enter_context(server)
        opts = RunOptions(model="smollm2", workload=load(str(tmp_path / "planted.toml")), results_dir=tmp_path,
                          run_id="abc", repeats=10, interleave=True, estimate=False,
                          backends=[BackendConfig.parse(f"openai:url={s.url},{DECLARED}") for s in servers.values()])
        run_dir = Runner(opts, Console(file=io.StringIO())).run()
    return run_dir, {name: f"openai@127.0.0.1:{s.port}" for name, s in servers.items()}


def kvbench_compare(*args, json_file: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """``kvbench compare ARGS --json FILE`` in a process of its own: (the process, the JSON it wrote)."""
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "compare", *map(str, args), "--json", str(json_file)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert json_file.exists(), proc.stdout + proc.stderr
    return proc, json.loads(json_file.read_text())


@pytest.fixture(scope="module")
def planted_compares(planted_run, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, dict]]:
    """``kvbench compare`` of the baseline with each candidate, the two processes at once (one a core: the
    planted tests run alone, so a second process would otherwise wait for nothing): candidate -> (the
    process, the JSON it wrote)."""
    run_dir, labels = planted_run
    folder = tmp_path_factory.mktemp("compares")
    procs = {}
    for candidate in ("10%-slower", "unchanged"):
        args = [run_dir, "--baseline-backend", labels["baseline"], "--candidate-backend", labels[candidate],
                "--json", folder / f"{candidate}.json"]
        procs[candidate] = (args, subprocess.Popen([sys.executable, "-m", "kvbench.cli", "compare", *map(str, args)],
                                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    for candidate, (args, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        json_file = folder / f"{candidate}.json"
        assert json_file.exists(), stdout + stderr
        out[candidate] = (subprocess.CompletedProcess(args, proc.returncode, stdout, stderr),
                          json.loads(json_file.read_text()))
    return out


def metric(result: dict, name: str) -> list[dict]:
    """``name``'s entry in every compared cell."""
    return [m for c in result["cells"] for m in c["metrics"] if m["metric"] == name]


def table_rows(stdout: str, name: str) -> list[list[str]]:
    """The cells of the Markdown table's rows for metric ``name``."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("|")]
    return [r for r in rows if name in r]


INTERLEAVED = "interleaved run (run.json: interleaved)"  # bench/compare/runs.py interleaving(): paired repeats


@pytest.mark.parametrize("candidate, expected_exit", [("10%-slower", 1), ("unchanged", 0)],
                         ids=["10%-slower", "unchanged"])
def test_compare_catches_a_planted_regression_and_passes_an_unchanged_engine(planted_compares, candidate,
                                                                             expected_exit):
    proc, result = planted_compares[candidate]
    # an unchanged engine is never a regression: unchanged (exit 0), or inconclusive (exit 3) where an interval
    # of the 10 pairs is still wider than its tolerance
    expected_exit = expected_exit or {"unchanged": 0, "inconclusive": 3}.get(result["verdict"], -1)
    assert proc.returncode == expected_exit == result["exit_code"], proc.stdout + proc.stderr
    verdict_line = proc.stdout.splitlines()[2]  # after the "# kvbench compare: ..." title: the verdict first
    ttft = metric(result, "ttft_s_p50")
    assert len(ttft) == 1  # one rung, one concurrency: one cell
    if candidate == "10%-slower":
        assert result["verdict"] == "REGRESSION" and verdict_line.startswith("**REGRESSION** (exit 1):"), verdict_line
        assert ttft[0]["verdict"] == "regression" and ttft[0]["ci_low"] > 0.05
        assert table_rows(proc.stdout, "ttft_s_p50")[0][8] == "REGRESSION"
    else:
        assert not result["regression_found"]
        assert verdict_line.startswith(f"**{result['verdict']}** (exit {expected_exit}):")
        assert result["summary"]["regression"] == 0
        assert ttft[0]["verdict"] in ("unchanged", "inconclusive")
    # the repeats are paired (interleaved A/B), not two independent samples: the paired t-interval on every
    # metric measured on both sides, over the run's 10 pairs
    assert result["pairing"] == INTERLEAVED and f"Repeats: {INTERLEAVED}." in proc.stdout
    measured = [m for c in result["cells"] for m in c["metrics"] if m["method"]]
    assert {m["metric"] for m in measured} >= {"ttft_s_p50", "itl_s_p50", "e2e_s_p50", "output_tokens_per_s"}
    assert {(m["paired"], m["method"]) for m in measured} == {(True, "paired t-interval on the log ratio, 10 pairs")}
    assert table_rows(proc.stdout, "ttft_s_p50")[0][-1] == "paired t-interval on the log ratio, 10 pairs"
    assert all(r["paired"] for r in result["repeats_needed"]) and "pairs here" in proc.stdout
    assert "repeats per side" not in proc.stdout


# --- KV memory: the regression and improvement verdicts on KV bytes in use -------------------------------

@pytest.fixture(scope="module")
def kv_base(tmp_path_factory):
    from tests.synth import make_run

    return make_run(tmp_path_factory.mktemp("kv"), "base", backends=[("vllm", "0.31.0")], seed=5, repeats=3,
                    noise=0.002)


# candidate KV / baseline KV -> compare's verdict on kv_in_use_peak_bytes (tolerance 1 %) and exit code
KV_CASES = {"5%-more": (1.05, "regression", 1), "20%-less": (0.80, "improvement", 4),
            "0.5%-more": (1.005, "unchanged", 0)}


@pytest.mark.parametrize("case", list(KV_CASES))
def test_compare_calls_more_kv_a_regression_and_less_an_improvement(tmp_path, kv_base, case):
    from tests.synth import make_run

    factor, verdict, exit_code = KV_CASES[case]
    # the same seed: every figure of the candidate is the baseline's but its KV bytes in use
    cand = make_run(tmp_path, "cand", backends=[("vllm", "0.32.0")], seed=5, repeats=3, noise=0.002,
                    scale={"vllm-0.32.0": {"kv": factor}})
    proc, result = kvbench_compare(kv_base, cand, json_file=tmp_path / "compare.json")
    assert proc.returncode == exit_code == result["exit_code"], proc.stdout + proc.stderr
    kv = metric(result, "kv_in_use_peak_bytes")
    assert len(kv) == result["summary"]["compared_cells"] == 4
    assert [m["verdict"] for m in kv] == [verdict] * 4
    for m in kv:
        assert m["change"] == pytest.approx(factor - 1, rel=1e-9)
        assert m["ci_low"] == pytest.approx(factor - 1, rel=1e-9) == m["ci_high"]  # identical repeats: the point
        assert m["candidate"] == pytest.approx(m["baseline"] * factor, rel=1e-9)
    others = [m for c in result["cells"] for m in c["metrics"] if m["metric"] != "kv_in_use_peak_bytes" and m["method"]]
    assert {m["metric"] for m in others} >= {"ttft_s_p50", "itl_s_p50", "output_tokens_per_s", "rss_peak_bytes"}
    assert all(m["change"] == pytest.approx(0, abs=1e-12) for m in others)  # nothing else moved
    assert {m["verdict"] for m in others} == {"unchanged"}
    summary = result["summary"]
    assert (summary["regression"], summary["improvement"]) == {"regression": (4, 0), "improvement": (0, 4),
                                                               "unchanged": (0, 0)}[verdict]
    assert result["regression_found"] is (verdict == "regression")
    assert result["verdict"] == ("REGRESSION" if verdict == "regression" else verdict)
    rows = table_rows(proc.stdout, "kv_in_use_peak_bytes")
    assert len(rows) == 4 and {r[5] for r in rows} == {f"{(factor - 1) * 100:+.1f}%"}
    assert {r[8] for r in rows} == {verdict.upper() if verdict == "regression" else verdict}
