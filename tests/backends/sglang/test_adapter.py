"""SGLang: its KV rules against hand-computed values (from SGLang 0.5.23's source, cited in
backends/sglang/kvrules.py), the adapter against a faithful fake (tests/fakes/sglang_server.py) attached and
started from a stand-in ``python -m sglang.launch_server``, a whole run of a two-replica deployment, and
`kvbench plan --engine sglang` / `--compare-engines`."""
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvbench.backends import REGISTRY, kv_rules
from kvbench.backends.sglang import adapter as sglang_adapter
from kvbench.backends.sglang.adapter import SGLangBackend, parse_sglang_log
from kvbench.backends.sglang.kvrules import auto_mem_fraction_static, prefill_graph_sizes
from kvbench.cli import app
from kvbench.common.envs import EnvInstallError, ensure_env
from kvbench.common.models import ModelFiles
from kvbench.kv.model_config import geometry_from_hf_dict
from kvbench.kv.rules import KVQuestion, KVRuleError
from kvbench.planner import PlanInput, engines, plan, resolve_model, setup
from kvbench.planner.capacity import capacity, engine_pools, kv_room
from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells
from kvbench.workloads import Workload
from tests.fakes.sglang_server import FakeSGLang
from tests.fakes.testkit import BYTES_PER_TOKEN, Poller, listening, prompt, run, spec, stand_in
from tests.helpers import DATA

RULES = kv_rules("sglang")
CONFIGS = DATA / "configs"
GIB = 1 << 30
runner = CliRunner()


def geom(name):
    return resolve_model(name).geometry


def q(g, context=1, batch=1, dtype="bf16", **kw):
    return KVQuestion(g, dtype, context, batch, **kw)


# --- the rules: bytes per token by attention kind ------------------------------------------------------

def test_gqa_bytes_per_token_and_tensor_parallel_heads():
    g = geom("llama-3.1-8b")  # 32 layers, 8 KV heads, head_dim 128
    assert RULES.bytes_per_token(q(g)) == 32 * 8 * (128 + 128) * 2 == 131_072
    assert RULES.bytes_per_token(q(g, tp=2)) == 32 * 4 * 256 * 2  # get_num_kv_heads: 8 // 2 per GPU
    assert RULES.bytes_per_token(q(g, tp=16)) == 32 * 1 * 256 * 2  # max(1, 8 // 16): one head per GPU
    a = RULES.answer(q(g, 1000, 4))
    assert (a.tokens_full, a.bytes_per_gpu) == (4 * 1000, 4 * 1000 * 131_072)  # page 1: exact tokens
    assert a.pool_extra_bytes == 1 * 131_072  # the padding page (size + page_size rows per layer)


def test_mla_latent_replicated_for_sglangs_mla_architectures():
    g = geom("deepseek-v3")  # 61 layers, kv_lora_rank 512 + rope 64
    assert RULES.bytes_per_token(q(g)) == 61 * 576 * 2 == 70_272
    assert RULES.bytes_per_token(q(g, tp=8)) == 70_272  # the latent is on every rank
    assert RULES.bytes_per_token(q(g, dtype="fp8")) == 61 * 576  # fp8_e4m3: one byte
    assert "MLA latent" in RULES.answer(q(g, 100)).note
    # MiniCPM3 is one of SGLang's MLA architectures (vLLM decompresses it): SGLang keeps its 256 + 32 latent
    minicpm3 = geometry_from_hf_dict({"model_type": "minicpm3", "num_hidden_layers": 62, "num_attention_heads": 40,
                                      "hidden_size": 2560, "kv_lora_rank": 256, "q_lora_rank": 768,
                                      "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64})
    assert RULES.answer(q(minicpm3, 16)).bytes_per_gpu == 16 * 62 * 288 * 2
    assert REGISTRY["vllm"].kv_rules.answer(q(minicpm3, 16)).bytes_per_gpu == 16 * 62 * 40 * (96 + 96) * 2


def test_dsa_models_are_refused_not_guessed():
    g = replace(geom("deepseek-v3"), model_type="deepseek_v32")
    with pytest.raises(KVRuleError, match="DSA indexer cache"):
        RULES.answer(q(g, 100))


def test_windows_kept_only_for_sglangs_hybrid_swa_models():
    # Gemma 3: SGLang disables the hybrid SWA pool (model_overrides/gemma2_gemma3.py): every layer keeps
    # every token, 26 layers x 1 head x 512 x 2 bytes
    g = geom("gemma-3-1b")
    a = RULES.answer(q(g, 2000))
    assert a.bytes_per_gpu == 2000 * 26 * 512 * 2 and a.tokens_windowed == 0
    assert "windows not kept" in a.note
    assert REGISTRY["hf"].kv_rules.answer(q(g, 2000)).bytes_per_gpu < a.bytes_per_gpu  # transformers keeps windows
    # Mistral v0.1's window on every layer: not a hybrid SWA architecture either
    assert RULES.answer(q(geom("mistral-7b-v0.1"), 6000)).bytes_per_gpu == 6000 * 131_072


def test_gpt_oss_hybrid_swa_pools():
    g = geom("gpt-oss-20b")  # 24 layers: 12 full + 12 sliding (window 128), 8 KV heads, head_dim 64
    per_kind = 12 * 8 * (64 + 64) * 2
    assert RULES.cells(q(g)) == (per_kind, per_kind) == (24_576, 24_576)
    assert RULES.cell_size(q(g)) == pytest.approx(24_576 + 0.8 * 24_576)  # full + ratio x SWA
    # a request of 1,000 tokens: every token on the full layers, window + eviction interval + a page on the SWA
    a = RULES.answer(q(g, 1000))
    assert a.tokens_full == 1000 and a.tokens_windowed == 128 + 128 + 1
    assert a.bytes_per_gpu == (1000 + 257) * 24_576
    assert RULES.answer(q(g, 200)).bytes_per_gpu == (200 + 200) * 24_576  # short: all of it
    assert a.pool_extra_bytes == 2 * 24_576  # one padding page in each pool
    # disabling the hybrid pool (--disable-hybrid-swa-memory): every layer keeps every token
    off = q(g, 1000, options={"disable_hybrid_swa_memory": "true"})
    assert RULES.answer(off).bytes_per_gpu == 1000 * 2 * 24_576 and RULES.cells(off) == (49_152, 0)


def test_gpt_oss_pool_sizes_from_a_budget():
    g = geom("gpt-oss-20b")
    budget = 10 * GIB
    full = math.floor(budget / (24_576 * 1.8))
    assert full == 242_725 and RULES.max_total_num_tokens(q(g), budget) == full
    assert RULES.swa_tokens(q(g), full) == int(242_725 * 0.8) == 194_180
    # --swa-full-tokens-ratio 0.5: cell 1.5 x 24,576
    half = q(g, options={"swa_full_tokens_ratio": 0.5})
    assert RULES.max_total_num_tokens(half, budget) == budget // 36_864 == 291_271
    assert RULES.swa_tokens(half, 291_271) == 145_635
    # page 64: both pools in whole pages
    paged = q(g, block_size=64)
    assert RULES.max_total_num_tokens(paged, budget) == 242_725 // 64 * 64 == 242_688
    assert RULES.swa_tokens(paged, 242_688) == int(242_688 * 0.8) // 64 * 64 == 194_112
    # requests of 8,192 tokens: the full pool binds (29), not the SWA pool (194,180 // (128 + 1) = 1,505)
    assert RULES.sequences_in_pool(g, 242_725, 8192, {}) == 29
    # a small SWA pool binds: 1,000 // (min(8192, 128) + 1)
    assert RULES.sequences_in_pool(g, 242_725, 8192, {"swa_tokens": 1000}) == 7
    with pytest.raises(KVRuleError, match="swa_full_tokens_ratio"):
        RULES.answer(q(g, options={"swa_full_tokens_ratio": 1.5}))


def test_pool_is_budget_over_cell_size_in_whole_pages():
    g = geom("llama-3.1-8b")
    n = 7_629
    assert RULES.max_total_num_tokens(q(g), n * 131_072) == n
    assert RULES.max_total_num_tokens(q(g), n * 131_072 - 1) == n - 1  # one byte short: one token less
    assert RULES.max_total_num_tokens(q(g, block_size=64), n * 131_072) == n // 64 * 64 == 7_616
    assert RULES.bytes_per_block(q(g, block_size=64)) == 64 * 131_072
    assert RULES.sequences_in_pool(g, 81_920, 4096, {}) == 20
    assert RULES.sequences_in_pool(g, 81_920, 4000, {"page_size": 64}) == 81_920 // 4032 == 20
    # the buffers as allocated: tokens + one padding page per layer
    per = RULES.pool_bytes_per_token(g, "bf16", {"max_total_num_tokens": 20_000, "page_size": 1})
    assert per * 20_000 == pytest.approx(20_001 * 131_072)
    assert RULES.pool_bytes_per_token(g, "bf16", {}) == 131_072


def test_page_size_rounding_and_what_forces_it():
    g, mla = geom("llama-3.1-8b"), geom("deepseek-v3")
    a = RULES.answer(q(g, 1000, 2, block_size=64))
    assert a.tokens_full == 2 * 1024 and a.bytes_per_gpu == 2 * 1024 * 131_072 and a.pool_extra_bytes == 64 * 131_072
    assert RULES.page_size(q(g)) == 1  # _page_size_default
    assert RULES.page_size(q(g, capability=(9, 0))) == 1  # Hopper: fa3, any page
    assert RULES.page_size(q(g, capability=(10, 0))) == 64  # SM100: trtllm_mha, page 1 changed to 64
    assert RULES.page_size(q(g, capability=(10, 0), block_size=32)) == 32  # a page trtllm_mha takes
    assert RULES.page_size(q(mla, capability=(10, 0))) == 1  # MLA on SM100: flashinfer
    assert RULES.page_size(q(mla, options={"attention_backend": "flashmla"})) == 64
    assert RULES.page_size(q(mla, block_size=32, options={"attention_backend": "trtllm_mla"})) == 32
    assert RULES.page_size(q(g, capability=(10, 0), options={"attention_backend": "fa4"})) == 128
    assert RULES.page_size(q(g, device="cpu", capability=(10, 0))) == 1


def test_kv_dtypes_and_what_auto_is():
    g = geom("llama-3.1-8b")
    assert RULES.answer(q(g, 100, dtype="fp8")).dtype == "fp8_e4m3"
    assert RULES.answer(q(g, 100, dtype="fp8_e5m2")).bytes_per_gpu == 100 * 65_536
    with pytest.raises(KVRuleError, match="sglang has no KV dtype 'q8_0'"):
        RULES.answer(q(g, 100, dtype="q8_0"))
    assert RULES.resolve_dtype(q(g, dtype="auto")) == "bf16"  # the config's bfloat16
    # a float32 config (or one naming none) is served in float16, Gemma's in bfloat16 (_get_and_verify_dtype)
    assert RULES.serving_dtype(replace(g, dtype="fp32")) == "fp16"
    assert RULES.serving_dtype(replace(g, dtype=None)) == "fp16"
    assert RULES.serving_dtype(replace(geom("gemma-3-1b"), dtype="fp32")) == "bf16"
    assert RULES.serving_dtype(geom("gpt-oss-20b")) == "bf16"  # MXFP4 checkpoint: --dtype bfloat16 override
    # a ModelOpt checkpoint with kv_cache_quant_algo FP8: auto is fp8_e4m3; compressed-tensors' scheme is not read
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    modelopt = geometry_from_hf_dict({**cfg, "quantization_config": {"quant_method": "modelopt",
                                                                     "kv_cache_quant_algo": "FP8"}})
    assert RULES.resolve_dtype(q(modelopt, dtype="auto")) == "fp8_e4m3"
    ct = geometry_from_hf_dict({**cfg, "quantization_config": {
        "quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}})
    assert RULES.resolve_dtype(q(ct, dtype="auto")) == "bf16"


def test_auto_mem_fraction_static_by_gpu_memory():
    # H100 80GB (81,559 MiB): chunked prefill 8192, decode graphs to 256, 58 prefill graph sizes up to 8192
    assert len(prefill_graph_sizes(8192)) == 8 + 14 + 8 + 8 + 12 + 8 == 58
    reserved = 512 + 8192 * 1.5 + 1 / 8 * 1024 + (256 * 2 + 58 * 8)
    assert reserved == 13_904
    assert auto_mem_fraction_static(81_559) == round((81_559 - 13_904) / 81_559, 3) == 0.83
    # MLA: the prefill graphs' reserve is 1.5 GiB
    assert auto_mem_fraction_static(81_559, mla=True) == round((81_559 - (512 + 12_288 + 128 + 512 + 1536)) / 81_559, 3)
    # a 24 GiB GPU: chunked 4096, decode graphs to 48, 50 prefill sizes up to 4096, no 10 GiB floor
    assert auto_mem_fraction_static(24_576) == round((24_576 - (512 + 6144 + 128 + 96 + 400)) / 24_576, 3) == 0.704
    # the 10 GiB floor on a large GPU when the estimate is smaller: a request cap of 8 shrinks the graphs' reserve
    small = 512 + 8192 * 1.5 + 128 + 8 * 2 + 58 * 8
    floored = round((143_771 - max(small, 10_240)) / 143_771, 3)
    assert auto_mem_fraction_static(143_771, max_running_requests=8) == floored


# --- the planner -------------------------------------------------------------------------------------

def test_plan_with_sglang_rules():
    result = plan(PlanInput(model=resolve_model("llama-3.1-8b"), engine="sglang", gpu="H100-80GB", context=4096,
                            batch=8))
    assert result["engine"] == "sglang" and result["limit_flag"] == "--context-length 131072"
    assert result["kv_bytes_per_gpu"] == 8 * 4096 * 131_072
    assert "sglang" in engines()
    code = runner.invoke(app, ["plan", "gpt-oss-20b", "--engine", "sglang", "--gpu", "H100-80GB",
                               "--engine-option", "swa_full_tokens_ratio=0.5", "--json"])
    assert code.exit_code == 0, code.output
    bad = runner.invoke(app, ["plan", "gpt-oss-20b", "--engine", "sglang", "--engine-option", "window=2"])
    assert bad.exit_code == 2 and "unknown --engine-option 'window' for sglang" in bad.output


def test_capacity_is_sglangs_pool_of_the_budget():
    s = setup(PlanInput(model=resolve_model("gpt-oss-20b"), engine="sglang", gpu="H100-80GB", max_model_len=8192))
    cap = capacity(s)
    assert cap.pool_tokens == RULES.max_total_num_tokens(s.question(context=8192, batch=1), kv_room(s))
    assert cap.sequences == RULES.sequences_in_pool(s.geometry, cap.pool_tokens, 8192, {})


def test_compare_engines_table_sets_every_engine_side_by_side():
    s = setup(PlanInput(model=resolve_model("llama-3.1-8b"), gpu="H100-80GB", max_model_len=8192))
    pools = {p.engine: p for p in engine_pools(s, engines())}
    assert set(pools) == set(engines())
    budget = pools["sglang"].budget
    assert pools["sglang"].tokens == int(budget // 131_072) and pools["sglang"].sized == "from the budget"
    assert pools["sglang"].sequences == int(budget // 131_072) // 8192
    # vLLM: blocks of 16, "KV cache size" = blocks / (8192 / 16 blocks per request) x 8192 tokens, of its own
    # budget (each engine's startup rule gives its own, issue 35)
    assert pools["vllm"].tokens == int(pools["vllm"].budget // (16 * 131_072)) * 16
    assert pools["llamacpp"].sized == "for the limit" and pools["llamacpp"].tokens == pools["llamacpp"].sequences * 8192
    done = runner.invoke(app, ["plan", "gpt-oss-20b", "--gpu", "H100-80GB", "--max-model-len", "8192",
                               "--compare-engines", "--json"])
    assert done.exit_code == 0, done.output
    rows = {r["engine"]: r for r in json.loads(done.output)["engines"]}
    assert set(rows) == set(engines()) and rows["sglang"]["kv_dtype"] == "bf16"
    text = runner.invoke(app, ["plan", "gpt-oss-20b", "--gpu", "H100-80GB", "--max-model-len", "8192",
                               "--compare-engines"])
    assert text.exit_code == 0 and "KV pool per engine" in text.output and "sglang" in text.output
    for args, message in ((["--compare-engines"], "needs a GPU"),
                          (["--compare-engines", "--gpu", "H200", "--engine", "sglang"], "not with --engine")):
        bad = runner.invoke(app, ["plan", "gpt-oss-20b", *args])
        assert bad.exit_code == 2 and message in bad.output


# --- the adapter against the fake ---------------------------------------------------------------------

def attached(tmp_path, fake, **options):
    backend = SGLangBackend("0.5.23", tmp_path, options)
    backend.attach(spec(tmp_path), fake.url, timeout_s=5)
    return backend


def test_stream_sends_token_ids_and_counts_every_token(tmp_path):
    with FakeSGLang(token_delay_s=0.003) as fake:
        backend = attached(tmp_path, fake)
        (r,) = run(backend, [prompt(100, 16)])
    assert r.error is None
    assert (r.prompt_tokens_reported, r.output_tokens_reported) == (100, 16)
    assert r.chunk_tokens == [1] * 16 and len(set(r.chunk_times)) > 1 and r.chunk_times[-1] <= r.t_done
    assert r.engine_details == {"finish_reason": "length", "cached_tokens": 0, "num_retractions": 0}
    assert fake.last_request == {"input_ids": list(range(100, 200)), "stream": True,
                                 "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.0}}
    assert SGLangBackend.accepts_token_ids and SGLangBackend.forces_output_length


def test_several_tokens_per_event_are_counted_from_completion_tokens(tmp_path):
    with FakeSGLang(stream_interval=4, token_delay_s=0.001) as fake:
        (r,) = run(attached(tmp_path, fake), [prompt(20, 10)])
    assert r.error is None and r.chunk_tokens == [4, 4, 2] and r.output_tokens_reported == 10


def test_error_event_in_the_stream_is_the_request_error(tmp_path):
    with FakeSGLang(context_length=4096) as fake:
        (r,) = run(attached(tmp_path, fake), [prompt(4090, 16)])
    assert r.error.startswith("Requested token count exceeds the model's maximum context length of 4096 tokens. "
                              "You requested a total of 4106 tokens: 4090 tokens")
    assert r.chunk_tokens == []


def test_stream_cut_off_is_a_failed_request_and_frees_the_pool(tmp_path):
    with FakeSGLang(cut_after=3) as fake:
        (r,) = run(attached(tmp_path, fake), [prompt(20, 16)])
        assert fake.used == 0
    assert r.error and r.output_tokens_reported is None


def test_kv_pool_in_use_and_queue_against_the_fake(tmp_path):
    with FakeSGLang(pool_tokens=20_000, token_delay_s=0.02, batch_slots=1) as fake:
        backend = attached(tmp_path, fake)
        pool = backend.kv_pool()
        assert pool.tokens == 20_000 and pool.bytes == 20_001 * BYTES_PER_TOKEN  # + the padding page
        assert pool.source.startswith("max_total_num_tokens (/server_info)")
        assert pool.details["page_size"] == 1 and pool.details["mem_fraction_static"] == 0.83
        with Poller(backend.poll) as polls:
            results = run(backend, [prompt(100, 20, "a"), prompt(200, 20, "b")], concurrency=2)
        assert all(r.error is None for r in results)
        after = backend.poll(backend.http_client(2.0))
    kv, queue = [p.kv for p in polls.samples], [p.queue for p in polls.samples]
    peak = max(kv, key=lambda s: s.tokens)
    # one request at a time (batch_slots=1): the larger holds 200 + 20 tokens at its end; a token every 20 ms,
    # a poll every 10 ms, which on a loaded machine can miss the last few tokens (217 seen once)
    assert fake.peak_used == 220 and 200 < peak.tokens <= 220 and peak.bytes == peak.tokens * BYTES_PER_TOKEN
    assert peak.source == "sglang:kv_used_tokens x bytes/token"
    assert kv[0].tokens == 0 and max(q["waiting"] for q in queue) == 1
    assert queue[0]["preemptions"] == 0 and queue[0]["running"] == 0
    # finished requests stay in the radix cache: evictable, not in use
    assert after.kv.tokens == 0 and fake.evictable == (100 + 20) + (200 + 20)


def test_hybrid_kv_in_use_counts_both_pools(tmp_path):
    g = geom("gpt-oss-20b")
    backend = SGLangBackend("0.5.23", tmp_path, {})
    s = spec(tmp_path)
    backend.spec = replace(s, model=ModelFiles("gpt-oss-20b", s.model.hf_dir, None, "ab" * 32, g))
    got = backend.kv_from_samples({"sglang:kv_used_tokens": [({}, 1000.0)], "sglang:swa_used_tokens": [({}, 257.0)]})
    assert got.tokens == 1000 and got.bytes == 1000 * 24_576 + 257 * 24_576
    assert "swa_used_tokens" in got.source
    rounded = backend.kv_from_samples({"sglang:token_usage": [({}, 0.25)], "sglang:max_total_num_tokens": [({}, 8000)]})
    assert rounded.tokens == 2000 and "rounded to 0.01" in rounded.source
    assert backend.kv_from_samples({}) is None


def test_kv_pool_from_older_routes_and_from_the_log(tmp_path):
    log = tmp_path / "sglang.log"
    log.write_text("[2026-12-01 10:00:05 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 19200, "
                   "K size: 0.21 GB, V size: 0.21 GB\n"
                   "[2026-12-01 10:00:05 TP0] Memory pool end. avail mem=68.70 GB\n"
                   "[2026-12-01 10:00:06 TP0] max_total_num_tokens=19200, chunked_prefill_size=2048, "
                   "max_prefill_tokens=16384, max_running_requests=4, context_len=4096, available_gpu_mem=68.70 GB\n")
    parsed = parse_sglang_log(log.read_text())
    assert parsed["allocated"] == [{"dtype": "torch.bfloat16", "tokens": 19200, "k_gib": 0.21,
                                    "v_gib": 0.21}]
    assert (parsed["max_total_num_tokens"], parsed["max_running_requests"], parsed["context_len"]) == (19200, 4, 4096)
    mla = parse_sglang_log("[x TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 500, KV size: 0.03 GB\n"
                           "Use sliding window memory pool. full_layer_tokens=500, swa_layer_tokens=400\n")
    assert mla["allocated"][0]["kv_gib"] == 0.03 and mla["swa_layer_tokens"] == 400
    with FakeSGLang(pool_tokens=30_000) as fake:
        fake.new_info_routes = False  # before /server_info: only /get_server_info
        backend = attached(tmp_path, fake)
        assert backend.kv_pool().tokens == 30_000 and backend.reported_version() == "0.5.23"
        backend.stop()
    backend = SGLangBackend("0.5.23", tmp_path, {})
    backend.spec, backend.base_url = spec(tmp_path), "http://127.0.0.1:9"  # nothing answers there
    backend.server = type("Log", (), {"log_path": log})()
    pool = backend.kv_pool()
    assert pool.tokens == 19200 and pool.source.startswith("scheduler log") and pool.details["log"] == parsed
    backend.server = None


def env_with_stand_in(tmp_path):
    """An SGLang environment whose python is the fake's stand-in (it takes `-m sglang.launch_server ...`)."""
    env = tmp_path / "env"
    stand_in(env / "bin", "python", "tests.fakes.sglang_server")
    return env


def test_start_stream_kv_stop_from_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_TOKEN_DELAY_S", "0.001")
    backend = SGLangBackend("0.5.23", env_with_stand_in(tmp_path), {})
    s = spec(tmp_path, max_context=2048, max_concurrency=3)
    backend.start(s, tmp_path / "logs" / "sglang.log", timeout_s=30)
    pid = backend.pid
    try:
        assert listening(pid) == [("127.0.0.1", backend.spec.port)]
        log = (tmp_path / "logs" / "sglang.log").read_text()
        assert (f"-m sglang.launch_server --model-path {s.model.hf_dir} --served-model-name smollm2 --host 127.0.0.1 "
                f"--port {backend.spec.port} --context-length 2048 --enable-metrics --log-level info "
                "--max-total-tokens 6144 --max-running-requests 3") in log
        assert "The server is fired up and ready to roll!" in log
        assert backend.reported_version() == "0.5.23"
        (r,) = run(backend, [prompt(64, 8)])
        assert r.error is None and (r.prompt_tokens_reported, r.output_tokens_reported) == (64, 8)
        pool = backend.kv_pool()
        assert pool.tokens == 3 * 2048 and pool.bytes == (6144 + 1) * BYTES_PER_TOKEN
        assert pool.details["log"]["allocated"][0]["tokens"] == 6144
    finally:
        backend.stop()
    assert not psutil.pid_exists(pid)


def test_command_modes_dtypes_and_options(tmp_path):
    s = replace(spec(tmp_path, max_context=1000, max_concurrency=2, kv_dtype="fp8"), port=18000)
    argv, env = SGLangBackend("0.5.23", tmp_path, {"page_size": 64}).command(s)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and env == {"HF_HUB_OFFLINE": "1"}
    assert argv[argv.index("--max-total-tokens") + 1] == str(2 * 1024)  # whole pages of 64
    assert argv[argv.index("--page-size") + 1] == "64" and argv[0] == str(tmp_path / "bin" / "python")
    deployed = SGLangBackend("0.5.23", tmp_path, {"engine_mode": "deployed", "mem_fraction_static": 0.9, "tp": 2,
                                                  "attention_backend": "fa3", "swa_full_tokens_ratio": 0.5,
                                                  "python": "/opt/sgl/bin/python", "extra_args": "--stream-interval 4"})
    argv, _ = deployed.command(replace(s, kv_dtype="bf16", prefix_caching=False))
    assert "--max-total-tokens" not in argv and "--max-running-requests" not in argv
    assert argv[0] == "/opt/sgl/bin/python" and argv[argv.index("--dtype") + 1] == "bfloat16"
    for flag, value in (("--mem-fraction-static", "0.9"), ("--tp-size", "2"), ("--attention-backend", "fa3"),
                        ("--swa-full-tokens-ratio", "0.5"), ("--stream-interval", "4")):
        assert argv[argv.index(flag) + 1] == value
    assert "--disable-radix-cache" in argv and SGLangBackend.gpus_used({"tp": 2}) == 2
    _, env = SGLangBackend("0.5.23", tmp_path, {"device": "cpu"}).command(s)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    with pytest.raises(ValueError, match="SGLang has no KV dtype 'q4_0'"):
        SGLangBackend("0.5.23", tmp_path, {}).command(replace(s, kv_dtype="q4_0"))


def test_without_a_gpu_the_install_says_why_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    monkeypatch.setattr(sglang_adapter, "has_nvidia_gpu", lambda: False)
    with pytest.raises(EnvInstallError) as failed:
        ensure_env(SGLangBackend.recipe("0.5.23"))
    assert "SGLang publishes no CPU build on the package registries" in failed.value.log_tail
    monkeypatch.setattr(sglang_adapter, "has_nvidia_gpu", lambda: True)
    steps = SGLangBackend.recipe("0.5.23").steps
    assert "sglang==0.5.23" in steps[0].argv and "torch.cuda.is_available()" in steps[1].argv[-1]


def test_backends_lists_sglang_and_its_options():
    listed = json.loads(runner.invoke(app, ["backends", "--json"]).output)
    options = listed["engines"]["sglang"]["options"]
    assert {o.name for o in SGLangBackend.option_specs} == set(options)
    assert options["engine_mode"]["type"] == "sized|deployed" and options["mem_fraction_static"]["type"] == "float"


# --- a whole run: two fake replicas as one deployment, telemetry names ---------------------------------

def test_a_deployment_of_two_replicas_runs_unchanged(tmp_path, smollm2):
    workload = Workload(name="sgl", seed=3, prompt_tokens=[48], output_tokens=16, concurrency=[2], rounds=2,
                        warmup_requests=0)
    with FakeSGLang(served_model_name="smollm2", pool_tokens=5000, token_delay_s=0.01) as a, \
            FakeSGLang(served_model_name="smollm2", pool_tokens=7000, token_delay_s=0.01) as b:
        opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse(
            f"sglang:url={a.url},url={b.url}")], results_dir=tmp_path, run_id="sgl")
        run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    cells = load_cells(run_dir)
    total = cells[cells.replica.fillna("") == ""].iloc[0]
    assert total.status == "ok" and total.engine == "sglang"
    assert total.kv_pool_tokens_engine == 5000 + 7000
    replicas = cells[cells.replica.fillna("") != ""]
    assert sorted(replicas.kv_pool_tokens_engine) == [5000, 7000]
    assert (replicas.kv_pool_sequences_predicted == [p // 64 for p in replicas.kv_pool_tokens_engine]).all()


def test_an_attached_run_records_the_cached_tokens_and_flushes_between_cells(tmp_path):
    """SGLang's prefix cache through the hooks every engine has: its requests' meta_info.cached_tokens is the
    row's hit rate, and --reset-cache-between-cells flushes it before every cell."""
    workload = Workload(name="sgl", seed=3, prompt_tokens=[48, 64], output_tokens=8, concurrency=[2],
                        warmup_requests=0)
    with FakeSGLang(served_model_name="smollm2", token_delay_s=0.005) as fake:
        opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse(f"sglang:url={fake.url}")],
                          results_dir=tmp_path, run_id="sgl", reset_cache_between_cells=True, estimate=False)
        cells = load_cells(Runner(opts, Console(file=io.StringIO(), width=200)).run())
        assert fake.flushes == 2
    assert (cells.status == "ok").all() and (cells.prefix_cache_hit_rate == 0).all()
    assert (cells.prefix_cache_expected == "cold").all()
    assert cells.prefix_cache_source.str.startswith("cached prompt tokens per request (2 of 2").all()


def test_the_prometheus_names_are_on_the_fakes_metrics_page():
    from prometheus_client.parser import text_string_to_metric_families

    with FakeSGLang() as fake:
        page = fake.metrics().decode()
    samples = {s.name for f in text_string_to_metric_families(page) for s in f.samples}
    assert set(SGLangBackend.capabilities.telemetry.prometheus_metrics) <= samples
    assert set(SGLangBackend.POLLED) - {"sglang:swa_used_tokens"} <= samples


def test_a_real_prometheus_reads_sglangs_metrics_into_the_row(tmp_path, smollm2):
    """`kvbench run --prometheus` unchanged: a real Prometheus scraping the fake every second; the row's
    engine figures come from the adapter's Telemetry ``prometheus_metrics`` (token_usage, running, queue,
    retractions)."""
    from tests.run.test_telemetry import RealPrometheus, run_kvbench

    wl = Workload(name="prom", seed=3, prompt_tokens=[32], output_tokens=150, concurrency=[2], rounds=2,
                  warmup_requests=0)
    with FakeSGLang(served_model_name="smollm2", pool_tokens=1000, token_delay_s=0.01) as fake:  # 1.5 s a request
        prom = RealPrometheus(tmp_path, {"sglang": f"127.0.0.1:{fake.port}"})
        try:
            prom.wait_scraped()
            _, cells = run_kvbench(tmp_path, wl, f"sglang:url={fake.url}", prom.url, '{job="sglang"}')
        finally:
            prom.stop()
    (row,) = cells.itertuples()
    assert row.status == "ok" and row.n_requests == 4, row.error
    # two requests of at most 32 + 150 tokens in a pool of 1,000: token_usage (rounded to 0.01) up to 0.36
    assert 0 < row.prom_kv_usage_peak <= 0.37 and row.prom_requests_running_peak == 2
    (engine,) = row.prom_engines
    assert engine["instance"] == f"127.0.0.1:{fake.port}" and row.prom_preemptions == 0
    assert row.kv_pool_tokens_engine == 1000 and row.kv_in_use_peak_tokens <= 2 * 182


def test_an_attached_sglang_serving_another_model_fails_its_cells_unless_allowed(tmp_path):
    workload = Workload(name="sgl", seed=3, prompt_tokens=[48], output_tokens=8, concurrency=[1], warmup_requests=0)
    with FakeSGLang(served_model_name="meta-llama/Llama-3.1-8B-Instruct", token_delay_s=0.005) as fake:
        for allow, run_id in ((False, "refused"), (True, "allowed")):
            opts = RunOptions(model="smollm2", workload=workload,
                              backends=[BackendConfig.parse(f"sglang:url={fake.url}")], results_dir=tmp_path,
                              run_id=run_id, estimate=False, allow_model_mismatch=allow)
            run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
            cells = load_cells(run_dir)
            served = json.loads((run_dir / "run.json").read_text())["served_models"]
            assert list(served.values()) == [["meta-llama/Llama-3.1-8B-Instruct"]]
            if allow:
                assert (cells.status == "ok").all()
            else:
                assert (cells.status == "failed").all()
                assert "serves meta-llama/Llama-3.1-8B-Instruct, not --model smollm2" in cells.error.iloc[0]


def test_a_deployment_whose_replicas_serve_different_models_fails_before_any_cell(tmp_path):
    workload = Workload(name="sgl", seed=3, prompt_tokens=[48], output_tokens=8, concurrency=[1], warmup_requests=0)
    with FakeSGLang(served_model_name="smollm2") as a, FakeSGLang(served_model_name="other-model") as b:
        opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse(
            f"sglang:url={a.url},url={b.url}")], results_dir=tmp_path, run_id="mixed", estimate=False)
        cells = load_cells(Runner(opts, Console(file=io.StringIO(), width=200)).run())
        assert a.running == b.running == 0
    total = cells[cells.replica.fillna("") == ""]
    assert (total.status == "failed").all() and "the replicas do not serve the same model" in total.error.iloc[0]
