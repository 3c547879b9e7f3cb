"""KV model per attention kind and engine, and the planner, against values computed by hand."""
import json
import math

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.kvmodel import (
    MissingConfigKeys,
    UnknownEngine,
    engine_kv,
    geometry_from_gguf_keys,
    geometry_from_hf_config,
    kv_bytes_per_token,
    load_hf_config,
)
from kvbench.planner import CATALOG_DIR, GIB, PlanError, PlanInput, gpu_memory, plan, resolve_model

runner = CliRunner()


def geom(name):
    return resolve_model(name).geometry


# --- bytes per token by attention kind (bf16 unless said) -----------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("llama-2-7b", 2 * 32 * 32 * 128 * 2),      # MHA: 524,288
    ("llama-3-8b", 2 * 32 * 8 * 128 * 2),       # GQA: 131,072
    ("llama-3.1-8b", 131_072),
    ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),    # 327,680
    ("qwen2.5-0.5b", 2 * 24 * 2 * 64 * 2),      # 12,288
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),       # 57,344
    ("qwen2-7b", 57_344),
    ("mistral-7b-v0.1", 131_072),
    ("gemma-2-9b", 2 * 42 * 8 * 256 * 2),       # head_dim 256 from the config, not 3584 / 16 = 224
    ("gemma-3-1b", 2 * 26 * 1 * 256 * 2),       # MQA
    ("gemma-3-27b", 2 * 62 * 16 * 128 * 2),     # from text_config of a multimodal wrapper
    ("deepseek-v2", 60 * (512 + 64) * 2),       # MLA latent: 69,120
    ("deepseek-v3", 61 * (512 + 64) * 2),       # 70,272
])
def test_bytes_per_token(name, expected):
    assert kv_bytes_per_token(geom(name), "bf16") == expected


def test_attention_kinds():
    assert [geom(n).attention for n in ("llama-2-7b", "llama-3-8b", "gemma-3-1b", "deepseek-v3")] == \
        ["MHA", "GQA", "MQA", "MLA"]


def test_mla_is_57x_smaller_than_the_naive_formula():
    naive = 2 * 61 * 128 * 128 * 2  # num_key_value_heads 128 x head_dim 128 taken at face value
    assert naive / kv_bytes_per_token(geom("deepseek-v3"), "bf16") == pytest.approx(56.9, abs=0.05)


def test_sliding_patterns():
    assert geom("gemma-2-9b").num_sliding_layers == 21  # even layers of 42
    g3 = geom("gemma-3-1b")
    assert g3.num_sliding_layers == 22 and g3.sliding_layers[5] is False and g3.sliding_layers[4] is True
    assert geom("mistral-7b-v0.1").num_sliding_layers == 32
    assert geom("qwen2.5-7b").num_sliding_layers == 0  # sliding_window set, use_sliding_window false
    layer_types = {"num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                   "sliding_window": 8, "sliding_window_pattern": 6,
                   "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    assert geometry_from_hf_config(layer_types).sliding_layers == (False, True, False)  # layer_types wins


def test_exact_sliding_window_bytes():
    g = geom("gemma-3-1b")
    per_layer_token = 2 * 1 * 256 * 2
    assert engine_kv(g, "bf16", 2000, 3).bytes_per_rank == 3 * per_layer_token * (4 * 2000 + 22 * 512)
    m = geom("mistral-7b-v0.1")
    assert engine_kv(m, "bf16", 10_000, 1).bytes_per_rank == 131_072 * 4096


@pytest.mark.parametrize("dtype, per_element", [("fp32", 4), ("fp16", 2), ("fp8_e4m3", 1), ("fp8_e5m2", 1),
                                                ("int8", 1), ("q8_0", 34 / 32), ("q4_0", 18 / 32),
                                                ("q4_1", 20 / 32), ("q5_0", 22 / 32), ("q5_1", 24 / 32),
                                                ("iq4_nl", 18 / 32)])
def test_dtypes(dtype, per_element):
    assert kv_bytes_per_token(geom("llama-3.1-8b"), dtype) == 2 * 32 * 8 * 128 * per_element


def test_tensor_parallel_heads_never_below_one_and_mla_replicated():
    g = geom("llama-3.1-70b")
    assert kv_bytes_per_token(g, "bf16", tp=2) == 2 * 80 * 4 * 128 * 2
    assert kv_bytes_per_token(g, "bf16", tp=8) == 2 * 80 * 1 * 128 * 2
    assert kv_bytes_per_token(g, "bf16", tp=16) == 2 * 80 * 1 * 128 * 2  # replicated, not 0
    d = geom("deepseek-v3")
    assert kv_bytes_per_token(d, "bf16", tp=8) == 70_272


# --- engine rules -----------------------------------------------------------------------------------

def test_vllm_block_rounding():
    g = geom("llama-3.1-8b")
    r = engine_kv(g, "bf16", 1000, 4, "vllm")
    assert r.tokens_full == 4 * 1008 and r.bytes_per_rank == 4 * 1008 * 131_072
    assert engine_kv(g, "bf16", 1000, 4, "vllm", block_size=128).tokens_full == 4 * 1024


def test_vllm_mla_latent_and_sliding_blocks():
    assert engine_kv(geom("deepseek-v3"), "bf16", 100, 1, "vllm").bytes_per_rank == 112 * 70_272
    g = geom("gemma-3-1b")  # window 512, block 16: (ceil(511 / 16) + 1) x 16 = 528 tokens on sliding layers
    r = engine_kv(g, "bf16", 4000, 1, "vllm")
    assert r.tokens_sliding == 528 and r.bytes_per_rank == 2 * 256 * 2 * (4 * 4000 + 22 * 528)


def test_tgi_reservation_blocks_and_decompressed_deepseek():
    g = geom("llama-3.1-8b")
    assert engine_kv(g, "bf16", 1000, 2, "tgi").bytes_per_rank == 2 * 1000 * 131_072  # block 1
    assert engine_kv(g, "bf16", 1000, 2, "tgi", block_size=256).tokens_full == 2 * 1024
    # DeepSeek-V3 decompressed: 128 heads x (K 128 + 64, V 128) per layer
    assert engine_kv(geom("deepseek-v3"), "bf16", 10, 1, "tgi").bytes_per_rank == 10 * 61 * 128 * (192 + 128) * 2
    # and no sliding-window saving
    assert engine_kv(geom("mistral-7b-v0.1"), "bf16", 8000, 1, "tgi").bytes_per_rank == 8000 * 131_072
    with pytest.raises(ValueError, match="TGI"):
        engine_kv(g, "q8_0", 10, 1, "tgi")


def test_llamacpp_padding_streams_and_swa_cache():
    g = geom("llama-3.1-8b")
    r = engine_kv(g, "f16", 1000, 4, "llamacpp")  # n_ctx 4000 -> 4096, 4 streams of 1024 cells
    assert r.tokens_full == 4 * 1024 and r.bytes_per_rank == 4 * 1024 * 131_072
    assert engine_kv(g, "f16", 1000, 4, "llamacpp", unified=True).tokens_full == 4096
    assert engine_kv(g, "q8_0", 4096, 1, "ollama").bytes_per_rank == 4096 * 2 * 32 * 8 * 128 * 34 / 32
    g3 = geom("gemma-3-1b")  # window 512: SWA cache min(8192, 512 + 512) = 1024 cells
    r = engine_kv(g3, "f16", 8192, 1, "llamacpp")
    assert (r.tokens_full, r.tokens_sliding) == (8192, 1024)
    assert r.bytes_per_rank == 2 * 256 * 2 * (4 * 8192 + 22 * 1024)


def test_hf_window_minus_one_and_deepseek_by_version():
    g3 = geom("gemma-3-1b")
    assert engine_kv(g3, "bf16", 2000, 1, "hf").bytes_per_rank == 2 * 256 * 2 * (4 * 2000 + 22 * 511)
    d = geom("deepseek-v3")
    assert engine_kv(d, "bf16", 10, 1, "hf").bytes_per_rank == 10 * 70_272
    assert engine_kv(d, "bf16", 10, 1, "hf", hf_version=(5, 0)).bytes_per_rank == 10 * 61 * 128 * 320 * 2


def test_unknown_engine():
    with pytest.raises(UnknownEngine, match="vllm, tgi, llamacpp, ollama, hf"):
        engine_kv(geom("llama-3-8b"), "bf16", 10, 1, "sglang")


# --- inputs --------------------------------------------------------------------------------------

def test_ollama_model_info_and_gguf_keys():
    info = {"general.architecture": "gemma3", "gemma3.block_count": 26, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
            "gemma3.attention.value_length": 256, "gemma3.attention.sliding_window": 512,
            "gemma3.context_length": 32768, "gemma3.embedding_length": 1152}
    g = geometry_from_gguf_keys(info, "model_info")
    assert g.num_sliding_layers == 22 and kv_bytes_per_token(g, "f16") == 2 * 26 * 256 * 2
    mla = {"general.architecture": "deepseek2", "deepseek2.block_count": 61, "deepseek2.attention.head_count": 128,
           "deepseek2.attention.kv_lora_rank": 512, "deepseek2.rope.dimension_count": 64}
    assert kv_bytes_per_token(geometry_from_gguf_keys(mla), "f16") == 70_272
    with pytest.raises(MissingConfigKeys, match="llama.block_count"):
        geometry_from_gguf_keys({"general.architecture": "llama", "llama.attention.head_count": 8})


def test_nested_text_config_and_folder(tmp_path):
    (tmp_path / "config.json").write_text((CATALOG_DIR / "gemma-3-27b.json").read_text())
    assert load_hf_config(tmp_path)["num_hidden_layers"] == 62
    assert resolve_model(str(tmp_path)).geometry == geom("gemma-3-27b")


def test_missing_keys_named():
    with pytest.raises(MissingConfigKeys, match="qk_rope_head_dim"):
        geometry_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 2, "kv_lora_rank": 512})


# --- planner ----------------------------------------------------------------------------------------

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


def test_plan_cli_json_and_errors():
    result = runner.invoke(app, ["plan", "deepseek-v3", "--context", "4096", "--batch", "2", "--gpu", "H200",
                                 "--tp", "8", "--engine", "vllm", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert {"kv_bytes", "kv_bytes_per_token", "weights_bytes", "fits", "max_batch"} <= out.keys()
    assert out["kv_bytes_per_gpu"] == 2 * 4096 * 70_272  # latent replicated on each of the 8 GPUs
    bad = runner.invoke(app, ["plan", "no-such-model", "--context", "10"])
    assert bad.exit_code == 2 and "llama-3.1-8b" in bad.output
    table = runner.invoke(app, ["plan", "qwen2.5-7b", "--context", "8192", "--batch", "4", "--gpu", "L4"])
    assert table.exit_code == 0 and "fits" in table.output


def test_plan_on_real_gguf_and_hf_copy(smollm2):
    gguf = resolve_model(str(smollm2.gguf_path))
    assert gguf.weights_source == "GGUF tensor bytes" and 70e6 < gguf.weights_bytes < 100e6
    hf = resolve_model(str(smollm2.hf_dir))
    assert hf.weights_source == "safetensors tensor bytes" and hf.weights_bytes == pytest.approx(269e6, rel=0.01)
    assert kv_bytes_per_token(gguf.geometry, "f16") == kv_bytes_per_token(hf.geometry, "bf16") == 23_040
