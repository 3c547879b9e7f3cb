"""Issue 21, items 4 and 6: `kvbench plan --memory SIZE` predicts against a CPU memory wall (the one
`kvbench run --memory-limit SIZE` starts each engine's process tree in) with each engine's overhead as a
published run measured it, the rule of thumb beside it; the shipped overhead table is what that run's
trials give; the published wall table's plan answers are within one rung of where the engines were killed."""
import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.kv.units import GIB
from kvbench.planner import PlanInput, default_overhead, engine_rules, plan, resolve_model
from kvbench.planner.overhead import OVERHEADS_FILE, fit, overheads_from_trials, rule_of_thumb, shipped_overheads
from tests.helpers import REPO

runner = CliRunner()
ROOT = REPO  # the repository
WALL_RUN = ROOT / "results" / "published" / "20261201-memory-wall-cpu"
MIB = 2**20


def plan_json(*args) -> tuple[int, dict | str]:
    result = runner.invoke(app, ["plan", *args, "--json"], env={"COLUMNS": "200"})
    if result.exit_code:
        return result.exit_code, result.output
    return 0, json.loads(result.stdout)


def trials() -> list[dict]:
    return [json.loads(line) for line in (WALL_RUN / "trials.jsonl").read_text().splitlines()]


# --- the shipped overhead table is what the published run measured ---------------------------------------

def test_the_shipped_cpu_overheads_are_the_published_ladders():
    records = trials()
    engines = sorted({t["engine"] for t in records})
    pool_at_start = {e: engine_rules(e).pool_at_start for e in engines}
    computed = overheads_from_trials(records, pool_at_start, "results/published/20261201-memory-wall-cpu", "smollm2")
    shipped = shipped_overheads()
    assert set(computed) == set(engines) == {e for d, e in shipped if d == "cpu"}
    for engine, o in computed.items():
        s = shipped[("cpu", engine)]
        assert s.fixed_bytes == pytest.approx(o.fixed_bytes, abs=1)
        assert s.per_token_bytes == pytest.approx(o.per_token_bytes, abs=0.1)
        assert s.source == f"measured: {o.source}" and s.model == o.model == "smollm2"
    # only transformers (static batching) has activations that grow with the batch
    assert shipped[("cpu", "hf")].per_token_bytes > 0
    assert shipped[("cpu", "llamacpp")].per_token_bytes == 0 == shipped[("cpu", "vllm")].per_token_bytes
    # the published folder carries the same table the ladder wrote
    assert tomllib.loads((WALL_RUN / "overheads.toml").read_text()) == {
        k: v for k, v in tomllib.loads(OVERHEADS_FILE.read_text()).items() if k == "cpu"}


def test_the_fit_covers_every_point_and_a_pool_at_start_has_no_slope():
    points = [(2050.0, 400 * MIB), (4100.0, 470 * MIB), (8200.0, 640 * MIB)]
    fixed, slope = fit(points, per_token=True)
    assert slope > 0 and all(fixed + slope * t >= o - 1 for t, o in points)
    assert fit(points, per_token=False) == (640 * MIB, 0.0)
    assert fit([(100.0, 5.0)], per_token=True) == (5.0, 0.0)  # one token count: no slope to fit


def test_an_engine_not_measured_on_a_device_says_which_run_would_measure_it():
    o = default_overhead("vllm", "gpu")
    assert not o.measured and o.fixed_bytes == 1.5 * GIB
    assert "no published run measured vllm on a GPU" in o.source and "kvbench run -b vllm" in o.source
    assert default_overhead("llamacpp", "cpu").measured


# --- kvbench plan --memory --------------------------------------------------------------------------------

def test_llamacpp_at_a_wall_counts_its_prompt_cache_and_says_how_to_bound_it():
    code, r = plan_json("smollm2", "--engine", "llamacpp", "--memory", "1G", "--batch", "8", "--max-model-len", "4096")
    assert code == 0, r
    assert r["memory_wall"] and r["margin"] == 0 and r["gpu_memory_bytes"] == GIB
    terms = {row["term"]: row for row in r["ledger"]}
    slots = 8 * 49_152 * 16  # SmolLM2's vocabulary: a row of logits and a sampler's candidates a slot
    assert terms["prompt cache"]["bytes"] == 8192 * MIB
    assert "--cache-ram 8192 MiB (its default)" in terms["prompt cache"]["source"]
    assert terms["output buffer"]["bytes"] == 8 * 49_152 * 4 and terms["sampler candidates"]["bytes"] == 8 * 49_152 * 12
    assert r["verdict"]["word"] == "DOES NOT FIT" and "8.01 GiB host memory" in r["verdict"]["line"]
    assert "in the wall" in r["verdict"]["line"]
    assert terms["overhead"]["source"].startswith("measured: results/published/20261201-memory-wall-cpu")
    assert "rule of thumb 2 GB + 5 %" in terms["overhead"]["source"]
    best = r["levers"][0]
    assert best["change"] == "--cache-ram 0" and best["fits"]
    assert not any(lv["lever"] == "tp" for lv in r["levers"])  # a wall has no GPUs to split over
    code, off = plan_json("smollm2", "--engine", "llamacpp", "--memory", "1G", "--batch", "8", "--max-model-len",
                          "4096", "--engine-option", "cache_ram_mib=0")
    left = {row["term"]: row["bytes"] for row in off["ledger"]}
    assert off["fits"] and "prompt cache" not in left and left["output buffer"] + left["sampler candidates"] == slots
    assert off["max_context_at_batch"] == best["longest_request"]


def test_the_engines_serving_hf_folders_plan_the_embedded_models_bf16_copy():
    m = resolve_model("smollm2")
    gguf = plan(PlanInput(m, engine="llamacpp", memory=GIB, device="cpu", margin=0))
    hf = plan(PlanInput(m, engine="hf", context=2050, memory=GIB, device="cpu", margin=0))
    assert gguf["weights_source"] == "GGUF tensor bytes"
    # the bf16 copy: 134.5 M parameters x 2 bytes, whether read from the copy or estimated from the GGUF
    assert hf["weights_bytes"] == pytest.approx(269.03e6, rel=0.001)
    assert "HF-format copy" in hf["weights_source"]
    # transformers' activations grow with the batch: the overhead at 4 x 2050 exceeds the one at 1
    four = plan(PlanInput(m, engine="hf", context=2050, batch=4, memory=GIB, device="cpu", margin=0))
    assert four["overhead_bytes"] > hf["overhead_bytes"] == pytest.approx(
        hf["overhead_fixed_bytes"] + 2050 * hf["overhead_per_token_bytes"])


def test_an_overhead_measured_on_another_model_says_so():
    code, r = plan_json("qwen2.5-7b", "--engine", "hf", "--memory", "24G", "-n", "4096")
    assert code == 0, r
    assert r["overhead_source"].startswith("measured: results/published/20261201-memory-wall-cpu")
    assert "measured on smollm2, not qwen2.5-7b" in r["overhead_source"]
    code, own = plan_json("smollm2", "--engine", "hf", "--memory", "1G", "-n", "2050")
    assert "measured on" not in own["overhead_source"]


def test_the_rule_of_thumb_is_beside_the_overhead_on_a_gpu_too():
    code, r = plan_json("llama-3.1-8b", "--gpu", "H100-80GB", "-n", "8192")  # the plain formula: the margin model
    assert code == 0
    assert r["overhead_rule_of_thumb_bytes"] == rule_of_thumb(r["gpu_memory_bytes"])
    assert not r["memory_wall"] and r["overhead_source"].startswith("assumed: 1.5 GiB")
    # an engine with a startup rule is planned by its own terms only: no margin-model figure beside them
    code, r = plan_json("llama-3.1-8b", "--engine", "vllm", "--gpu", "H100-80GB", "-n", "8192")
    assert r["overhead_rule_of_thumb_bytes"] is None and r["margin"] is None and r["startup"]["terms"]


@pytest.mark.parametrize("args, message", [
    (["--memory", "1G", "--gpu", "H100-80GB"], "--gpu and --memory: give one"),
    (["--memory", "1G", "--device", "gpu"], "--memory is a CPU memory wall"),
    (["--memory", "1G", "--tp", "2"], "--tp, --pp and --dp split a model over GPUs: a CPU memory wall has none"),
    (["--memory", "1G", "--pp", "2"], "--tp, --pp and --dp split a model over GPUs: a CPU memory wall has none"),
    (["--memory", "lots"], "--memory takes a size such as"),
    (["--memory", "0"], "--memory must be positive"),
    (["--memory", "1G", "--engine", "llamacpp", "--engine-option", "cache_ram_mib=many"], "cache_ram_mib takes a whole"),
])
def test_bad_memory_input_is_one_line_and_exit_2(args, message):
    result = runner.invoke(app, ["plan", "smollm2", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


# --- the published wall table: the plan against where the engines were killed ----------------------------

def test_the_plan_is_within_one_rung_of_every_published_wall():
    from kvbench.selfcheck.memory_wall_ladder import HF_OUTPUT_TOKENS, predictions

    records = trials()
    readme = (WALL_RUN / "README.md").read_text()
    rungs = {e: sorted({t["rung"] for t in records if t["engine"] == e}) for e in {t["engine"] for t in records}}
    overheads = {e: o for (d, e), o in shipped_overheads().items() if d == "cpu"}
    contexts = {"hf": 2048 + HF_OUTPUT_TOKENS, "vllm": 2048}
    found = predictions(records, rungs, 8, contexts, overheads)
    assert {f.engine for f in found} == {"llamacpp", "hf", "vllm"}
    assert all(len([f for f in found if f.engine == e]) >= 2 for e in ("llamacpp", "hf", "vllm"))
    for f in found:
        assert f.right, f
        # the published table shows the same answer
        assert f"| {f.question}: {f.answer:,} |" in readme, f
    # each engine's larger walls were not fitted on
    assert any(not f.calibration for f in found)


def test_the_readmes_wall_example_is_what_kvbench_prints():
    readme = (ROOT / "README.md").read_text()
    command = "kvbench plan smollm2 --engine llamacpp --memory 1G --batch 8 --max-model-len 4096"
    assert f"$ .venv/bin/{command}" in readme
    result = runner.invoke(app, command.split()[1:], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] in readme and lines[1] in readme  # the KV asked, then the verdict at the limit
    assert next(line for line in lines if line.startswith("  1. ")) in readme


def test_a_slots_logits_and_sampler_scale_with_the_slots_and_an_unknown_vocabulary_is_said():
    """llama-server's buffers a slot (a row of logits, a request's sampler candidates: vocab x 16 bytes), and a
    geometry without a vocabulary (a GGUF without <arch>.vocab_size) says they are not counted."""
    from dataclasses import replace as with_

    from kvbench.kv.rules import KVQuestion

    rules = engine_rules("llamacpp")
    g = resolve_model("llama-3.1-8b").geometry
    assert g.vocab_size == 128_256 and with_(g, vocab_size=None) == g  # not part of the layout
    off = {"cache_ram_mib": 0}
    one, four = (rules.host_memory(KVQuestion(g, "f16", 1024, b, options=off)) for b in (1, 4))
    assert [(t, b) for t, b, _ in one] == [("output buffer", 128_256 * 4), ("sampler candidates", 128_256 * 12)]
    assert sum(b for _, b, _ in four) == 4 * 128_256 * 16
    (unknown,) = rules.host_memory(KVQuestion(with_(g, vocab_size=None), "f16", 1024, 4, options=off))
    assert unknown[1] == 0 and unknown[2].startswith("not counted: a slot's row of logits")
