"""Readers of engine output, against lines in the engines' real formats."""
from kvbench.backends.llamacpp.adapter import MIB, parse_kv_log
from kvbench.backends.prometheus import metric_samples

LLAMA_LOG = """\
0.00.215.634 I llama_kv_cache:        CPU KV buffer size =    45.00 MiB
0.00.245.047 I llama_kv_cache: size =   45.00 MiB (  1024 cells,  30 layers,  2/2 seqs), K (f16):   22.50 MiB, V (f16):   22.50 MiB
"""
# Gemma 3 style: a full-attention cache and a sliding-window cache, older prefix on the second
LLAMA_SWA_LOG = """\
llama_kv_cache: size =   12.00 MiB (  4096 cells,   3 layers,  1/1 seqs), K (q8_0):    6.00 MiB, V (q8_0):    6.00 MiB
llama_kv_cache_unified: size =   7.50 MiB (   768 cells,  15 layers,  1/1 seqs), K (q8_0):    3.75 MiB, V (q8_0):    3.75 MiB
"""

VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",kv_cache_memory_bytes="29491200",num_gpu_blocks="10"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.4444444444444444
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 0.0
"""


def test_llama_kv_line_per_stream():
    (cache,) = parse_kv_log(LLAMA_LOG)
    assert cache == {"mib": 45.0, "cells": 1024, "layers": 30, "streams": 2, "seqs": 2, "type_k": "f16",
                     "type_v": "f16", "k_mib": 22.5, "v_mib": 22.5}
    # 2 streams x 1024 cells x 23,040 bytes per token (SmolLM2, f16) is exactly 45 MiB
    assert cache["streams"] * cache["cells"] * 23_040 == 45 * MIB


def test_llama_kv_line_of_a_unified_cache():
    """llama-server -c 512 -np 2 --kv-unified (0.3.36): "2/1 seqs" is n_seq_max / n_stream, one stream of 512
    cells for both slots (11.25 MiB = 512 x 23,040 bytes), not two of 512."""
    line = ("0.00.414.600 I llama_kv_cache: size =   11.25 MiB (   512 cells,  30 layers,  2/1 seqs), "
            "K (f16):    5.62 MiB, V (f16):    5.62 MiB")
    (cache,) = parse_kv_log(line)
    assert (cache["streams"], cache["seqs"], cache["cells"]) == (1, 2, 512)
    assert cache["streams"] * cache["cells"] * 23_040 == round(11.25 * MIB)


def test_llama_two_caches_for_sliding_window_models():
    caches = parse_kv_log(LLAMA_SWA_LOG)
    assert [c["cells"] for c in caches] == [4096, 768]
    assert [c["type_k"] for c in caches] == ["q8_0", "q8_0"]


def test_llama_no_kv_line_means_unknown():
    assert parse_kv_log("llama_model_loader: loaded meta data\n") == []


def test_vllm_metrics():
    samples = metric_samples(VLLM_METRICS)
    labels, value = samples["vllm:cache_config_info"][0]
    assert labels["num_gpu_blocks"] == "10" and labels["block_size"] == "128" and value == 1.0
    assert samples["vllm:kv_cache_usage_perc"][0][1] == 4 / 9
    assert samples["vllm:num_preemptions_total"][0][1] == 0.0


def _slot(prompt, processed, decoded, processing=True):
    """A /slots entry as this machine's llama-server (llama-cpp-python 0.3.36's sources) answered it, trimmed
    to the fields read."""
    return {"id": 0, "n_ctx": 4096, "is_processing": processing, "n_prompt_tokens": prompt,
            "n_prompt_tokens_processed": processed,
            "next_token": [{"has_next_token": True, "has_new_line": False, "n_remain": 8 - decoded, "n_decoded": decoded}]}


def test_llama_slot_tokens_in_kv_count_only_the_processed_prompt_before_decoding():
    from kvbench.backends.llamacpp.adapter import slot_tokens_in_kv

    # polled while two 3,000-token prompts were prefilled (n_batch 2,048): n_prompt_tokens read 2,048 at 0.2 s
    # with nothing computed, then 3,000 while 2,048 were
    assert slot_tokens_in_kv(_slot(2048, 0, 0)) == 0
    assert slot_tokens_in_kv(_slot(3000, 2048, 0)) == 2048
    # decoding: the cached token list, prompt and fed-back tokens (n_decoded not added on top)
    assert slot_tokens_in_kv(_slot(3003, 3000, 3)) == 3003
    # a server that does not say how much is processed: the old figure
    assert slot_tokens_in_kv({"n_prompt_tokens": 1500, "next_token": {"n_decoded": 0}}) == 1500
