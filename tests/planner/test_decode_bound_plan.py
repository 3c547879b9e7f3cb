"""`kvbench plan --bandwidth RATE [--decode-efficiency F]`: the fastest ITL the planned batch allows, its bytes
per GPU (the weights once, every request's KV), and the ITL at an efficiency a run measured."""
import json

import pytest

from kvbench.planner.decode import decode_answer
from kvbench.planner.shared import PlanError
from tests.helpers import DATA, kvbench_here
from tests.planner.test_plan_options import planned, refused


def test_the_bound_is_the_gpus_weights_and_the_batchs_kv_over_the_bandwidth():
    r = planned("--engine", "vllm", "-n", "32768", "--batch", "8", "--bandwidth", "3.35TB/s",
                "--decode-efficiency", "0.5")
    d = r["decode_bound"]
    step = r["weights_bytes_per_gpu"] + r["kv_bytes_per_gpu"]
    assert d["step_bytes_per_gpu"] == pytest.approx(step) and d["bandwidth_bytes_per_s"] == 3.35e12
    assert d["itl_s_bound"] == pytest.approx(step / 3.35e12) and d["itl_s_expected"] == pytest.approx(2 * step / 3.35e12)
    assert d["kv_share"] == pytest.approx(r["kv_bytes_per_gpu"] / step)
    assert "no ITL is under" in d["line"] and "at 50% of it" in d["line"]


def test_tensor_parallel_splits_the_bytes_each_gpu_reads():
    one = planned("--engine", "vllm", "-n", "8192", "--bandwidth", "1TB/s")["decode_bound"]
    two = planned("--engine", "vllm", "-n", "8192", "--bandwidth", "1TB/s", "--tp", "2")["decode_bound"]
    assert two["step_bytes_per_gpu"] < 0.6 * one["step_bytes_per_gpu"]


def test_the_kv_share_grows_with_context():
    short = planned("-n", "1024", "--bandwidth", "1TB/s")["decode_bound"]["kv_share"]
    long = planned("-n", "131072", "--bandwidth", "1TB/s")["decode_bound"]["kv_share"]
    assert short < 0.1 < 0.5 < long


def test_units_of_a_rate_are_read():
    for text, value in (("900GB/s", 9e11), ("819GiB/s", 819 * 2**30), ("2e12", 2e12), ("1.5 TB", 1.5e12)):
        assert planned("--bandwidth", text)["decode_bound"]["bandwidth_bytes_per_s"] == pytest.approx(value)

    # spec: the --gpu card's specification (bench/planner/gpus.toml), in any case
    assert planned("--gpu", "H100-80GB", "--bandwidth", "Spec")["decode_bound"]["bandwidth_bytes_per_s"] == 3.35e12
    from kvbench.planner.decode import spec_bandwidth
    with pytest.raises(PlanError, match="needs --gpu"):
        spec_bandwidth(None)


@pytest.mark.parametrize("args, words", [
    (("--gpu", "48GiB", "--bandwidth", "spec"), "no bandwidth in the catalogue"),
    (("--bandwidth", "abc"), "is not a rate"), (("--bandwidth", "0"), "1MB/s to 1PB/s"),
    (("--bandwidth", "1e30"), "1MB/s to 1PB/s"), (("--bandwidth", "-5GB/s"), "is not a rate"),
    (("--decode-efficiency", "0.5"), "needs --bandwidth"),
    (("--bandwidth", "1TB/s", "--decode-efficiency", "1.5"), "above 0 and at most 1"),
    (("--bandwidth", "1TB/s", "--decode-efficiency", "nan"), "above 0 and at most 1"),
    (("--bandwidth", "1TB/s", "--decode-efficiency", "half"), "takes a number"),
    (("--bandwidth", "1TB/s", "--compare-engines"), "not --compare-engines"),
])
def test_hostile_rates_are_one_line_and_exit_2(args, words):
    assert words in refused(*args)


def test_unknown_weights_plan_no_bound():
    assert decode_answer({"weights_bytes_per_gpu": None}, 1e12, None) is None


def moe_plan(config: str, batch: int, *more) -> dict:
    r = kvbench_here("plan", str(DATA / "configs" / config), "--gpu", "H100-80GB", "--engine", "vllm", "-n", "4096",
                     "--batch", str(batch), "--bandwidth", "3.35TB/s", "--json", *more)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_moe_step_reads_the_experts_its_tokens_take():
    """Mixtral-8x7B's public config (2 of 8 experts a token): one token a step reads a quarter of the routed
    experts, the rest of the weights whole, which is its published 12.9 B active parameters at 2 bytes; 8
    tokens taking 2 each, drawn evenly, read 1 - (6/8)^8 of them; 64 read every one."""
    one, eight, many = (moe_plan("mixtral-8x7b-v0.1.json", b) for b in (1, 8, 64))
    share = one["moe"]["expert_share"]
    assert (one["moe"]["routed_experts"], one["moe"]["experts_per_token"]) == (8, 2) and 0.95 < share < 0.98
    w = one["weights_bytes_per_gpu"]
    assert one["decode_bound"]["experts_read_share"] == pytest.approx(0.25)
    assert one["decode_bound"]["weights_read_bytes_per_gpu"] == pytest.approx(w * (1 - share + share * 0.25))
    assert one["decode_bound"]["weights_read_bytes_per_gpu"] == pytest.approx(12.9e9 * 2, rel=0.02)
    assert eight["decode_bound"]["experts_read_share"] == pytest.approx(1 - 0.75 ** 8)
    assert many["decode_bound"]["weights_read_bytes_per_gpu"] == pytest.approx(w, rel=1e-3)
    assert "read at 25% for 1 token a step taking 2 of 8 each" in one["decode_bound"]["line"]


def test_a_dense_model_and_data_parallel_attention_read_every_weight():
    dense = planned("--engine", "vllm", "-n", "8192", "--bandwidth", "1TB/s")
    assert dense["moe"] is None and dense["decode_bound"]["experts_read_share"] is None
    assert dense["decode_bound"]["weights_read_bytes_per_gpu"] == dense["weights_bytes_per_gpu"]
    dp = moe_plan("deepseek-v2-lite.json", 8, "--dp", "2")  # data-parallel attention: MLA models only
    assert dp["decode_bound"]["experts_read_share"] is None and "every routed expert counted" in dp["decode_bound"]["line"]
