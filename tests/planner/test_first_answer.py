"""Issue 36 items 1 and 2: the question asked answered first (the KV of the asked batch x tokens, then what the
server's limit implies, each labelled, in text and --json), and levers that reach the target: combinations
of the engine's own levers where no single one fits; fewer requests or another engine never ranked as a fix."""
import json
import re

import pytest

from typer.testing import CliRunner

from kvbench.cli import app

from tests.helpers import plan_lines

GIB = 2**30
LLAMA_70B_TOKEN = 80 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16: 327,680 B
LATENT = 61 * (512 + 64) * 2  # DeepSeek-V3's MLA latent per token, bf16: 70,272 B


def plan(*args):
    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_the_asked_kv_comes_first_then_the_default_limit_then_the_asked_limit():
    args = ("llama-3.1-70b", "-n", "8192", "--engine", "vllm", "--gpu", "H100-80GB", "--weights-dtype", "int4")
    out = json.loads(plan(*args, "--json"))
    assert out["asked"]["kv_bytes"] == 8192 * LLAMA_70B_TOKEN  # 2.50 GiB, vLLM's blocks of 16 divide 8,192
    assert out["at_limit"]["default"] and out["at_limit"]["limit"] == 131_072
    assert out["at_limit"]["one_request_kv_bytes_per_gpu"] >= 131_072 * LLAMA_70B_TOKEN  # 40 GiB (+ a null block)
    assert out["at_limit"]["refused"] and out["at_limit"]["fits"] is False
    assert out["at_asked_limit"]["limit"] == 8192 and out["at_asked_limit"]["fits"] is True
    assert out["at_asked_limit"]["max_concurrency"] >= 1
    text = plan_lines(plan(*args))
    assert text["asked"].startswith("Asked: 1 x 8,192 tokens hold 2.50 GiB of KV per GPU")
    assert text["limit"].startswith("vLLM would refuse to start") and "131072" in text["limit"]
    assert text["at_asked"].startswith("With --max-model-len 8192 (the 8,192 tokens asked as the limit): FITS")
    # the refusal's fix agrees with the next line: the length asked, the engine's own proposal beside it
    longest = re.search(r"the estimated maximum model length is (\d+)", text["limit"])[1]
    assert text["limit"].split(" Fix: ")[1].startswith("--max-model-len 8192, the length asked (the longest it "
                                                        f"would take: --max-model-len {longest}")
    assert out["startup"]["fix"].startswith("--max-model-len 8192") and longest in out["startup"]["engine_fix"]
    # the limit lever is the length asked, not the largest limit that fits
    assert out["levers"][0]["change"] == "--max-model-len 8192"


def _planned_directly(args: tuple, lever: dict) -> dict:
    """The lever's deployment asked of kvbench plan directly (its plan_args), as a user would confirm it."""
    return json.loads(plan(*args, *lever["plan_args"], "--json"))


def test_combinations_are_searched_always_and_ranked_by_gpus_then_changes():
    """A bf16 70B at 8K on one H100: the top answer was --tensor-parallel-size 4, though an int4 checkpoint
    with the asked length as the limit fits on one GPU. Combinations are searched whether or not a single
    lever fits, ranked by GPUs, then the number of changes; each is what kvbench plan says when asked."""
    args = ("llama-3.1-70b", "-n", "8192", "--engine", "vllm", "--gpu", "H100-80GB")
    out = json.loads(plan(*args, "--json"))
    fixes = [lv for lv in out["levers"] if lv["fix"] and lv["fits"]]
    best = fixes[0]
    assert best["gpus"] == 1 and [c["kind"] for c in best["changes"]] == ["weights", "limit"]
    assert best["change"] == "an int4 AWQ/GPTQ checkpoint + --max-model-len 8192"
    assert best["plan_args"] == ["--weights-dtype", "int4", "--max-model-len", "8192"]
    assert [(lv["gpus"], len(lv["changes"])) for lv in fixes] == sorted((lv["gpus"], len(lv["changes"])) for lv in fixes)
    assert any(lv["change"] == "--tensor-parallel-size 4" for lv in fixes)  # one change, more GPUs: still shown
    for lv in fixes:
        direct = _planned_directly(args, lv)
        assert direct["fits"] and direct["gpus"] == lv["gpus"], lv["change"]
        assert abs(direct["headroom_bytes"] - lv["headroom_bytes"]) < 1e-6 * GIB, lv["change"]
    # a combination that holds a set of changes that fits already is left out
    flags = [frozenset(c["flag"] for c in lv["changes"]) for lv in fixes]
    assert not any(a < b for a in flags for b in flags)


def test_data_parallel_attention_and_a_pipeline_across_nodes_for_an_mla_model():
    """DeepSeek-V3 with 64 users at 32K on 8 x H200 got only "short by 32 GiB": tensor parallel replicates its
    latent on every GPU. Data-parallel attention over the 8 GPUs holds 8 requests' KV on each; a pipeline of
    two 8-GPU stages spans two nodes. Both fit, each planned as asked directly."""
    args = ("deepseek-v3", "-n", "32k", "--batch", "64", "--engine", "vllm", "--gpu", "H200", "--tp", "8")
    out = json.loads(plan(*args, "--json"))
    assert out["fits"] is False
    dp = next(lv for lv in out["levers"] if lv["lever"] == "dp")
    assert dp["fits"] and dp["fix"] and dp["gpus"] == 8
    assert dp["change"] == "--data-parallel-size 8 --enable-expert-parallel"
    pp = next(lv for lv in out["levers"] if lv["lever"] == "pp")
    assert pp["fits"] and pp["gpus"] == 16 and "2 nodes of 8" in pp["what"]
    assert out["levers"].index(dp) < out["levers"].index(pp)  # fewer GPUs first
    for lv in (dp, pp):
        direct = _planned_directly(args, lv)
        assert direct["fits"] and abs(direct["headroom_bytes"] - lv["headroom_bytes"]) < 1e-6 * GIB
    direct = _planned_directly(args, dp)
    assert direct["dp"] == 8 and direct["kv_bytes_per_gpu"] == 8 * 32000 * LATENT  # 8 of the 64, whole blocks
    # TP replicates the latent: every GPU holds all 64 requests' KV
    assert out["kv_bytes_per_gpu"] == 64 * 32000 * LATENT
    text = plan(*args)
    assert "--data-parallel-size 8 --enable-expert-parallel: FITS" in text


def test_where_nothing_fits_alone_a_combination_fits():
    args = ("llama-3.1-8b", "-n", "128K", "--batch", "16", "--engine", "vllm", "--gpu", "A10G", "--node-gpus", "4")
    out = json.loads(plan(*args, "--json"))
    fixes = [lv for lv in out["levers"] if lv["fix"]]
    assert not any(lv["fits"] for lv in fixes if len(lv["changes"]) == 1 and lv["gpus"] <= 4)
    best = fixes[0]
    assert best["lever"] == "combined" and best["fits"] and len(best["changes"]) >= 2
    direct = _planned_directly(args, best)
    assert direct["fits"] and abs(direct["headroom_bytes"] - best["headroom_bytes"]) < 1e-6 * GIB


def test_fewer_requests_and_another_engine_are_never_ranked_as_a_fix():
    args = ("llama-3.1-8b", "-n", "8K", "--batch", "64", "--engine", "vllm", "--gpu", "A10G", "--max-model-len", "8K")
    out = json.loads(plan(*args, "--json"))
    fewer = next(lv for lv in out["levers"] if lv["lever"] == "concurrency")
    assert fewer["fits"] and not fewer["fix"]  # it fits, by serving 3 of the 64 asked: not a fix
    fixes = [lv["fix"] for lv in out["levers"]]
    assert fixes == sorted(fixes, reverse=True)  # every fix before every other answer
    for lv in out["levers"]:
        assert lv["fix"] == (lv["lever"] not in ("concurrency", "engine"))
    text = plan(*args)
    fix_part, other_part = text.split("Not a fix (another question answered):")
    assert "--max-num-seqs" not in fix_part and "--max-num-seqs" in other_part


def test_a_layout_the_engine_or_the_model_lacks_is_one_line_and_exit_2():
    for args, words in [(("llama-3.1-8b", "--engine", "tgi", "--pp", "2"), "--pp: tgi has no pipeline parallel"),
                        (("llama-3.1-8b", "--engine", "vllm", "--dp", "2"), "--dp: data-parallel attention is planned "
                                                                             "for MLA models"),
                        (("deepseek-v3", "--engine", "llamacpp", "--dp", "2"), "--dp: llamacpp has no data-parallel"),
                        (("llama-3.1-8b", "--pp", "64"), "--pp: 32 layers cannot be split")]:
        result = CliRunner().invoke(app, ["plan", *args, "-n", "4096"], env={"COLUMNS": "200"})
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert words in result.output, result.output


@pytest.mark.parametrize("args", [
    ("llama-3.1-8b", "-n", "32k", "--batch", "16", "--engine", "tgi", "--gpu", "L4"),
    ("llama-3.1-8b", "-n", "32k", "--batch", "16", "--engine", "llamacpp", "--gpu", "L4"),
    ("deepseek-v3", "-n", "32k", "--batch", "64", "--engine", "sglang", "--gpu", "H200", "--tp", "8"),
    ("gpt-oss-120b", "-n", "128K", "--batch", "64", "--engine", "vllm", "--gpu", "A100-80GB")],
    ids=["tgi", "llamacpp", "sglang-mla", "vllm-sliding"])
def test_every_fitting_lever_is_what_plan_says_when_asked_directly(args):
    """Each engine's fixes, alone and combined (its KV dtypes, weight formats (a Q4_0 GGUF's bytes for
    llama.cpp), the limit, tensor parallel, a pipeline, data-parallel attention): planned again from the
    lever's plan_args, kvbench plan gives the same GPUs and headroom."""
    out = json.loads(plan(*args, "--json"))
    fixes = [lv for lv in out["levers"] if lv["fits"] and lv["fix"]]
    assert fixes
    for lv in fixes:
        direct = _planned_directly(args, lv)
        assert direct["fits"] and direct["gpus"] == lv["gpus"], lv["change"]
        assert abs(direct["headroom_bytes"] - lv["headroom_bytes"]) < 1e-3 * GIB, lv["change"]
