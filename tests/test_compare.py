"""kvbench compare: cell matching, verdicts on known changes, exit codes and the JSON output."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.compare import DEFAULT_MATCH, load_config

from .synth import make_run

PUBLISHED = Path(__file__).resolve().parent.parent / "results/published/20261129-143003-cpu-default"
runner = CliRunner()


def kvbench(*args):
    return runner.invoke(app, [str(a) for a in args])


def as_json(result) -> dict:
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        # 5 repeats per cell, 1 % run-to-run noise (sd) and 5 % between requests
        "base": make_run(root, "base", backends=[("vllm", "0.31.0")], seed=1, noise=0.01, repeats=5),
        "slower": make_run(root, "slower", backends=[("vllm", "0.32.0")], seed=2, noise=0.01, repeats=5,
                           scale={"vllm-0.32.0": {"latency": 1.10, "throughput": 1 / 1.10}}),
        "same": make_run(root, "same", backends=[("vllm", "0.32.0")], seed=3, noise=0.01, repeats=5),
        "both": make_run(root, "both", backends=[("vllm", "0.31.0"), ("vllm", "0.32.0")], seed=4, noise=0.01, repeats=5,
                         scale={"vllm-0.32.0": {"latency": 1.10}}),
    }


def verdicts(result: dict, metric: str) -> set[str]:
    return {m["verdict"] for c in result["cells"] for m in c["metrics"] if m["metric"] == metric}


def test_default_match_ignores_the_engine_version():
    assert "engine_version" not in DEFAULT_MATCH and "engine" in DEFAULT_MATCH and "concurrency" in DEFAULT_MATCH


def test_a_real_10_percent_regression_exits_1(runs, tmp_path):
    out = kvbench("compare", runs["base"], runs["slower"], "--format", "json", "--json", tmp_path / "c.json")
    assert out.exit_code == 1, out.output
    result = as_json(out)
    assert result == json.loads((tmp_path / "c.json").read_text())
    assert result["regression_found"] and result["summary"]["compared_cells"] == 4
    assert verdicts(result, "ttft_s_p50") == {"regression"}
    assert verdicts(result, "output_tokens_per_s") == {"regression"}  # lower throughput is worse
    assert verdicts(result, "kv_in_use_peak_bytes") == {"unchanged"}
    m = next(m for m in result["cells"][0]["metrics"] if m["metric"] == "ttft_s_p50")
    assert m["change"] == pytest.approx(0.10, abs=0.03) and m["ci_low"] > 0.05
    assert m["method"].startswith("Welch t-interval") and (m["n_baseline"], m["n_candidate"]) == (5, 5)


def test_noise_only_exits_0(runs):
    out = kvbench("compare", runs["base"], runs["same"])
    assert out.exit_code == 0, out.output
    assert "no regression" in out.stdout and "REGRESSION" not in out.stdout


def test_json_schema(runs):
    result = as_json(kvbench("compare", runs["base"], runs["same"], "--format", "json"))
    assert result["schema"] == "kvbench.compare/1"
    assert set(result) >= {"match_on", "confidence", "tolerances", "baseline", "candidate", "cells", "only_in_baseline",
                           "only_in_candidate", "contract_mismatch", "failed", "summary", "regression_found",
                           "exit_code"}
    cell = result["cells"][0]
    assert set(cell) >= {"key", "baseline_backend", "candidate_backend", "repeats", "token_contract", "metrics"}
    assert cell["key"]["engine"] == "vllm" and "engine_version" not in cell["key"]
    assert (cell["baseline_backend"], cell["candidate_backend"]) == ("vllm-0.31.0", "vllm-0.32.0")
    for m in cell["metrics"]:
        assert set(m) >= {"metric", "worse", "tolerance", "baseline", "candidate", "change", "ci_low", "ci_high",
                          "method", "n_baseline", "n_candidate", "verdict", "note"}
        assert m["verdict"] in {"regression", "improvement", "unchanged", "inconclusive", "not compared"}
    assert result["tolerances"]["ttft_s_p50"] == 0.05


def test_two_versions_in_one_run(runs):
    out = kvbench("compare", runs["both"], "--baseline-backend", "vllm-0.31.0", "--candidate-backend", "vllm-0.32.0",
                  "--format", "json")
    assert out.exit_code == 1, out.output
    assert "regression" in verdicts(as_json(out), "ttft_s_p50")
    assert verdicts(as_json(out), "ttft_s_p50") <= {"regression", "inconclusive"}
    # without the backends the run is ambiguous: a usage error
    assert kvbench("compare", runs["both"]).exit_code == 2
    assert kvbench("compare", runs["both"], runs["base"]).exit_code == 2  # two backends for one cell
    missing = kvbench("compare", runs["both"], "--baseline-backend", "vllm-9", "--candidate-backend", "vllm-0.32.0")
    assert missing.exit_code == 2 and "no backend 'vllm-9'" in missing.output


def test_cells_in_one_run_only_and_different_contracts_are_listed_not_compared(tmp_path):
    base = make_run(tmp_path, "b", prompts=(1024, 2048), concurrency=(1,), repeats=2, seed=1)
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], prompts=(1024, 4096), concurrency=(1,),
                    repeats=2, seed=2)
    result = as_json(kvbench("compare", base, cand, "--format", "json"))
    assert [c["key"]["prompt_tokens"] for c in result["cells"]] == [1024]
    assert [c["key"]["prompt_tokens"] for c in result["only_in_baseline"]] == [2048]
    assert [c["key"]["prompt_tokens"] for c in result["only_in_candidate"]] == [4096]
    table = kvbench("compare", base, cand).stdout
    assert "Only in the baseline" in table and "vllm p2048 x1" in table and "vllm p4096 x1" in table

    other = make_run(tmp_path, "d", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(1,), repeats=2,
                     contract="text prompt, eos allowed")
    out = kvbench("compare", base, other, "--format", "json")
    result = as_json(out)
    assert result["cells"] == [] and result["contract_mismatch"][0]["candidate_contract"] == ["text prompt, eos allowed"]
    assert out.exit_code == 2  # nothing could be compared


def test_nothing_in_common_exits_2(tmp_path):
    base = make_run(tmp_path, "b", prompts=(1024,), concurrency=(1,), repeats=2)
    cand = make_run(tmp_path, "c", prompts=(2048,), concurrency=(1,), repeats=2)
    out = kvbench("compare", base, cand)
    assert out.exit_code == 2 and "nothing to compare" in out.stdout


def test_a_cell_that_fails_on_the_candidate_is_a_regression(tmp_path):
    base = make_run(tmp_path, "b", prompts=(1024,), concurrency=(1, 4), repeats=2, seed=1)
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(1, 4), repeats=2,
                    seed=2, failed={("vllm-0.32.0", 1024, 4)})
    out = kvbench("compare", base, cand, "--format", "json")
    assert out.exit_code == 1
    failed = as_json(out)["failed"]
    assert failed[0]["failed_on"] == "candidate" and "engine failed to start" in failed[0]["errors"][0]


def test_single_run_latency_intervals_come_from_the_requests(tmp_path):
    base = make_run(tmp_path, "b", prompts=(1024,), concurrency=(4,), repeats=1, n_requests=40, seed=1)
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(4,), repeats=1,
                    n_requests=40, seed=2, noise=0.0, scale={"vllm-0.32.0": {"latency": 1.10}})
    out = kvbench("compare", base, cand, "--format", "json")
    metrics = {m["metric"]: m for m in as_json(out)["cells"][0]["metrics"]}
    assert metrics["ttft_s_p50"]["method"].startswith("single run: interval from requests")
    assert metrics["ttft_s_p50"]["verdict"] == "regression" and out.exit_code == 1
    assert metrics["itl_s_p50"]["method"].startswith("single run")
    # throughput has no per-request samples: one repeat gives no interval, and says why
    assert metrics["output_tokens_per_s"]["verdict"] == "not compared"
    assert "--repeats" in metrics["output_tokens_per_s"]["note"]


def test_tolerances_file_and_bad_input(runs, tmp_path):
    loose = tmp_path / "loose.toml"
    loose.write_text("[tolerance]\nttft_s_p50 = 0.5\nttft_s_p99 = 0.5\nitl_s_p50 = 0.5\nitl_s_p99 = 0.5\n"
                     "tpot_s_p50 = 0.5\ne2e_s_p50 = 0.5\ne2e_s_p99 = 0.5\noutput_tokens_per_s = 0.5\n"
                     "total_tokens_per_s = 0.5\nrequests_per_s = 0.5\n")
    out = kvbench("compare", runs["base"], runs["slower"], "--tolerances", loose)
    assert out.exit_code == 0, out.output
    config = load_config(loose)
    assert config.tolerances["ttft_s_p50"] == 0.5 and config.tolerances["kv_in_use_peak_bytes"] == 0.01
    off = tmp_path / "off.toml"
    off.write_text("[tolerance]\nttft_s_p50 = false\n")
    assert "ttft_s_p50" not in load_config(off).tolerances
    bad = tmp_path / "bad.toml"
    bad.write_text("[tolerance]\nttft_ms = 0.1\n")
    out = kvbench("compare", runs["base"], runs["slower"], "--tolerances", bad)
    assert out.exit_code == 2 and "unknown metric" in out.output
    assert kvbench("compare", runs["base"], tmp_path).exit_code == 2  # not a run folder
    assert kvbench("compare", runs["base"], runs["same"], "--match-on", "engine,colour").exit_code == 2


def test_the_published_v1_run_against_itself_is_unchanged():
    out = kvbench("compare", PUBLISHED, PUBLISHED, "--format", "json")
    assert out.exit_code == 0, out.output
    result = as_json(out)
    assert result["summary"]["compared_cells"] == 24 and result["summary"]["regression"] == 0
    changes = [m["change"] for c in result["cells"] for m in c["metrics"] if m["change"] is not None]
    assert changes and all(abs(x) < 1e-12 for x in changes)


def test_single_run_itl_samples_are_the_metrics_own():
    """The bootstrap's ITL samples are kvbench.metrics' per-gap samples: tokens read together count as one
    chunk, tokens that came with the first chunk are TTFT's, and only ok requests count."""
    import pandas as pd

    from kvbench.compare import Side, _samples
    from kvbench.metrics import RequestTimes

    times, tokens = [1.0, 1.0, 1.2, 1.2, 1.5], [1, 1, 1, 1, 2]
    requests = pd.DataFrame([
        dict(run_id="r", cell_id="c", repeat=0, ok=True, counted=True, chunk_times=times, chunk_tokens=tokens, ttft_s=0.5),
        dict(run_id="r", cell_id="c", repeat=0, ok=False, counted=True, chunk_times=[1.0, 9.0], chunk_tokens=[1, 1], ttft_s=9.0),
        dict(run_id="r", cell_id="other", repeat=0, ok=True, counted=True, chunk_times=[1.0, 3.0], chunk_tokens=[1, 1], ttft_s=7.0)])
    side = Side("baseline", pd.DataFrame(), requests)
    rows = pd.DataFrame([dict(run_id="r", cell_id="c", repeat=0)])
    expected = RequestTimes(0.0, tuple(times), tuple(tokens)).itl_samples()
    assert _samples(side, rows, "itl") == expected == pytest.approx([0.1, 0.1, 0.15, 0.15])
    assert _samples(side, rows, "ttft_s") == [0.5]
