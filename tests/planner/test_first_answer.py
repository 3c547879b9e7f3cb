"""Issue 36 items 1 and 2: the question asked answered first (the KV of the asked batch x tokens, then what the
server's limit implies, each labelled, in text and --json), and levers that reach the target: combinations
of the engine's own levers where no single one fits; fewer requests or another engine never ranked as a fix."""
import json

from typer.testing import CliRunner

from kvbench.cli import app

from tests.helpers import plan_lines

GIB = 2**30
LLAMA_70B_TOKEN = 80 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16: 327,680 B


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
    assert text["limit"].split(" Fix: ")[1].startswith("--max-model-len 8192, the length asked (the longest it "
                                                        "would take: --max-model-len 102288")
    assert out["startup"]["fix"].startswith("--max-model-len 8192") and "102288" in out["startup"]["engine_fix"]
    # the limit lever is the length asked, not the largest limit that fits
    assert out["levers"][0]["change"] == "--max-model-len 8192"


def test_a_combination_of_the_engines_levers_where_no_single_one_fits():
    args = ("llama-3.1-8b", "-n", "128K", "--batch", "8", "--engine", "vllm", "--gpu", "A10G")
    out = json.loads(plan(*args, "--json"))
    singles = [lv for lv in out["levers"] if lv["lever"] != "combined"]
    assert singles and not any(lv["fits"] and lv["fix"] for lv in singles)
    best = out["levers"][0]
    assert best["lever"] == "combined" and best["fits"] and best["fix"]
    # planned as asked directly, the same deployment fits with the same headroom
    direct = json.loads(plan(*args, *best["change"].replace("--kv-cache-dtype", "--kv-dtype")
                             .replace("--tensor-parallel-size", "--tp").split(), "--json"))
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
