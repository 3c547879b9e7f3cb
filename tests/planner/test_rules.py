"""Each engine's KV rules and the planner, against values computed by hand, and the plan's refusals."""
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.backends import REGISTRY
from kvbench.cli import app
from kvbench.kv.geometry import kv_bytes_per_token
from kvbench.kv.model_config import geometry_from_hf_dict
from kvbench.kv.rules import KVQuestion, KVRuleError
from kvbench.kv.units import GIB
from kvbench.planner import PlanError, PlanInput, engine_rules, engines, gpu_memory, plan, resolve_model
from tests.helpers import DATA, plan_lines

runner = CliRunner()
CORPUS = DATA / "configs"


def geom(name):
    return resolve_model(name).geometry


def answer(engine, g, context, batch=1, dtype="bf16", **kw):
    return REGISTRY[engine].kv_rules.answer(KVQuestion(g, dtype, context, batch, **kw))


# --- bytes per token by attention kind (the plain formula, bf16) ------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("llama-2-7b", 2 * 32 * 32 * 128 * 2),      # MHA: 524,288
    ("llama-3-8b", 2 * 32 * 8 * 128 * 2),       # GQA: 131,072
    ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),    # 327,680
    ("qwen2.5-0.5b", 2 * 24 * 2 * 64 * 2),      # 12,288
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),       # 57,344
    ("mistral-7b-v0.1", 131_072),
    ("gemma-2-9b", 2 * 42 * 8 * 256 * 2),       # head_dim 256 from the config, not 3584 / 16 = 224
    ("gemma-3-1b", 2 * 26 * 1 * 256 * 2),       # MQA
    ("gemma-3-27b", 2 * 62 * 16 * 128 * 2),     # from text_config of a multimodal wrapper
    ("deepseek-v2", 60 * (512 + 64) * 2),       # MLA latent: 69,120
    ("deepseek-v3", 61 * (512 + 64) * 2),       # 70,272
])
def test_catalog_bytes_per_token(name, expected):
    assert kv_bytes_per_token(geom(name), "bf16") == expected


def test_attention_kinds_and_the_mla_ratio():
    assert [geom(n).attention for n in ("llama-2-7b", "llama-3-8b", "gemma-3-1b", "deepseek-v3")] == \
        ["MHA", "GQA", "MQA", "MLA"]
    naive = 2 * 61 * 128 * 128 * 2  # num_key_value_heads 128 x head_dim 128 taken at face value
    assert naive / kv_bytes_per_token(geom("deepseek-v3"), "bf16") == pytest.approx(56.9, abs=0.05)


# --- vLLM ------------------------------------------------------------------------------------------

def test_vllm_block_rounding_and_null_block():
    g = geom("llama-3.1-8b")
    a = answer("vllm", g, 1000, 4)
    assert a.tokens_full == 4 * 1008 and a.bytes_per_gpu == 4 * 1008 * 131_072
    assert a.pool_extra_bytes == 16 * 131_072  # one null block of 16 tokens
    assert answer("vllm", g, 1000, 4, block_size=128).tokens_full == 4 * 1024
    assert answer("vllm", g, 1000, 4, device="cpu").tokens_full == 4 * 1024  # 128 on a CPU


def test_vllm_mla_latent_for_its_mla_model_types_only():
    assert answer("vllm", geom("deepseek-v3"), 100).bytes_per_gpu == 112 * 70_272
    # MiniCPM3 has kv_lora_rank, but vLLM runs it as plain attention: 40 heads decompressed, K of nope + rope
    # and V zero-padded to K's size (96 each)
    minicpm3 = geometry_from_hf_dict({"model_type": "minicpm3", "num_hidden_layers": 62, "num_attention_heads": 40,
                                      "hidden_size": 2560, "kv_lora_rank": 256, "q_lora_rank": 768,
                                      "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64})
    assert kv_bytes_per_token(minicpm3, "bf16") == 62 * 288 * 2  # the latent, as the plain formula counts
    assert answer("vllm", minicpm3, 16).bytes_per_gpu == 16 * 62 * 40 * (96 + 96) * 2
    assert answer("hf", minicpm3, 16).bytes_per_gpu == 16 * 62 * 288 * 2  # transformers keeps the latent
    # llama.cpp decompresses too, V of hidden / heads = 64
    assert answer("llamacpp", minicpm3, 256, dtype="f16").bytes_per_gpu == 256 * 62 * 40 * (96 + 64) * 2


def test_vllm_hybrid_manager_groups_and_frees_window_blocks():
    g = geom("gemma-3-1b")  # 26 layers: 22 windowed (512) + 4 full, 1 KV head of 256
    # groups of G = 4 layers (the smaller kind): 6 window groups (the last ones padded) + 1 full group;
    # a block spans a group: 4 pages of 16 x 1 x (256 + 256) x 2 bytes
    page = 16 * 1 * 512 * 2
    full = math.ceil(4000 / 16)  # 250 blocks
    window = full - (4000 - 512 + 1) // 16  # blocks wholly before the window are freed: 32 left
    a = answer("vllm", g, 4000)
    assert a.bytes_per_gpu == (full + 6 * window) * 4 * page and a.pool_extra_bytes == 4 * page
    off = answer("vllm", g, 4000, options={"hybrid_kv_cache": "off"})
    assert off.bytes_per_gpu == 26 * 4000 * 1024  # every layer keeps every token
    assert answer("vllm", g, 4000, version="0.9.2").bytes_per_gpu == off.bytes_per_gpu  # no hybrid manager yet


def test_vllm_chunked_layers_free_what_is_before_the_chunk():
    g = geometry_from_hf_dict(json.loads((CORPUS / "llama-4-scout-17b-16e-instruct-aic-trimmed.json").read_text()))
    assert (g.count("chunked"), g.count("full"), g.chunk_size) == (36, 12, 8192)
    page = 16 * 8 * 256 * 2  # 8 KV heads of 128 for K and V
    n = 20000
    full = math.ceil(n / 16)
    chunked = full - (n // 8192) * 8192 // 16  # 1250 - 1024 = 226 blocks
    # G = 12 (the full layers): 3 chunked groups + 1 full group, a block spans 12 layers
    assert answer("vllm", g, n).bytes_per_gpu == (full + 3 * chunked) * 12 * page


def test_vllm_refuses_what_vllm_refuses():
    g = geom("llama-3.1-8b")
    with pytest.raises(KVRuleError, match=r"Total number of attention heads \(32\) must be divisible by tensor "
                                          r"parallel size \(3\)"):
        answer("vllm", g, 100, tp=3)
    with pytest.raises(KVRuleError, match="vllm has no KV dtype 'q4_0'; it takes: auto, bf16"):
        answer("vllm", g, 100, dtype="q4_0")
    with pytest.raises(KVRuleError, match="block size must be >= 1"):
        answer("vllm", g, 100, block_size=0)


# --- TGI -------------------------------------------------------------------------------------------

def test_tgi_reservation_blocks_and_decompressed_deepseek():
    g = geom("llama-3.1-8b")
    assert answer("tgi", g, 1000, 2).bytes_per_gpu == 2 * 1000 * 131_072  # block 1
    assert answer("tgi", g, 1000, 2, block_size=256).tokens_full == 2 * 1024
    # DeepSeek-V3 decompressed: 128 heads x (K 128 + 64, V 128) per layer
    assert answer("tgi", geom("deepseek-v3"), 10).bytes_per_gpu == 10 * 61 * 128 * (192 + 128) * 2
    # and no sliding-window saving
    assert answer("tgi", geom("mistral-7b-v0.1"), 8000).bytes_per_gpu == 8000 * 131_072
    with pytest.raises(KVRuleError, match="tgi has no KV dtype 'q8_0'"):
        answer("tgi", g, 10, dtype="q8_0")


# --- llama.cpp and Ollama ----------------------------------------------------------------------------

def test_llamacpp_padding_streams_and_swa_cache():
    g = geom("llama-3.1-8b")
    a = answer("llamacpp", g, 1000, 4, dtype="f16")  # n_ctx 4000 -> 4096, 4 streams of 1024 cells
    assert a.tokens_full == 4 * 1024 and a.bytes_per_gpu == 4 * 1024 * 131_072
    assert answer("llamacpp", g, 1000, 4, dtype="f16", options={"unified": True}).tokens_full == 4096
    assert answer("ollama", g, 4096, dtype="q8_0").bytes_per_gpu == 4096 * 2 * 32 * 8 * 128 * 34 / 32
    g3 = geom("gemma-3-1b")  # window 512: SWA cache min(8192, 512 + 512) = 1024 cells
    a = answer("llamacpp", g3, 8192, dtype="f16")
    assert (a.tokens_full, a.tokens_windowed) == (8192, 1024)
    assert a.bytes_per_gpu == 2 * 256 * 2 * (4 * 8192 + 22 * 1024)
    # Mistral's window is not llama.cpp's: its converter writes none, so every layer holds the whole slot
    assert answer("llamacpp", geom("mistral-7b-v0.1"), 8192, dtype="f16").bytes_per_gpu == 8192 * 131_072


def test_llamacpp_splits_layers_not_heads_and_has_no_block_size():
    g = geom("llama-3.1-8b")
    assert answer("llamacpp", g, 4096, dtype="f16", tp=3).bytes_per_gpu == 4096 * 11 * 2 * 8 * 128 * 2  # 11+10+11 layers
    with pytest.raises(KVRuleError, match="llamacpp has no KV block size"):
        answer("llamacpp", g, 4096, dtype="f16", block_size=16)
    with pytest.raises(KVRuleError, match="ollama has no KV dtype 'q5_0'"):
        answer("ollama", g, 10, dtype="q5_0")
    assert answer("llamacpp", g, 10, dtype="auto").dtype == "f16"
    # each GPU holds all 8 KV heads of its layers under llama.cpp, a quarter of every layer's under vLLM
    per_gpu = {e: plan(PlanInput(model=resolve_model("llama-3.1-70b"), context=8192, tp=4, engine=e))["kv_heads_per_gpu"]
               for e in ("llamacpp", "vllm")}
    assert per_gpu == {"llamacpp": 8, "vllm": 2}
    assert plan(PlanInput(model=resolve_model("deepseek-v2"), context=8192, tp=8, engine="vllm"))["kv_heads_per_gpu"] == 1


# --- transformers ------------------------------------------------------------------------------------

def test_hf_window_minus_one_mla_by_version_and_falcon_broadcast():
    g3 = geom("gemma-3-1b")
    assert answer("hf", g3, 2000).bytes_per_gpu == 2 * 256 * 2 * (4 * 2000 + 22 * 511)
    d = geom("deepseek-v3")
    assert answer("hf", d, 10).bytes_per_gpu == 10 * 70_272
    assert answer("hf", d, 10, version="5.0.0").bytes_per_gpu == 10 * 61 * 128 * 320 * 2
    falcon40 = geometry_from_hf_dict(json.loads((CORPUS / "falcon-40b.json").read_text()))
    assert kv_bytes_per_token(falcon40, "bf16") == 2 * 60 * 8 * 64 * 2
    # transformers broadcasts the 8 KV heads to all 128 query heads before caching
    assert answer("hf", falcon40, 1).bytes_per_gpu == 2 * 60 * 128 * 64 * 2
    assert answer("vllm", falcon40, 16).bytes_per_gpu == 16 * 2 * 60 * 8 * 64 * 2


# --- the plan ----------------------------------------------------------------------------------------

def test_plan_fits_and_limits_are_consistent():
    m = resolve_model("llama-3.1-8b")
    assert m.weights_bytes == pytest.approx(8.03e9 * 2, rel=0.001)
    p = PlanInput(model=m, context=32768, batch=8, engine="vllm", gpu="H100-80GB")
    out = plan(p)
    assert out["kv_bytes"] == 8 * 32768 * 131_072 and out["kv_bytes_per_token"] == 131_072
    assert out["fits"] is True
    # max_batch fits and max_batch + 1 does not
    assert plan(PlanInput(model=m, context=32768, batch=out["max_batch"], engine="vllm", gpu="H100-80GB"))["fits"]
    assert not plan(PlanInput(model=m, context=32768, batch=out["max_batch"] + 1, engine="vllm", gpu="H100-80GB"))["fits"]
    usable = 81559 * 2**20 * 0.9 - 1.5 * GIB - m.weights_bytes
    assert out["max_batch"] == math.floor((usable - 16 * 131_072) / (32768 * 131_072))
    longest = out["max_context_at_batch"]
    assert plan(PlanInput(model=m, context=longest, batch=8, engine="vllm", gpu="H100-80GB"))["fits"]
    assert not plan(PlanInput(model=m, context=longest + 16, batch=8, engine="vllm", gpu="H100-80GB"))["fits"]


def test_gpu_by_size_and_unknown_gpu():
    assert gpu_memory("48GiB")[1] == 48 * GIB
    assert gpu_memory("h200")[0] == "H200"
    with pytest.raises(PlanError, match="A100-80GB"):
        gpu_memory("X100")


def test_engines_are_the_adapters_with_kv_rules():
    assert engines() == ["hf", "vllm", "llamacpp", "tgi", "ollama", "sglang"]
    with pytest.raises(PlanError, match="no KV rules for engine 'openai'"):
        plan(PlanInput(model=resolve_model("llama-3-8b"), context=10, engine="openai"))


def test_each_engine_says_how_it_splits_over_more_gpus():
    """The engines' own flags for a pipeline and data-parallel attention (vLLM's and SGLang's server
    arguments); the others have none, and the plan offers none for them."""
    flags = {e: (engine_rules(e).pp_flag(2), engine_rules(e).dp_attention_flag(8)) for e in engines()}
    assert flags["vllm"] == ("--pipeline-parallel-size 2", "--data-parallel-size 8 --enable-expert-parallel")
    assert flags["sglang"] == ("--pp-size 2", "--tp-size 8 --dp-size 8 --enable-dp-attention")
    assert all(flags[e] == (None, None) for e in ("hf", "llamacpp", "tgi", "ollama"))
    assert (engine_rules(None).pp_flag(2), engine_rules(None).dp_attention_flag(8)) == ("--pp 2", "--dp 8")


def plan_cli(*args):
    result = runner.invoke(app, ["plan", *args])
    return result.exit_code, result.output


def test_plan_cli_json_and_errors():
    code, output = plan_cli("deepseek-v3", "--context", "4096", "--batch", "2", "--gpu", "H200", "--tp", "8",
                            "--engine", "vllm", "--json")
    assert code == 0, output
    out = json.loads(output)
    assert {"kv_bytes", "kv_bytes_per_token", "weights_bytes", "fits", "max_batch"} <= out.keys()
    assert out["kv_bytes_per_gpu"] == 2 * 4096 * 70_272  # latent replicated on each of the 8 GPUs
    code, output = plan_cli("no-such-model", "--context", "10")
    assert code == 2 and "llama-3.1-8b" in output and "hub id" in output
    # the model's 131,072-token limit is what the server accepts unless told: one such request does not fit an
    # L4 beside the weights; with the limit at 8,192 the four requests do
    code, output = plan_cli("qwen2.5-7b", "--context", "8192", "--batch", "4", "--gpu", "L4")
    assert code == 0 and plan_lines(output)["verdict"].startswith("DOES NOT FIT: short by")
    code, output = plan_cli("qwen2.5-7b", "--context", "8192", "--batch", "4", "--gpu", "L4", "--max-model-len", "8192")
    assert code == 0 and plan_lines(output)["verdict"].startswith("FITS: ")


@pytest.mark.parametrize("args, message", [
    (["llama-3.1-8b", "--context", "1000", "--tp", "3", "--engine", "vllm"], "must be divisible by tensor parallel"),
    (["llama-3.1-8b", "--context", "1000", "--tp", "3"], "cannot be split evenly over 3 GPUs"),
    (["llama-3.1-8b", "--context", "1000", "--engine", "vllm", "--kv-dtype", "q4_0"], "vllm has no KV dtype 'q4_0'"),
    (["llama-3.1-8b", "--context", "200000"], "exceeds the model's limit of 131,072"),
    (["llama-3.1-8b", "--context", "1000", "--engine", "vllm", "--block-size", "0"], "block size must be >= 1"),
    (["llama-3.1-8b", "--context", "1000", "--gpu", "L4", "--margin", "1.5"], "--margin is the fraction"),
    (["llama-3.1-8b", "--context", "1000", "--engine", "llamacpp", "--block-size", "16"], "has no KV block size"),
    (["llama-3.1-8b", "--context", "1000", "--engine-option", "oops"], "must be KEY=VALUE"),
])
def test_refusals_are_one_line(args, message):
    code, output = plan_cli(*args)
    assert code == 2 and message in output and "Traceback" not in output
    assert len(output.strip().splitlines()) == 1


def test_auto_is_each_engines_default():
    # TGI without --dtype: FlashCausalLM's default_dtype float16 for Llama (bf16 only for its BF16_MODEL_TYPES)
    for engine, dtype in (("vllm", "bf16"), ("hf", "bf16"), ("llamacpp", "f16"), ("tgi", "fp16")):
        code, output = plan_cli("llama-3.1-8b", "--context", "1000", "--engine", engine, "--json")
        assert code == 0 and json.loads(output)["kv_dtype"] == dtype
    code, output = plan_cli("llama-3.1-8b", "--context", "200000", "--allow-long-context", "--json")
    assert code == 0 and json.loads(output)["kv_bytes"] == 200000 * 131_072


@pytest.mark.parametrize("content, message", [
    ('{"model_type": "llama", "num_hidden_layers": "32", "num_attention_heads": 32, "hidden_size": 4096}',
     "num_hidden_layers"),
    ("[1, 2, 3]", "holds one JSON object, not a list"),
    ("{not json", "not valid JSON"),
    ('{"model_type": "t5"}', "encoder-decoder"),
    ('{"model_type": "mamba", "num_hidden_layers": 4, "hidden_size": 64}', "no attention layer that caches KV"),
])
def test_bad_configs_get_one_line_naming_the_file(tmp_path, content, message):
    (tmp_path / "config.json").write_text(content)
    code, output = plan_cli(str(tmp_path), "--context", "100")
    assert code == 2 and message in output and "config.json" in output and "Traceback" not in output


def test_kv_answer_when_the_weights_are_unknown(tmp_path):
    # a real model type, but a file without a vocabulary size or an MLP size, of a type without class defaults
    config = {"model_type": "my_decoder", "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4,
              "hidden_size": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, output = plan_cli(str(tmp_path), "--context", "1000", "--gpu", "L4", "--json")
    out = json.loads(output)
    assert code == 0 and out["kv_bytes"] == 1000 * 2 * 24 * 4 * 128 * 2
    assert out["weights_bytes"] is None and out["fits"] is None and "unknown" in out["weights_source"]
    code, output = plan_cli(str(tmp_path), "--context", "1000", "--gpu", "L4")
    assert code == 0 and "unknown: the weights are unknown" in output


def test_plan_on_real_gguf_and_hf_copy(smollm2):
    gguf = resolve_model(str(smollm2.gguf_path))
    assert gguf.weights_source == "GGUF tensor bytes" and 70e6 < gguf.weights_bytes < 100e6
    hf = resolve_model(str(smollm2.hf_dir))
    assert hf.weights_source == "safetensors tensor bytes" and hf.weights_bytes == pytest.approx(269e6, rel=0.01)
    assert kv_bytes_per_token(gguf.geometry, "f16") == kv_bytes_per_token(hf.geometry, "bf16") == 23_040


# --- configs it was not built around (fields typed from the hub's config.json files) -----------------

JAMBA = {"model_type": "jamba", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4,
         "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 16, "num_experts_per_tok": 2,
         "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "vocab_size": 65536,
         "max_position_embeddings": 262144}  # ai21labs/Jamba-v0.1, 51.6 B parameters
CHATGLM3 = {"model_type": "chatglm", "num_layers": 28, "hidden_size": 4096, "ffn_hidden_size": 13696,
            "kv_channels": 128, "num_attention_heads": 32, "multi_query_attention": True, "multi_query_group_num": 2,
            "padded_vocab_size": 65024, "seq_length": 8192}  # THUDM/chatglm3-6b (remote code), 6.24 B parameters


def write(tmp_path, config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_hybrid_mamba_model_counts_its_attention_layers_only(tmp_path):
    m = resolve_model(write(tmp_path, JAMBA))
    assert (m.geometry.num_layers, m.geometry.count("none")) == (4, 28)  # one attention layer in 8
    assert kv_bytes_per_token(m.geometry, "bf16") == 2 * 4 * 8 * 128 * 2
    assert m.weights.parameters == pytest.approx(51.6e9, rel=0.05)  # experts on every other layer, Mamba mixers


def test_a_remote_code_config_is_read_with_its_own_field_names(tmp_path):
    m = resolve_model(write(tmp_path, CHATGLM3))
    g = m.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim_k, g.max_context) == (28, 2, 128, 8192)
    assert m.weights.parameters == pytest.approx(6.24e9, rel=0.02)


def test_an_encoder_is_refused(tmp_path):
    bert = {"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "max_position_embeddings": 512}
    code, output = plan_cli(write(tmp_path, bert), "--context", "256")
    assert code == 2 and "bert is an encoder (a masked language model)" in output


# --- issue 15 item 4: the overhead measured in a run -----------------------------------------------

def _overhead_run(tmp_path, rows: list[dict]) -> Path:
    """A run folder whose cells carry the per-GPU overhead figures a GPU run writes (no GPU needed)."""
    from kvbench.store.schema import CellRow

    run = tmp_path / "gpu-run"
    run.mkdir()
    base = dict(run_id="gpu-run", workload="gpu_long_context", prompt_tokens=1024, output_tokens=128,
                concurrency=1, kv_dtype="bf16", model="Qwen/Qwen2.5-7B-Instruct", engine_mode="deployed")
    lines = [CellRow(**{**base, "cell_id": f"c{i}", "backend": f"{r['engine']}-1", "engine_version": "1", **r})
             .model_dump_json() for i, r in enumerate(rows)]
    (run / "cells.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_plan_takes_the_overhead_a_run_measured(tmp_path):
    run = _overhead_run(tmp_path, [
        {"engine": "vllm", "status": "ok", "gpu_overhead_bytes_per_gpu": 3.25 * GIB},
        {"engine": "vllm", "status": "ok", "gpu_overhead_bytes_per_gpu": 2.0 * GIB},
        {"engine": "vllm", "status": "failed", "gpu_overhead_bytes_per_gpu": 9.0 * GIB},  # failed: not counted
        {"engine": "llamacpp", "status": "ok", "gpu_overhead_bytes_per_gpu": 0.75 * GIB},
        {"engine": "hf", "status": "ok"}])  # not measured
    args = ["plan", "llama-3.1-8b", "--context", "8192", "--gpu", "H100-80GB", "--json"]
    assumed = json.loads(runner.invoke(app, [*args, "--margin", "0.1"]).stdout)  # the plain formula: no engine
    vllm_assumed = json.loads(runner.invoke(app, [*args, "--engine", "vllm"]).stdout)
    vllm = json.loads(runner.invoke(app, [*args, "--engine", "vllm", "--overhead-from", str(run)]).stdout)
    llama = json.loads(runner.invoke(app, [*args, "--engine", "llamacpp", "--overhead-from", str(run)]).stdout)
    assert assumed["overhead_bytes"] == 1.5 * GIB and assumed["overhead_source"].startswith("assumed: 1.5 GiB; no published run measured")
    assert vllm["overhead_bytes"] == 3.25 * GIB and "largest of 2 cells" in vllm["overhead_source"]
    assert "vllm-1, deployed" in vllm["overhead_source"] and "gpu-run" in vllm["overhead_source"]
    assert llama["overhead_bytes"] == 0.75 * GIB
    # the measured figure stands for vLLM's own terms at startup (its share of the GPU stays): it moves the answer
    assert [t["term"] for t in vllm["startup"]["terms"]] == ["overhead given"]
    assert vllm["usable_bytes"] == vllm_assumed["usable_bytes"]
    assert (vllm["needed_bytes_per_gpu"] - vllm["overhead_bytes"] == pytest.approx(
        vllm_assumed["needed_bytes_per_gpu"] - vllm_assumed["overhead_bytes"]))
    assert vllm["max_batch"] <= vllm_assumed["max_batch"]


@pytest.mark.parametrize("extra, message", [
    (["--engine", "hf"], "no ok cell of hf measured the overhead"),
    (["--overhead-gib", "2"], "give one"),
])
def test_overhead_from_a_run_that_did_not_measure_it_says_so(tmp_path, extra, message):
    run = _overhead_run(tmp_path, [{"engine": "hf", "status": "ok"}])
    out = runner.invoke(app, ["plan", "llama-3.1-8b", "--context", "100", "--gpu", "H100-80GB",
                              "--overhead-from", str(run), *extra])
    assert out.exit_code == 2 and message in out.output, out.output
    missing = runner.invoke(app, ["plan", "llama-3.1-8b", "--context", "100", "--overhead-from", str(tmp_path)])
    assert missing.exit_code == 2 and "not a run folder" in missing.output


def test_llamacpp_pool_holds_at_most_one_sequence_per_slot():
    """The published CPU default's llama.cpp pool: 4 slots x 8,192 cells (log: "8192 cells, 30 layers, 4/4
    seqs"). A 1,024 + 64-token sequence pads to 1,280 cells: 6 would fit one stream's cells, but each slot
    serves one sequence, so 4 (the old rule said 32,768 // 1,280 = 25)."""
    rules = REGISTRY["llamacpp"].kv_rules
    g = geom("llama-3-8b")
    split = {"caches": [{"cells": 8192, "streams": 4, "seqs": 4}]}
    assert rules.sequences_in_pool(g, 32768, 1087, split) == 4
    assert rules.sequences_in_pool(g, 32768, 8191, split) == 4  # 8,192 cells exactly: one per slot
    assert rules.sequences_in_pool(g, 32768, 8193, split) == 0  # over a slot's cells: none fits
    unified = {"caches": [{"cells": 32768, "streams": 1, "seqs": 4}]}  # --kv-unified: one stream for all slots
    assert rules.sequences_in_pool(g, 32768, 8191, unified) == 4 and rules.sequences_in_pool(g, 32768, 16383, unified) == 2
    # a sliding-window model logs a second, smaller cache: the full-attention one counts
    swa = {"caches": [{"cells": 8192, "streams": 4, "seqs": 4}, {"cells": 1024, "streams": 4, "seqs": 4}]}
    assert rules.sequences_in_pool(g, 32768, 2047, swa) == 4
