"""The KV formula against values computed by hand."""
import pytest

from kvbench.kvmodel import (
    KVGeometry,
    MissingConfigKeys,
    UnknownKVDtype,
    dtype_bytes,
    geometry_from_gguf,
    geometry_from_hf_config,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
)

LLAMA_31_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
               "max_position_embeddings": 131072}
LLAMA_2_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}  # no kv heads key: MHA


def test_gqa_llama31_8b_bf16():
    # 2 x 32 layers x 8 kv heads x 128 x 2 bytes
    assert kv_bytes_per_token(geometry_from_hf_config(LLAMA_31_8B), "bf16") == 131_072


def test_mha_llama2_7b_without_kv_heads_key():
    assert kv_bytes_per_token(geometry_from_hf_config(LLAMA_2_7B), "fp16") == 524_288


def test_head_dim_key_wins_over_hidden_over_heads():
    # Gemma-3-270m-like: hidden 640 / 4 heads would say 160, the config says 256.
    config = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 640,
              "head_dim": 256}
    assert kv_bytes_per_token(geometry_from_hf_config(config), "bf16") == 2 * 18 * 1 * 256 * 2


def test_qwen2_sliding_window_ignored_when_disabled():
    config = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
              "sliding_window": 131072, "use_sliding_window": False}
    geom = geometry_from_hf_config(config)
    assert geom.num_sliding_layers == 0
    assert kv_bytes_for_sequence(geom, "bf16", 200_000) == 57_344 * 200_000


def test_sliding_window_all_layers_caps_at_window():
    mistral = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
               "sliding_window": 4096}
    geom = geometry_from_hf_config(mistral)
    assert kv_bytes_for_sequence(geom, "bf16", 10_000) == 131_072 * 4096
    assert kv_bytes_for_sequence(geom, "bf16", 100) == 131_072 * 100


def test_hybrid_layer_types():
    config = {"num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "hidden_size": 16, "sliding_window": 10,
              "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
    geom = geometry_from_hf_config(config)
    per_layer_token = 2 * 1 * 8 * 2
    assert kv_bytes_for_sequence(geom, "bf16", 100) == per_layer_token * (1 * 100 + 3 * 10)


def test_quantised_dtypes_include_block_scales():
    assert dtype_bytes("q8_0") == 34 / 32
    assert dtype_bytes("q4_0") == 18 / 32
    geom = KVGeometry(num_layers=30, num_kv_heads=3, head_dim_k=64, head_dim_v=64)
    # llama.cpp reported 47.81 MiB for 4096 cells of SmolLM2 in q8_0
    assert round(kv_bytes_per_token(geom, "q8_0") * 4096 / 2**20, 2) == 47.81


def test_missing_keys_are_named():
    with pytest.raises(MissingConfigKeys) as err:
        geometry_from_hf_config({"num_attention_heads": 8})
    assert "num_hidden_layers" in str(err.value) and "head_dim or hidden_size" in str(err.value)


def test_unknown_dtype_lists_known_ones():
    with pytest.raises(UnknownKVDtype) as err:
        dtype_bytes("fp6")
    assert "q8_0" in str(err.value) and "bf16" in str(err.value)


def test_gguf_geometry_of_embedded_model(smollm2):
    geom = geometry_from_gguf(smollm2.gguf_path)
    assert (geom.num_layers, geom.num_kv_heads, geom.head_dim_k, geom.max_context) == (30, 3, 64, 8192)
    # the GGUF and the HF copy made from it describe the same KV
    assert kv_bytes_per_token(geom, "f16") == kv_bytes_per_token(smollm2.geometry, "bf16") == 23_040
