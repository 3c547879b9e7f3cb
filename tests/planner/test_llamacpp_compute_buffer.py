"""llama.cpp's CUDA compute buffer, each part of the reserve graph's live set against a public startup log
(tests/data/startup_logs/llamacpp-*.toml): the figures quoted are the logs' "CUDA0 compute buffer size" lines."""
from __future__ import annotations

import pytest

from kvbench.backends.shared import llama_server_gpumem as gm
from kvbench.kv.rules import KVQuestion
from kvbench.kv.startup import StartupQuestion
from kvbench.kv.units import MIB
from kvbench.selfcheck import startup_logs as sl

Q8_0 = 34 / 32  # bytes per weight: a block of 32 int8 and an f16 scale (ggml-common.h block_q8_0)
Q6_K = 210 / 256  # block_q6_K: 256 weights in 210 bytes


def entry(stem: str) -> dict:
    return next(e for e in sl.corpus() if e["file"].startswith(stem))


def question(stem: str, **options) -> tuple[StartupQuestion, int]:
    e = entry(stem)
    model, st = sl._model(e), e["settings"]
    opts = {k: st[k] for k in ("n_ubatch", "flash_attn") if k in st} | options
    kv = KVQuestion(model.geometry, st.get("cache_type_k", "f16"), st["n_ctx"], 1, options=opts)
    return StartupQuestion(kv, st["n_ctx"], "", 0, 0, "", 0, model.widths), st["n_ctx"]


def moments_mib(stem: str, host_weight_copy: float = 0.0, **options) -> dict[str, float]:
    q, cells = question(stem, **options)
    return {k: b / MIB for k, (b, _) in gm.graph_moments(q, cells, host_weight_copy).items()}


def buffer_mib(stem: str) -> float:
    q, cells = question(stem)
    return gm.compute_buffer(q, cells).bytes / MIB


@pytest.mark.parametrize("stem, logged", [
    ("llamacpp-logdetective-106-ctx2048", 164.0),  # Mistral 7B: 128 scores + 4 mask + 32
    ("llamacpp-logdetective-106-ctx32768", 2144.0),  # the scores and the mask grow with the cells, the rest does not
    ("llamacpp-ggmlci-open-llama-7b-v2-v100-ctx2048", 164.0),  # b2459: 32 KV heads, the same graph
    ("llamacpp-ik514-qwen3-30b-a3b-rtx4090-rtx5090", 1080.0),  # Q of 32 x 128 beside a 2048 hidden size
])
def test_without_flash_attention_the_scores_the_mask_q_out_and_two_hidden(stem, logged):
    m = moments_mib(stem)
    assert m["attention"] == logged and buffer_mib(stem) == logged


def test_scores_of_a_70b_on_a_layer_split_within_half_a_percent():
    # CUDA0 of two GPUs, 78 of 80 layers offloaded: 1108.50 logged, 4.5 MiB the model does not explain
    assert buffer_mib("llamacpp-8035-llama3-70b-iq2m-rtx4060ti-rtx3060") == pytest.approx(1108.5, rel=0.005)


def test_sequences_sharing_one_unified_cache_attend_to_all_its_cells():
    # ollama --parallel 4 on 8192 cells (one unified cache in that llama.cpp): "CUDA0 compute buffer size = 560.00 MiB"
    assert moments_mib("llamacpp-deipss-ollama-r1-distill-llama-8b-gtx1080")["attention"] == 560.0


def test_one_stream_per_sequence_splits_the_tokens_over_the_streams():
    q, cells = question("llamacpp-logdetective-106-ctx32768")
    one = gm.graph_moments(q, cells)["attention"][0]
    kv4 = KVQuestion(q.kv.geometry, "f16", 8192, 4, options=dict(q.kv.options))
    four = gm.graph_moments(StartupQuestion(kv4, 8192, "", 0, 0, "", 0, q.widths), cells)["attention"][0]
    assert four < one / 3  # 4 streams of 8192 cells: a quarter of the scores and the mask


@pytest.mark.parametrize("stem, logged", [
    ("llamacpp-yuy4o-qwen3-coder-30b-a3b-a100-40gb", 300.75),  # 151936 x 512 x 4 + 2048 x 512 x 4
    # CUDA1 of the two RTX 3090s holds the output layer and no host expert: "CUDA1 compute buffer size = 304.75 MiB"
    ("llamacpp-ik370-qwen3-235b-a22b-2x-rtx3090-q8-ctx16384", 304.75),
])
def test_with_flash_attention_a_full_gpu_graph_peaks_at_the_logits(stem, logged):
    m = moments_mib(stem)
    assert m["output"] == logged == max(m.values())


def test_flash_attention_drops_the_scores_and_halves_the_mask():
    on = moments_mib("llamacpp-logdetective-106-ctx32768", flash_attn=True)["attention"]
    off = moments_mib("llamacpp-logdetective-106-ctx32768")["attention"]
    assert off - on == 2048 + 64 - 32  # 32 heads of scores and the f32 mask, for the f16 mask


def test_a_quantised_cache_leaves_the_buffer_as_it_is():
    # the same A6000 and model at 32768 cells: 1024.00 MiB with an f16 and with a q8_0 cache
    assert buffer_mib("llamacpp-ik357-qwen3-235b-a22b-a6000-ctx32768") == \
        buffer_mib("llamacpp-ik370-qwen3-235b-a22b-a6000-q8-ctx32768")


def test_an_expert_tensor_kept_in_host_memory_is_copied_in_for_the_moe_ffn():
    # -ot ffn=CPU: each layer's 128 x 1536 x 4096 expert tensor is copied into CUDA0's compute buffer for its op.
    # Q6_K on an RTX 3090, 16384 cells: 630 MiB copied + 16 mask + 128 MoE activations (+ the router's 0.25) =
    # 774.00 MiB logged
    experts = 128 * 1536 * 4096
    m = moments_mib("llamacpp-ik357-qwen3-235b-a22b-rtx3090-q8-ctx16384", experts * Q6_K)
    assert m["ffn"] == pytest.approx(774.0, abs=0.25) and m["ffn"] == max(m.values())
    # Q8_0 on an A6000, 32768 cells: 816 copied + 32 + 128 = 976 of 1024.00 logged (48 MiB the model leaves out)
    m = moments_mib("llamacpp-ik357-qwen3-235b-a22b-a6000-ctx32768", experts * Q8_0)
    assert m["ffn"] == pytest.approx(1024.0, rel=0.05)


def test_the_term_names_its_moment_and_takes_no_fitted_constant():
    q, cells = question("llamacpp-logdetective-106-ctx32768")
    term = gm.compute_buffer(q, cells)
    assert not term.fitted and "at its attention" in term.source
    assert [f.key for f in gm.FITS] == ["not_free_at_load_mib"]  # the CUDA context alone is fitted
