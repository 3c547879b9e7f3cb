"""Issue 21 ("Will it fit, and what should I change?"): each case answered by value. Every KV figure is worked
out here from the model's numbers (layers, KV heads, head_dim); the budget and the engine's own terms at startup
(its usable memory and overhead, checked against public startup logs in test_startup_logs.py) are read from the
plan, so that each verdict is checked as weights + KV + the engine's terms against its budget."""
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.kv.units import GIB
from tests.helpers import REPO, plan_lines

runner = CliRunner()
CATALOG = REPO / "bench" / "planner" / "catalog"
MIB = 2**20
H100 = 81559 * MIB
H200 = 143771 * MIB
L40S = 46068 * MIB
DEEPSEEK_V3_FP8 = 688_586_727_753  # deepseek-ai/DeepSeek-V3 model.safetensors.index.json total_size
LATENT = 61 * (512 + 64) * 2  # DeepSeek-V3's MLA latent, bf16, per token: 70,272 B
LLAMA70_TOKEN = 2 * 80 * 8 * 128 * 2  # 327,680 B per token, bf16
QWEN7_TOKEN = 2 * 28 * 4 * 128 * 2  # 57,344 B per token, bf16


def plan_json(*args) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def plan_text(*args) -> tuple[int, str]:
    result = runner.invoke(app, ["plan", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def lever_plan(args: tuple, lv: dict) -> dict:
    """The plan of a lever's deployment (its ``plan_args`` added to the asked one): its own budget and terms."""
    return plan_json(*args, *lv["plan_args"])


def lever(out: dict, change: str) -> dict:
    found = [lv for lv in out["levers"] if lv["change"] == change]
    assert found, [lv["change"] for lv in out["levers"]]
    return found[0]


# --- DeepSeek-V3 on 8 x H200 at 32K ---------------------------------------------------------------------

def test_deepseek_v3_on_eight_h200_at_32k():
    out = plan_json("deepseek-v3", "--engine", "vllm", "--gpu", "H200", "--tp", "8", "-n", "32768",
                    "--max-model-len", "32768", "--weights-bytes", str(DEEPSEEK_V3_FP8))
    per_request = 32768 * LATENT  # 2,048 whole blocks of 16: the latent, whole on every GPU
    null_block = 16 * LATENT
    overhead, usable = out["overhead_bytes"], out["usable_bytes"]
    need = DEEPSEEK_V3_FP8 / 8 + per_request + null_block + overhead
    v = out["verdict"]
    assert v["word"] == "FITS" and out["fits"] is True
    assert out["weights_bytes_per_gpu"] == DEEPSEEK_V3_FP8 / 8
    assert out["needed_bytes_per_gpu"] == pytest.approx(need)
    assert v["headroom_bytes"] == pytest.approx(usable - need)
    assert v["max_concurrency"] == math.floor((usable - DEEPSEEK_V3_FP8 / 8 - null_block - overhead) / per_request)
    assert v["max_concurrency"] >= 16
    assert v["longest_request"] == 32768 and "(the --max-model-len)" in v["line"]
    kv = next(row for row in out["ledger"] if row["term"] == "kv")
    assert kv["bytes"] == per_request + null_block
    assert "the MLA latent replicated on each of 8 GPUs" in kv["source"]
    pool = usable - DEEPSEEK_V3_FP8 / 8 - overhead
    assert v["line"].startswith(f"FITS: the KV held takes {(per_request + null_block) / GIB:.2f} GiB of the "
                                f"{pool / GIB:.2f} GiB KV pool per GPU, {(usable - need) / GIB:.2f} GiB left")


def test_deepseek_v3_weights_come_from_the_fp8_checkpoint():
    """Without --weights-bytes the catalog's DeepSeek-V3 is its FP8 checkpoint (kvbench.kv.weights):
    about 641.3 GiB, not 671 B parameters x 2 bytes; the plan is then the same as above."""
    out = plan_json("deepseek-v3", "--engine", "vllm", "--gpu", "H200", "--tp", "8", "-n", "32768",
                    "--max-model-len", "32768")
    assert out["weights_bytes"] == pytest.approx(DEEPSEEK_V3_FP8, rel=0.01)
    assert out["kv_dtype"] == "bf16"  # an FP8 checkpoint keeps 16-bit KV unless --kv-cache-dtype fp8
    given = plan_json("deepseek-v3", "--engine", "vllm", "--gpu", "H200", "--tp", "8", "-n", "32768",
                      "--max-model-len", "32768", "--weights-bytes", str(DEEPSEEK_V3_FP8))
    assert out["verdict"]["word"] == "FITS"
    assert abs(out["verdict"]["max_concurrency"] - given["verdict"]["max_concurrency"]) <= 1


def test_mla_with_tp_is_labelled_replicated_not_an_all_gpu_total():
    code, output = plan_text("deepseek-v3", "--engine", "vllm", "--gpu", "H200", "--tp", "8", "-n", "4096")
    assert code == 0
    assert "replicated on each of 8 GPUs" in output and "all GPUs" not in output
    out = plan_json("deepseek-v3", "--engine", "vllm", "--tp", "8", "-n", "4096")
    assert out["kv_bytes_per_gpu"] == 4096 * LATENT  # every rank holds the whole latent
    assert out["kv_scope"].startswith("the MLA latent replicated on each of 8 GPUs")
    # a GQA model's share of the heads is labelled as a share
    assert plan_json("llama-3.1-70b", "--engine", "vllm", "--tp", "8", "-n", "4096")["kv_scope"] == \
        "one GPU's share of the KV heads, of 8"


# --- dtypes as each engine resolves them -----------------------------------------------------------------

@pytest.mark.parametrize("engine, gpu, dtype, per_token", [
    ("vllm", "H100-80GB", "bf16", 2 * 42 * 8 * 256 * 2),  # --dtype auto serves the float32 config in bf16
    ("vllm", "V100-32GB", "fp32", 2 * 42 * 8 * 256 * 4),  # no bf16 before 8.0, and never fp16 for gemma2
    ("hf", "H100-80GB", "fp32", 2 * 42 * 8 * 256 * 4),  # transformers' dtype="auto" keeps the config's float32
    ("tgi", "H100-80GB", "bf16", 2 * 42 * 8 * 256 * 2),  # TGI's default_dtype for gemma2
    ("llamacpp", "H100-80GB", "f16", 2 * 42 * 8 * 256 * 2),  # --cache-type-k/-v f16
])
def test_gemma_2_9b_kv_dtype_is_each_engines_own(engine, gpu, dtype, per_token):
    out = plan_json("gemma-2-9b", "--engine", engine, "--gpu", gpu, "-n", "8192")
    assert out["kv_dtype"] == dtype and out["kv_bytes_per_token_formula"] == per_token


def test_gemma_2_9b_under_vllm_plans_bf16_kv_and_weights():
    vllm = plan_json("gemma-2-9b", "--engine", "vllm", "--gpu", "H100-80GB", "-n", "8192")
    hf = plan_json("gemma-2-9b", "--engine", "hf", "--gpu", "H100-80GB", "-n", "8192")
    assert vllm["kv_bytes_per_token_formula"] == 344_064  # not the float32 config's 688,128
    assert vllm["serving_dtype"] == "bf16" and hf["serving_dtype"] == "fp32"
    assert vllm["weights_bytes"] == hf["weights_bytes"] / 2  # the same parameters at 2 bytes, not 4
    assert "served in bf16" in vllm["weights_source"]


def test_a_16_bit_config_on_a_gpu_without_bf16_is_fp16_in_vllm():
    assert plan_json("llama-3.1-8b", "--engine", "vllm", "--gpu", "T4", "-n", "1000")["kv_dtype"] == "fp16"


def test_quantised_checkpoints_keep_16_bit_kv_unless_their_config_declares_fp8_kv(tmp_path):
    base = json.loads((CATALOG / "llama-3.1-8b.json").read_text())
    modelopt = {**base, "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                "kv_cache_quant_algo": "FP8"}}
    (tmp_path / "config.json").write_text(json.dumps(modelopt))
    assert plan_json(str(tmp_path), "--engine", "vllm", "-n", "1000")["kv_dtype"] == "fp8_e4m3"
    assert plan_json(str(tmp_path), "--engine", "tgi", "-n", "1000")["kv_dtype"] == "fp16"  # TGI reads compressed-tensors'
    ct = {**base, "quantization_config": {"quant_method": "compressed-tensors",
                                          "kv_cache_scheme": {"type": "float", "num_bits": 8}}}
    (tmp_path / "config.json").write_text(json.dumps(ct))
    assert plan_json(str(tmp_path), "--engine", "tgi", "-n", "1000")["kv_dtype"] == "fp8_e4m3fn"
    assert plan_json(str(tmp_path), "--engine", "vllm", "-n", "1000")["kv_dtype"] == "bf16"  # vLLM reads ModelOpt's only


# --- context as the deployment's: the limit and the typical request ----------------------------------------

QWEN25_7B_INSTRUCT = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                      "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                      "num_key_value_heads": 4, "max_position_embeddings": 32768, "max_window_layers": 28,
                      "sliding_window": 131072, "use_sliding_window": False, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-06, "vocab_size": 152064, "tie_word_embeddings": False,
                      "torch_dtype": "bfloat16"}  # Qwen/Qwen2.5-7B-Instruct's config.json (architecture fields)
YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}  # its model card's 128K setting


def qwen(tmp_path, rope: bool) -> str:
    folder = tmp_path / ("yarn" if rope else "plain")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN25_7B_INSTRUCT, **({"rope_scaling": YARN} if rope else {})}))
    return str(folder)


def test_the_128k_yarn_qwen_deployment_serves_four_typical_requests(tmp_path):
    model = qwen(tmp_path, rope=True)
    out = plan_json(model, "--engine", "vllm", "--gpu", "L40S", "--max-model-len", "131072", "-n", "10000",
                    "--batch", "4")
    assert out["max_context"] == 131072 and any("yarn factor 4" in n for n in out["notes"])
    # the pool holds one whole request at the limit (vLLM refuses to start otherwise), which is more than
    # 4 x 10,000 tokens, plus the null block
    kv = 131072 * QWEN7_TOKEN + 16 * QWEN7_TOKEN
    assert out["deployment_kv_bytes_per_gpu"] == kv
    assert out["needed_bytes_per_gpu"] == pytest.approx(out["weights_bytes"] + kv + out["overhead_bytes"])
    assert out["verdict"]["word"] == "FITS"
    # 4 requests all at the limit: 4 x 7 GiB of KV beside 14.2 GiB of weights is more than the L40S holds
    all_long = plan_json(model, "--engine", "vllm", "--gpu", "L40S", "-n", "131072", "--batch", "4")
    assert all_long["verdict"]["word"] == "DOES NOT FIT"
    assert all_long["needed_bytes_per_gpu"] == pytest.approx(all_long["weights_bytes"] + 4 * 131072 * QWEN7_TOKEN
                                                             + 16 * QWEN7_TOKEN + all_long["overhead_bytes"])
    assert out["needed_bytes_per_gpu"] < out["usable_bytes"] < all_long["needed_bytes_per_gpu"]


def test_without_rope_scaling_the_128k_limit_is_refused_or_labelled_as_past_the_model(tmp_path):
    model = qwen(tmp_path, rope=False)
    code, output = plan_text(model, "--engine", "vllm", "--gpu", "L40S", "--max-model-len", "131072", "-n", "10000")
    assert code == 2 and "exceeds the model's limit of 32,768" in output and len(output.strip().splitlines()) == 1
    code, output = plan_text(model, "--engine", "vllm", "--gpu", "L40S", "--max-model-len", "128K", "-n", "10k",
                             "--allow-long-context")
    verdict = plan_lines(output)["verdict"]
    assert code == 0 and verdict.startswith("FITS: ")
    assert "(the model's limit)" not in output
    assert verdict.endswith("131,072 tokens (the limit planned, past the model's 32,768)")
    # 4 at once: the longest request is what 4 of them fit, 116,096 tokens, below the limit
    out = plan_json(model, "--engine", "vllm", "--gpu", "L40S", "--max-model-len", "128K", "-n", "10k", "--batch", "4",
                    "--allow-long-context")
    room = out["usable_bytes"] - out["weights_bytes_per_gpu"] - out["overhead_bytes"] - 16 * QWEN7_TOKEN
    assert out["verdict"]["longest_request"] == math.floor(room / (4 * QWEN7_TOKEN) / 16) * 16
    assert 100_000 < out["verdict"]["longest_request"] < 131_072


def test_longest_request_is_labelled_the_models_limit_only_when_it_is():
    v = plan_json("llama-3.1-8b", "--engine", "vllm", "--gpu", "H100-80GB", "-n", "8192")["verdict"]
    assert v["longest_request"] == 131072 and v["line"].endswith("131,072 tokens (the model's limit)")


def test_llamacpp_allocates_every_slot_at_the_limit_where_vllm_holds_the_typical_batch():
    args = ("llama-3.1-8b", "-n", "1000", "--batch", "4", "--max-model-len", "8192")
    token = 2 * 32 * 8 * 128 * 2
    assert plan_json(*args, "--engine", "llamacpp")["deployment_kv_bytes_per_gpu"] == 4 * 8192 * token
    # vLLM: one request at the limit (512 blocks) outweighs 4 x 63 blocks; plus the null block
    assert plan_json(*args, "--engine", "vllm")["deployment_kv_bytes_per_gpu"] == 8192 * token + 16 * token
    # with 16 at once the typical batch is the larger: 16 x 1,008 tokens in whole blocks
    assert plan_json("llama-3.1-8b", "-n", "1000", "--batch", "16", "--max-model-len", "8192", "--engine",
                     "vllm")["deployment_kv_bytes_per_gpu"] == 16 * 1008 * token + 16 * token


# --- the verdict and the levers ---------------------------------------------------------------------------

def test_bf16_llama_70b_on_one_h100_says_the_weights_exceed_first_with_int4_and_tp2():
    args = ("llama-3.1-70b", "--engine", "vllm", "--gpu", "H100-80GB", "-n", "8192", "--max-model-len", "8192")
    out = plan_json(*args)
    w = out["weights_bytes"]
    assert w / GIB == pytest.approx(131.4, abs=0.05)  # 70.55 B parameters x 2 bytes
    v = out["verdict"]
    assert v["word"] == "DOES NOT FIT" and v["weights_exceed"] is True and v["max_concurrency"] == 0
    assert v["line"].startswith(f"DOES NOT FIT: the weights alone take {w / GIB:.2f} GiB per GPU, more than the "
                                f"{out['usable_bytes'] / GIB:.2f} GiB usable on H100-80GB")
    assert not [lv for lv in out["levers"] if lv["lever"] == "kv_dtype"]  # the KV is not what does not fit
    int4, tp2 = lever(out, "an int4 AWQ/GPTQ checkpoint"), lever(out, "--tensor-parallel-size 2")
    half_token = LLAMA70_TOKEN // 2  # each of 2 GPUs holds 4 of the 8 KV heads
    # (whether 2 x H100 hold it is the engine's terms' call: current vLLM takes its CUDA-graph estimate out too)
    at_tp2 = lever_plan(args, tp2)
    assert tp2["needed_bytes_per_gpu"] == pytest.approx(w / 2 + 8192 * half_token + 16 * half_token
                                                        + at_tp2["overhead_bytes"])
    assert tp2["headroom_bytes"] == pytest.approx(at_tp2["usable_bytes"] - tp2["needed_bytes_per_gpu"])
    assert int4["fits"] is True and int4["needed_bytes_per_gpu"] < 0.5 * w
    assert out["levers"].index(int4) < out["levers"].index(tp2)  # another checkpoint before a second GPU


def test_the_128k_4_bit_70b_fits_with_fp8_kv_and_the_lever_says_so():
    args = ("llama-3.1-70b", "--weights-dtype", "int4", "--engine", "vllm", "--gpu", "H100-80GB", "-n", "131072")
    out = plan_json(*args)
    w = out["weights_bytes"]
    bf16 = w + 131072 * LLAMA70_TOKEN + 16 * LLAMA70_TOKEN + out["overhead_bytes"]
    assert out["verdict"]["word"] == "DOES NOT FIT" and out["needed_bytes_per_gpu"] == pytest.approx(bf16)
    assert out["verdict"]["headroom_bytes"] == pytest.approx(out["usable_bytes"] - bf16)
    assert out["verdict"]["headroom_bytes"] < 0
    fp8 = out["levers"][0]
    assert fp8["change"] == "--kv-cache-dtype fp8" and fp8["fits"] is True
    fp8_need = w + (131072 + 16) * LLAMA70_TOKEN / 2  # 1 byte per element
    at_fp8 = lever_plan(args, fp8)
    assert fp8["needed_bytes_per_gpu"] == pytest.approx(fp8_need + at_fp8["overhead_bytes"])
    assert fp8["headroom_bytes"] == pytest.approx(at_fp8["usable_bytes"] - fp8_need - at_fp8["overhead_bytes"])
    assert fp8["max_concurrency"] == 1 and fp8["longest_request"] == 131072
    _, output = plan_text("llama-3.1-70b", "--weights-dtype", "int4", "--engine", "vllm", "--gpu", "H100-80GB",
                          "-n", "131072")
    assert f"  1. --kv-cache-dtype fp8: FITS: {fp8['headroom_bytes'] / GIB:.2f} GiB headroom" in output


def test_a_tp8_fit_by_value():
    out = plan_json("llama-3.1-70b", "--engine", "vllm", "--gpu", "H100-80GB", "--tp", "8", "-n", "32768",
                    "--batch", "16", "--max-model-len", "32768")
    w = out["weights_bytes"]
    token = 2 * 80 * 1 * 128 * 2  # one of the 8 KV heads per GPU
    overhead, usable = out["overhead_bytes"], out["usable_bytes"]
    need = w / 8 + 16 * 32768 * token + 16 * token + overhead
    assert out["verdict"]["word"] == "FITS" and out["needed_bytes_per_gpu"] == pytest.approx(need)
    assert out["verdict"]["headroom_bytes"] == pytest.approx(usable - need)
    assert out["max_batch"] == math.floor((usable - w / 8 - 16 * token - overhead) / (32768 * token))


def test_another_engines_window_cache_is_a_lever_for_a_sliding_window_model():
    """Gemma 3 27B keeps a 1,024-token window on 52 of its 62 layers: TGI stores every layer whole,
    llama.cpp's window cache does not."""
    out = plan_json("gemma-3-27b", "--engine", "tgi", "--gpu", "H100-80GB", "--tp", "2", "-n", "131072")
    llama = lever(out, "--engine llamacpp")
    assert "window cache" in llama["what"] and llama["fits"] is True
    assert llama["kv_bytes_per_gpu"] < 0.5 * out["deployment_kv_bytes_per_gpu"]
    assert llama["max_concurrency"] > out["max_batch"]


def test_levers_that_fit_come_first_and_each_is_planned():
    out = plan_json("llama-3.1-70b", "--weights-dtype", "int4", "--engine", "vllm", "--gpu", "H100-80GB",
                    "-n", "131072")
    fits = [lv["fits"] for lv in out["levers"]]
    assert fits == sorted(fits, reverse=True)
    for lv in out["levers"]:
        assert {"lever", "change", "what", "fits", "headroom_bytes", "max_concurrency", "longest_request"} <= lv.keys()


def test_the_json_carries_verdict_ledger_and_levers():
    out = plan_json("llama-3.1-8b", "--engine", "vllm", "--gpu", "L4", "-n", "8192", "--max-model-len", "8192")
    assert {"word", "fits", "line", "headroom_bytes", "headroom_pct", "max_concurrency", "longest_request",
            "verified", "unread_keys"} <= out["verdict"].keys()
    terms = [row["term"] for row in out["ledger"]]
    assert terms[:2] == ["weights", "kv"] and terms[-1] == "kept free" and "margin" not in terms
    assert all(isinstance(row["bytes"], (int, float)) and row["source"] for row in out["ledger"])
    assert sum(row["bytes"] for row in out["ledger"]) == pytest.approx(out["needed_bytes_per_gpu"]
                                                                       + out["kept_free_bytes"])
    assert out["levers"] and out["verified"] is True and out["unread_keys"] == []
