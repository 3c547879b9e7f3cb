"""kvbench compare: cell matching, verdicts on known changes, exit codes and the JSON output."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.compare.runs import DEFAULT_MATCH, load_config

from tests.synth import make_run
from tests.helpers import REPO

PUBLISHED = REPO / "results/published/20261129-143003-cpu-default"
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


def test_noise_only_is_never_a_regression_and_inconclusive_is_not_a_pass(runs):
    out = kvbench("compare", runs["base"], runs["same"], "--format", "json")
    result = as_json(out)
    assert not result["regression_found"] and result["summary"]["regression"] == 0
    # 5 repeats of 16 requests: two p50s at concurrency 1 are still wider than their 5 % (an interval of
    # about +-5 %): inconclusive, exit 3, and how many repeats would settle them
    assert result["verdict"] == "inconclusive" and out.exit_code == 3 == result["exit_code"]
    inconclusive = [m for c in result["cells"] for m in c["metrics"] if m["verdict"] == "inconclusive"]
    assert inconclusive and all(m["ci_high"] - m["ci_low"] > 0 for m in inconclusive)
    assert all(m["ci_low"] < m["tolerance"] and (m["ci_high"] > m["tolerance"] or m["ci_low"] < -m["tolerance"])
               for m in inconclusive)
    settle = result["settle"]
    assert settle["inconclusive"] == len(inconclusive) and settle["median"] > 5 and settle["repeats_now"] == 5
    text = kvbench("compare", runs["base"], runs["same"]).stdout
    assert "**inconclusive** (exit 3)" in text and f"needs about {settle['median']} repeats per side" in text
    # a gate that asks only for no evidence of a regression passes it, and says so
    passed = kvbench("compare", runs["base"], runs["same"], "--pass-unless-regression")
    assert passed.exit_code == 0 and "**inconclusive** (exit 0)" in passed.stdout
    assert "--pass-unless-regression" in passed.stdout
    # ... but never a regression
    assert kvbench("compare", runs["base"], runs["slower"], "--pass-unless-regression").exit_code == 1


@pytest.mark.parametrize("case, scale, verdict, exit_code", [
    ("unchanged", {}, "unchanged", 0),
    ("regression", {"latency": 1.25, "throughput": 0.8}, "REGRESSION", 1),
    ("improvement", {"latency": 0.8, "throughput": 1.25}, "improvement", 4),
])
def test_each_verdict_has_its_own_exit_code(tmp_path, case, scale, verdict, exit_code):
    quiet = {"prompts": (1024,), "concurrency": (4,), "repeats": 8, "noise": 0.005}
    base = make_run(tmp_path, "b", seed=1, **quiet)
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], seed=3, scale={"vllm-0.32.0": scale}, **quiet)
    out = kvbench("compare", base, cand, "--format", "json")
    result = as_json(out)
    assert (result["verdict"], result["exit_code"], out.exit_code) == (verdict, exit_code, exit_code), result["summary"]
    assert result["summary"]["inconclusive"] == 0
    if case == "unchanged":
        assert {m["verdict"] for c in result["cells"] for m in c["metrics"]} <= {"unchanged", "not compared"}
    passed = kvbench("compare", base, cand, "--pass-unless-regression")
    assert passed.exit_code == (1 if case == "regression" else 0)


def test_the_published_upgrade_run_is_inconclusive_not_a_pass():
    upgrade = PUBLISHED.parent / "20261129-vllm-upgrade-cpu"
    out = kvbench("compare", upgrade, "--baseline-backend", "vllm-0.31.0", "--candidate-backend", "vllm-0.32.0",
                  "--format", "json")
    result = as_json(out)
    assert out.exit_code == 3 and result["verdict"] == "inconclusive"
    assert result["summary"]["inconclusive"] >= 40 and result["summary"]["regression"] == 0
    assert result["settle"]["median"] > 3  # this run has 3 repeats: more would settle it


def test_an_attached_server_without_a_version_is_unknown_not_the_same_version(tmp_path):
    base = make_run(tmp_path, "b", backends=[("openai", "v1")], prompts=(1024,), concurrency=(1,), repeats=3,
                    seed=1, reported={"openai-v1": None})
    cand = make_run(tmp_path, "c", backends=[("openai", "v1")], prompts=(1024,), concurrency=(1,), repeats=3,
                    seed=2, reported={"openai-v1": None}, scale={"openai-v1": {"latency": 1.25}})
    out = kvbench("compare", base, cand)
    assert out.exit_code == 1 and "SAME ENGINE VERSION" not in out.output
    assert "ENGINE VERSION UNKNOWN on the baseline and candidate" in out.stdout
    known = make_run(tmp_path, "k", backends=[("openai", "v1")], prompts=(1024,), concurrency=(1,), repeats=3,
                     seed=3, reported={"openai-v1": "0.32.0"})
    mixed = kvbench("compare", base, known)
    assert "ENGINE VERSION UNKNOWN on the baseline:" in mixed.stdout and "candidate: 0.32.0" in mixed.stdout


def test_the_two_published_cpu_default_runs_compare(tmp_path):
    """The older one is schema v1 (its record as written: cells.jsonl.bak), whose rows did not record the
    token contract: migrated to what every v1 backend did, so its cells match the newer run's."""
    import shutil

    older = tmp_path / PUBLISHED.name
    shutil.copytree(PUBLISHED, older, ignore=shutil.ignore_patterns("*.parquet", "plots", "report.*"))
    shutil.copy2(older / "cells.jsonl.bak", older / "cells.jsonl")
    assert json.loads((older / "cells.jsonl").read_text().splitlines()[0])["schema_version"] == 1
    newer = PUBLISHED.parent / "20261130-194844-cpu-default"
    out = kvbench("compare", older, newer, "--format", "json")
    result = as_json(out)
    assert result["summary"]["contract_mismatch"] == 0 and result["summary"]["compared_cells"] == 24
    assert {tuple(c["token_contract"]) for c in result["cells"]} == {("token ids, output forced",)}
    assert out.exit_code == result["exit_code"] != 2


def test_the_published_upgrade_comparison_is_what_compare_writes_today(tmp_path, monkeypatch):
    """results/published's vLLM upgrade run carries the comparison it was published with: kvbench compare,
    run again with the recorded arguments, writes the same JSON (a key compare has come to write, left out
    there, fails this: the published figures are written again when compare changes)."""
    from kvbench.selfcheck.regenerate_published import COMPARISONS

    name = "20261129-vllm-upgrade-cpu"
    monkeypatch.chdir(REPO)  # the comparison names its run folder as it was given, relative to the repository
    out = kvbench("compare", f"results/published/{name}", *COMPARISONS[name], "--json", tmp_path / "compare.json")
    assert out.exit_code in (0, 1, 3, 4), out.stdout
    assert json.loads((tmp_path / "compare.json").read_text()) == \
        json.loads((REPO / "results/published" / name / "compare.json").read_text())


def test_failed_cells_are_headed_by_the_side_they_failed_on(tmp_path):
    base = make_run(tmp_path, "b", prompts=(1024,), concurrency=(1, 4), repeats=2, seed=1,
                    failed={("vllm-0.31.0", 1024, 4)})
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(1, 4), repeats=2,
                    seed=2)
    out = kvbench("compare", base, cand)
    assert "## Failed on the baseline or on both (not compared)" in out.stdout
    assert "counted as regressions" not in out.stdout and out.exit_code != 1


def test_json_schema(runs):
    result = as_json(kvbench("compare", runs["base"], runs["same"], "--format", "json"))
    assert result["schema"] == "kvbench.compare/3"
    assert list(result)[:6] == ["schema", "verdict", "exit_code", "regression_found", "summary", "settle"]
    assert set(result) >= {"warnings", "pairing", "repeats_needed", "match_on", "confidence", "tolerances", "baseline", "candidate", "cells", "only_in_baseline",
                           "only_in_candidate", "contract_mismatch", "failed", "summary", "regression_found",
                           "exit_code"}
    cell = result["cells"][0]
    assert set(cell) >= {"key", "baseline_backend", "candidate_backend", "repeats", "token_contract", "metrics"}
    assert cell["key"]["engine"] == "vllm" and "engine_version" not in cell["key"]
    assert (cell["baseline_backend"], cell["candidate_backend"]) == ("vllm-0.31.0", "vllm-0.32.0")
    for m in cell["metrics"]:
        assert set(m) >= {"metric", "worse", "tolerance", "baseline", "candidate", "change", "ci_low", "ci_high",
                          "method", "n_baseline", "n_candidate", "verdict", "note", "paired", "noise_log_sd",
                          "repeats_needed", "repeats_to_settle"}
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
    assert any(w.startswith("SINGLE RUN") for w in as_json(out)["warnings"])
    assert metrics["itl_s_p50"]["method"].startswith("single run")
    # throughput has no per-request samples: one repeat gives no interval, says why, and is no evidence
    assert metrics["output_tokens_per_s"]["verdict"] == "inconclusive"
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


def test_a_run_compared_with_itself_is_refused_loudly():
    out = kvbench("compare", PUBLISHED, PUBLISHED, "--format", "json")
    assert out.exit_code == 2 and "SELF-COMPARISON" in out.output


def test_a_copy_of_a_run_compared_with_the_original_is_a_self_comparison(runs, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(runs["base"], copy)
    out = kvbench("compare", runs["base"], copy)
    assert out.exit_code == 2 and "SELF-COMPARISON" in out.output


def test_single_run_itl_samples_are_the_metrics_own():
    """The bootstrap's ITL samples are kvbench.common.metrics' per-gap samples: tokens read together count as one
    chunk, tokens that came with the first chunk are TTFT's, and only ok requests count."""
    import pandas as pd

    from kvbench.common.metrics import RequestTimes
    from kvbench.compare.runs import Side, _samples

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


def _set_env(run: Path, **env):
    info = json.loads((run / "run.json").read_text())
    info["environment"].update(env)
    (run / "run.json").write_text(json.dumps(info))


def test_the_verdict_comes_first_then_the_table(runs):
    out = kvbench("compare", runs["base"], runs["slower"])
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines[1].startswith("**REGRESSION** (exit 1): ") and "regressions" in lines[1] and "inconclusive" in lines[1]
    assert out.stdout.index("**REGRESSION**") < out.stdout.index("| cell |")
    assert "needs about" in out.stdout and "repeats per side here" in out.stdout


def test_the_same_engine_version_on_both_sides_is_warned_about(runs, tmp_path):
    again = make_run(tmp_path, "again", backends=[("vllm", "0.31.0")], seed=9, noise=0.01, repeats=5)
    out = kvbench("compare", runs["base"], again)
    assert out.exit_code in (0, 3)  # no regression: unchanged, or inconclusive
    assert "SAME ENGINE VERSION" in out.stdout and "SAME ENGINE VERSION" in out.stderr
    # first thing after the verdict
    assert out.stdout.index("SAME ENGINE VERSION") < out.stdout.index("| cell |")


def test_runs_from_different_hardware_are_refused_unless_allowed(tmp_path):
    base = make_run(tmp_path, "b", prompts=(1024,), concurrency=(1,), repeats=3, seed=1)
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(1,), repeats=3, seed=2)
    _set_env(base, cpu_flags=["avx2", "avx512f", "avx512_bf16"])
    _set_env(cand, cpu_flags=["avx2"])
    out = kvbench("compare", base, cand)
    assert out.exit_code == 2 and "DIFFERENT HARDWARE" in out.output and "--allow-different-hardware" in out.output
    allowed = kvbench("compare", base, cand, "--allow-different-hardware", "--format", "json")
    assert allowed.exit_code in (0, 3) and "DIFFERENT HARDWARE" in as_json(allowed)["warnings"][0]
    _set_env(cand, cpu_flags=["avx2", "avx512f", "avx512_bf16"])
    assert kvbench("compare", base, cand).exit_code in (0, 3)  # compared: no bad-input exit


def test_one_run_pairs_the_repeats_by_index(runs):
    result = as_json(kvbench("compare", runs["both"], "--baseline-backend", "vllm-0.31.0",
                             "--candidate-backend", "vllm-0.32.0", "--format", "json"))
    m = next(m for m in result["cells"][0]["metrics"] if m["metric"] == "ttft_s_p50")
    assert m["paired"] and m["method"].startswith("paired t-interval") and m["n_baseline"] == 5
    assert result["pairing"].startswith("one run")


def test_interleaved_runs_pair_and_separate_runs_do_not(tmp_path):
    base = make_run(tmp_path, "b", prompts=(1024,), concurrency=(1,), repeats=3, seed=1)
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(1,), repeats=3, seed=2)
    m = as_json(kvbench("compare", base, cand, "--format", "json"))["cells"][0]["metrics"][0]
    assert not m["paired"] and m["method"].startswith("Welch")
    for run in (base, cand):
        info = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**info, "interleaved": True}))
    result = as_json(kvbench("compare", base, cand, "--format", "json"))
    assert result["cells"][0]["metrics"][0]["paired"] and result["pairing"].startswith("interleaved")


def test_no_interval_crosses_minus_100_percent(tmp_path):
    """Very noisy repeats (50 %): the delta method gave intervals below -100 %; the log ratio cannot."""
    base = make_run(tmp_path, "b", prompts=(1024,), concurrency=(1,), repeats=3, seed=1, noise=0.5)
    cand = make_run(tmp_path, "c", backends=[("vllm", "0.32.0")], prompts=(1024,), concurrency=(1,), repeats=3,
                    seed=2, noise=0.5)
    result = as_json(kvbench("compare", base, cand, "--format", "json"))
    lows = [m["ci_low"] for c in result["cells"] for m in c["metrics"] if m["ci_low"] is not None]
    assert lows and min(lows) > -1


def test_output_folder_holds_markdown_json_and_html_with_the_forest_plot(runs, tmp_path):
    out = kvbench("compare", runs["base"], runs["slower"], "-o", tmp_path / "cmp")
    assert out.exit_code == 1
    folder = tmp_path / "cmp"
    assert (folder / "compare.md").read_text().strip() == out.stdout.strip()
    assert json.loads((folder / "compare.json").read_text())["verdict"] == "REGRESSION"
    page = (folder / "compare.html").read_text()
    assert page.count("data:image/png;base64,") == 1 and "REGRESSION" in page and "<table>" in page
    assert (folder / "compare_forest.png").stat().st_size > 5000


@pytest.mark.parametrize("noise", [0.02])
def test_a_planted_10_percent_ttft_regression_is_caught_at_10_repeats_and_noise_is_not(tmp_path, noise):
    """The README recommends 10 repeats: at 2 % run-to-run noise (plus the requests' own 5 %), an engine 10 %
    slower in TTFT is flagged, and an unchanged one is not flagged anywhere."""
    base = make_run(tmp_path, "b", seed=11, noise=noise, repeats=10)
    slower = make_run(tmp_path, "s", backends=[("vllm", "0.32.0")], seed=12, noise=noise, repeats=10,
                      scale={"vllm-0.32.0": {"latency": 1.10}})
    same = make_run(tmp_path, "u", backends=[("vllm", "0.32.0")], seed=13, noise=noise, repeats=10)
    caught = as_json(kvbench("compare", base, slower, "--format", "json"))
    assert caught["exit_code"] == 1
    ttft = [m for c in caught["cells"] for m in c["metrics"] if m["metric"] == "ttft_s_p50"]
    assert sum(m["verdict"] == "regression" for m in ttft) >= 3 and all(m["ci_high"] > 0.05 for m in ttft)
    quiet = as_json(kvbench("compare", base, same, "--format", "json"))
    assert quiet["exit_code"] == 0 and quiet["summary"]["regression"] == 0


def test_pairs_only_when_each_repeat_index_is_once_on_each_side():
    from kvbench.compare.runs import _pairs

    assert _pairs([(0, 1.0), (1, 2.0)], [(1, 4.0), (0, 3.0)]) == ([1.0, 2.0], [3.0, 4.0])
    assert _pairs([(0, 1.0), (0, 2.0)], [(0, 3.0), (1, 4.0)]) is None  # two runs on a side: repeat 0 twice
    assert _pairs([(0, 1.0), (1, 2.0)], [(0, 3.0), (2, 4.0)]) is None  # not the same repeats
