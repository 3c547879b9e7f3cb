"""The plain KV formula and config reading against values computed by hand."""
import json

import pytest

from kvbench.kv.geometry import (
    KVGeometry,
    LayerKV,
    UnevenSplit,
    UnknownKVDtype,
    check_split,
    dtype_bytes,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    pipeline_partition,
    pipeline_stage,
    plain_kv,
)
from kvbench.kv.model_config import ConfigError, geometry_from_gguf, geometry_from_hf, geometry_from_hf_dict

LLAMA_31_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "max_position_embeddings": 131072}
LLAMA_2_7B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}


def test_gqa_llama31_8b_bf16():
    # 2 x 32 layers x 8 kv heads x 128 x 2 bytes
    assert kv_bytes_per_token(geometry_from_hf_dict(LLAMA_31_8B), "bf16") == 131_072


def test_mha_llama2_7b_without_kv_heads_key():
    assert kv_bytes_per_token(geometry_from_hf_dict(LLAMA_2_7B), "fp16") == 524_288


def test_head_dim_key_wins_over_hidden_over_heads():
    # Gemma-3-270m-like: hidden 640 / 4 heads would say 160, the config says 256.
    config = {"model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
              "hidden_size": 640, "head_dim": 256, "sliding_window_pattern": 6}
    assert kv_bytes_per_token(geometry_from_hf_dict(config), "bf16") == 2 * 18 * 1 * 256 * 2


def test_qwen2_sliding_window_ignored_when_disabled():
    config = {"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "hidden_size": 3584, "sliding_window": 131072, "use_sliding_window": False}
    geom = geometry_from_hf_dict(config)
    assert geom.num_sliding_layers == 0
    assert kv_bytes_for_sequence(geom, "bf16", 200_000) == 57_344 * 200_000


def test_sliding_window_all_layers_caps_at_window():
    mistral = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "sliding_window": 4096}
    geom = geometry_from_hf_dict(mistral)
    assert kv_bytes_for_sequence(geom, "bf16", 10_000) == 131_072 * 4096
    assert kv_bytes_for_sequence(geom, "bf16", 100) == 131_072 * 100


def test_hybrid_layer_types():
    config = {"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 8, "hidden_size": 16, "sliding_window": 10,
              "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
    geom = geometry_from_hf_dict(config)
    per_layer_token = 2 * 1 * 8 * 2
    assert kv_bytes_for_sequence(geom, "bf16", 100) == per_layer_token * (1 * 100 + 3 * 10)


def test_quantised_dtypes_include_block_scales():
    assert dtype_bytes("q8_0") == 34 / 32
    assert dtype_bytes("q4_0") == 18 / 32
    geom = KVGeometry.uniform(30, 3, 64)
    # llama.cpp reported 47.81 MiB for 4096 cells of SmolLM2 in q8_0
    assert round(kv_bytes_per_token(geom, "q8_0") * 4096 / 2**20, 2) == 47.81


def test_missing_fields_are_named_with_their_aliases():
    with pytest.raises(ConfigError) as err:
        geometry_from_hf_dict({"model_type": "my_own_arch", "num_attention_heads": 8})
    assert "num_hidden_layers or n_layer" in str(err.value)


def test_unknown_dtype_lists_known_ones():
    with pytest.raises(UnknownKVDtype) as err:
        dtype_bytes("fp6")
    assert "q8_0" in str(err.value) and "bf16" in str(err.value)


def test_tensor_parallel_splits_must_be_even():
    g = geometry_from_hf_dict(LLAMA_31_8B)
    check_split(g, 4)  # 32 heads, 8 KV heads over 4
    check_split(g, 16)  # 8 KV heads replicated twice
    with pytest.raises(UnevenSplit, match="8 KV heads cannot be split evenly over 3"):
        check_split(KVGeometry.uniform(32, 8, 128, num_attention_heads=24), 3)
    with pytest.raises(UnevenSplit, match="32 attention heads"):
        check_split(g, 3)
    assert plain_kv(g, "bf16", 1000, 2, tp=4).bytes_per_rank == 2 * 1000 * 131_072 / 4


def test_layer_kinds_and_describe():
    layers = (LayerKV("full", 2, 64, 64), LayerKV("sliding", 2, 64, 64, 32), LayerKV("chunked", 2, 64, 64, 16),
              LayerKV("none", why_none="linear attention"))
    g = KVGeometry(layers, num_attention_heads=4)
    assert (g.num_layers, g.count("none"), g.sliding_window, g.chunk_size) == (3, 1, 32, 16)
    assert kv_bytes_for_sequence(g, "bf16", 100) == 2 * 64 * 2 * 2 * (100 + 32 + 16)
    assert "1 layers without a growing KV (linear attention)" in g.describe()
    with pytest.raises(ValueError, match="allowed: full"):
        LayerKV("local")


def test_gguf_geometry_of_embedded_model(smollm2):
    geom = geometry_from_gguf(smollm2.gguf_path)
    assert (geom.num_layers, geom.num_kv_heads, geom.head_dim_k, geom.max_context) == (30, 3, 64, 8192)
    # the GGUF and the HF copy made from it describe the same KV
    assert kv_bytes_per_token(geom, "f16") == kv_bytes_per_token(smollm2.geometry, "bf16") == 23_040


def test_a_folder_is_read_like_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert geometry_from_hf(tmp_path) == geometry_from_hf(tmp_path / "config.json")


def test_a_pipeline_splits_layers_as_vllm_does():
    """vLLM's get_pp_indices: even stages, the remainder one each to the stages before the last, from the
    second-to-last back (61 over 2: 31, 30; 80 over 3: 27, 27, 26; 30 over 4: 7, 8, 8, 7)."""
    assert pipeline_partition(61, 2) == [31, 30]
    assert pipeline_partition(80, 3) == [27, 27, 26]
    assert pipeline_partition(30, 4) == [7, 8, 8, 7]
    with pytest.raises(UnevenSplit):
        pipeline_partition(4, 8)
    # a stage holds its layers' KV: the heaviest stage of a hybrid model is the one with the most full layers
    layers = (*[LayerKV("none", why_none="linear attention")] * 3, LayerKV("full", 2, 64, 64),
              *[LayerKV("none", why_none="linear attention")] * 3, LayerKV("full", 2, 64, 64))
    g = KVGeometry(layers, num_attention_heads=4)
    assert kv_bytes_per_token(pipeline_stage(g, 2), "bf16") == 2 * 2 * 64 * 2  # one full layer of 4 per stage
    assert kv_bytes_per_token(pipeline_stage(g, 1), "bf16") == 2 * 2 * 2 * 64 * 2
    assert len(pipeline_stage(KVGeometry.uniform(61, 1, 576, 0), 2).layers) == 31
