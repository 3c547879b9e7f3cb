"""KV quantisation on real llama.cpp (the embedded model): one engine start per KV dtype (f16, q8_0, q4_0) on the
same short prompts. Each pool's bytes equal llama.cpp's KV rules for its dtype (no silent fallback), the
records hold the engine's own top-k log-probabilities, the divergence figures are computed from them, and
a planted bad cache (the baseline's records compared with themselves) gives exactly zero. vLLM's fp8 KV on
a CPU beside its bf16 one where the CPU has AVX-512 or AMX, and refused (its rules and the engine alike) where it has
neither. transformers' QuantizedCache (optimum-quanto int4 and int2, one
worker start each, beside its bf16 DynamicCache): the bytes the cache object held after each generate equal
its KV rules to the byte, and the divergence comes from the worker's own top-20 log-probabilities. The math:
tests/run/test_kvquant.py."""
import io
import json

import pytest
from rich.console import Console

from kvbench.backends import kv_rules
from kvbench.backends.types import EngineStartError, ServerSpec
from kvbench.common.hardware import cpu_flags
from kvbench.common.divergence import compare_requests
from kvbench.kv.rules import KVQuestion
from kvbench.reports import kvquant
from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells, load_logprobs, load_run_info
from kvbench.workloads import Workload

from tests.helpers import engine_env

pytestmark = pytest.mark.engine

WORKLOAD = Workload(name="kv_quant_test", family="kv_quant", seed=11, prompt_tokens=[64], output_tokens=6,
                    concurrency=[1], requests=2, warmup_requests=0, kv_dtypes=["baseline", "q8_0", "q4_0"])


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2):
    engine_env("llamacpp")
    root = tmp_path_factory.mktemp("kvq")
    opts = RunOptions(model="smollm2", workload=WORKLOAD, backends=[BackendConfig.parse("llamacpp")], results_dir=root,
                      run_id="kvq", start_timeout_s=120, request_timeout_s=120, estimate=False)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir), smollm2


def test_one_start_per_dtype_and_the_pools_equal_the_rules(run):
    run_dir, cells, model = run
    assert load_run_info(run_dir)["kv_quant"]["llamacpp-0.3.36"]["dtypes"] == ["f16", "q8_0", "q4_0"]
    assert sorted(cells.kv_dtype) == ["f16", "q4_0", "q8_0"] and set(cells.status) == {"ok"}, cells.error.tolist()
    rules = kv_rules("llamacpp")
    for _, c in cells.iterrows():
        q = KVQuestion(model.geometry, c.kv_dtype, int(c.prompt_tokens) + WORKLOAD.output_tokens, 1)
        # the log gives MiB to 2 decimals: exact to 0.005 MiB
        assert abs(c.kv_pool_bytes_engine - rules.answer(q).bytes_per_gpu) <= 0.005 * 2**20 + 1, c.kv_dtype
        assert not [f for f in c["flags"] if "declined" in f]
    # q8_0 is 34/32 bytes a value, q4_0 18/32: the pools are in that ratio to f16's 2 bytes
    pools = dict(zip(cells.kv_dtype, cells.kv_pool_bytes_engine))
    assert pools["q8_0"] / pools["f16"] == pytest.approx(17 / 32, abs=1e-3)
    assert pools["q4_0"] / pools["f16"] == pytest.approx(9 / 32, abs=1e-3)
    assert (run_dir / "logs" / "llamacpp-0.3.36_kv-q8_0.log").exists()  # each start's own log


def test_records_hold_the_engines_own_topk_logprobs(run):
    run_dir, cells, _ = run
    records = load_logprobs(run_dir)
    assert len(records) == 3
    for cell_id, requests in records.items():
        assert len(requests) == 2
        for r in requests.values():
            assert len(r["tokens"]) == len(r["top"]) == WORKLOAD.output_tokens and r["k"] == 20
            for token, top in zip(r["tokens"], r["top"]):
                assert len(top) == 20 and all(lp <= 0 for lp in top.values())
                assert token == max(top, key=top.get)  # greedy: the token is the top of its own distribution
    raw = json.loads((run_dir / "logprobs" / "llamacpp-0.3.36_kv-f16_p64_c1_r0.json").read_text())
    assert raw["requests"][0]["request_id"] == "p64-c1-r0-0"


def test_divergence_is_computed_from_them_and_a_planted_bad_cache_gives_zero(run):
    run_dir, cells, _ = run
    records = load_logprobs(run_dir)
    base = records["llamacpp-0.3.36_kv-f16_p64_c1_r0"]
    self_cmp = compare_requests(base, {k: dict(v) for k, v in base.items()})
    assert (self_cmp.kl_mean, self_cmp.kl_max, self_cmp.identical_share) == (0.0, 0.0, 1.0)
    q4 = compare_requests(base, records["llamacpp-0.3.36_kv-q4_0_p64_c1_r0"])
    assert q4.kl_mean is not None and q4.kl_mean > 0 and q4.top_k == 20  # the cache changed the distributions
    data = {r["kv_dtype"]: r for r in kvquant.rows(run_dir, cells, {"llamacpp-0.3.36": "f16"})}
    assert data["q4_0"]["divergence"] == q4
    assert data["q8_0"]["saved"] == pytest.approx(1 - 17 / 32, abs=1e-3)


# --- vLLM: fp8 KV on a CPU, natural text, the prompt's own log-probabilities ----------------------------------
# vLLM's CPU attention takes an fp8 cache only with AVX-512 or AMX (cpu_attn.py _get_attn_isa): elsewhere its
# rules refuse it, the run gives the fp8 cells "not run" with the reason, and the engine is checked to refuse it
FP8_KV_HERE = bool({"avx512f", "amx_tile"} & set(cpu_flags()))
VLLM_WORKLOAD = Workload(name="kv_quant_vllm_test", family="kv_quant", seed=11, prompt_tokens=[96], output_tokens=6,
                         concurrency=[1], requests=2, warmup_requests=0, kv_dtypes=["baseline", "fp8_e4m3"],
                         prompt_text="kjv")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, smollm2):
    engine_env("vllm")
    root = tmp_path_factory.mktemp("kvq-vllm")
    opts = RunOptions(model="smollm2", workload=VLLM_WORKLOAD, backends=[BackendConfig.parse("vllm:single_process=true")],
                      results_dir=root, run_id="kvq", start_timeout_s=600, request_timeout_s=300, estimate=False)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir)


def test_vllm_fp8_halves_the_bytes_or_is_not_run_where_the_cpu_lacks_it(vllm_run):
    run_dir, cells = vllm_run
    by = {c.kv_dtype: c for _, c in cells.iterrows()}
    assert sorted(by) == ["bf16", "fp8_e4m3"] and by["bf16"].status == "ok", cells.error.tolist()
    if not FP8_KV_HERE:
        fp8 = by["fp8_e4m3"]
        assert fp8.status == "not run" and "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in fp8.error
        assert not (run_dir / "logs" / "vllm-0.32.0_kv-fp8_e4m3.log").exists()  # no start spent on it
        return
    assert set(cells.status) == {"ok"}, cells.error.tolist()
    for _, c in cells.iterrows():  # the pool the rules predict from the engine's own blocks, to the byte
        assert c.kv_pool_bytes_predicted == pytest.approx(c.kv_pool_bytes_engine, rel=1e-3), c.kv_dtype
    per_token = {c.kv_dtype: c.kv_pool_bytes_engine / c.kv_pool_tokens_engine for _, c in cells.iterrows()}
    assert per_token["fp8_e4m3"] / per_token["bf16"] == pytest.approx(0.5, rel=0.01)
    data = {r["kv_dtype"]: r for r in kvquant.rows(run_dir, cells, {"vllm-0.32.0": "bf16"})}
    d = data["fp8_e4m3"]["divergence"]
    assert d.ppl_baseline is not None and d.ppl_other is not None and d.kl_mean is not None


def test_vllm_perplexity_comes_from_prompt_logprobs(vllm_run):
    run_dir, cells = vllm_run
    base = load_logprobs(run_dir)["vllm-0.32.0_kv-bf16_p96_c1_r0"]
    for r in base.values():
        assert len(r["tokens"]) == len(r["top"]) == 6 and r["k"] == 20
        assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == 96
    assert compare_requests(base, base).kl_mean == 0.0
    data = {r["kv_dtype"]: r for r in kvquant.rows(run_dir, cells, {"vllm-0.32.0": "bf16"})}
    assert data["bf16"]["divergence"].ppl_baseline is not None
    assert data["fp8_e4m3"]["status"] == ("ok" if FP8_KV_HERE else "not run")


def test_vllm_itself_refuses_an_fp8_cache_exactly_where_its_rules_do(smollm2, tmp_path):
    """The rule checked against the engine: where the rules refuse, vLLM started anyway (its rules bypassed)
    fails its core with the same words (about 20 s: before it loads the weights). Where they do not, the run
    above started it with an fp8 cache."""
    from kvbench.backends.vllm.adapter import VLLMBackend

    spec = ServerSpec(model=smollm2, max_context=128, max_concurrency=1, kv_dtype="fp8_e4m3")
    refusal = VLLMBackend(VLLMBackend.default_version, None, {}).start_refusal(spec)
    if FP8_KV_HERE:
        assert refusal is None
        return
    assert "requires x86 with AVX-512 or AMX" in refusal
    with pytest.raises(EngineStartError) as failed:
        VLLMBackend.pool_at_start(engine_env("vllm"), spec, tmp_path / "fp8.log", 300,
                           {"kv_cache_memory_bytes": 2**22, "single_process": True})
    assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." in (tmp_path / "fp8.log").read_text()


# --- transformers: its QuantizedCache over optimum-quanto (int4, int2), top-k from the worker's raw logits -----
HF_WORKLOAD = Workload(name="kv_quant_hf_test", family="kv_quant", seed=11, prompt_tokens=[64], output_tokens=6,
                       concurrency=[1], requests=2, warmup_requests=0,
                       kv_dtypes=["baseline", "quanto-int4", "quanto-int2"])


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, smollm2):
    engine_env("hf")
    root = tmp_path_factory.mktemp("kvq-hf")
    opts = RunOptions(model="smollm2", workload=HF_WORKLOAD, backends=[BackendConfig.parse("hf:threads=2")],
                      results_dir=root, run_id="kvq", start_timeout_s=300, request_timeout_s=300, estimate=False)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir), smollm2


def test_hf_quantised_cache_bytes_equal_the_rules(hf_run):
    run_dir, cells, model = hf_run
    assert load_run_info(run_dir)["kv_quant"]["hf-5.24.0"]["dtypes"] == ["bf16", "quanto-int4", "quanto-int2"]
    assert sorted(cells.kv_dtype) == ["bf16", "quanto-int2", "quanto-int4"] and set(cells.status) == {"ok"}, \
        cells.error.tolist()
    rules = kv_rules("hf")
    cached = 64 + HF_WORKLOAD.output_tokens - 1
    measured = {}
    for _, c in cells.iterrows():  # the bytes the cache object held (codes, scales, shifts, residual), to the byte
        q = KVQuestion(model.geometry, c.kv_dtype, cached, 1, options={"decoded_tokens": HF_WORKLOAD.output_tokens - 1})
        assert c.kv_in_use_peak_bytes == rules.answer(q).bytes_per_gpu == c.kv_peak_bytes_per_gpu_predicted, c.kv_dtype
        assert c.kv_in_use_peak_tokens == cached
        measured[c.kv_dtype] = c.kv_in_use_peak_bytes
    assert measured["quanto-int2"] < measured["quanto-int4"] < measured["bf16"] / 2
    data = {r["kv_dtype"]: r for r in kvquant.rows(run_dir, cells, {"hf-5.24.0": "bf16"})}
    assert data["bf16"]["bytes_per_token"] == 23040  # the formula's bytes per token: 2 x 30 x 3 x 64 x 2
    assert data["quanto-int4"]["saved"] == pytest.approx(1 - measured["quanto-int4"] / measured["bf16"])
    assert data["quanto-int4"]["bytes_per_token_predicted"] == data["quanto-int4"]["bytes_per_token"]


def test_hf_divergence_from_its_own_logprobs(hf_run):
    run_dir, cells, _ = hf_run
    records = load_logprobs(run_dir)
    base = records["hf-5.24.0_kv-bf16_p64_c1_r0"]
    for r in base.values():
        assert len(r["tokens"]) == len(r["top"]) == HF_WORKLOAD.output_tokens and r["k"] == 20
        for top in r["top"]:
            assert len(top) == 20 and all(lp <= 0 for lp in top.values())
    self_cmp = compare_requests(base, {k: dict(v) for k, v in base.items()})  # a planted copy: exactly zero
    assert (self_cmp.kl_mean, self_cmp.kl_max, self_cmp.identical_share) == (0.0, 0.0, 1.0)
    int2 = compare_requests(base, records["hf-5.24.0_kv-quanto-int2_p64_c1_r0"])
    assert int2.top_k == 20 and int2.kl_mean is not None and int2.kl_max > 0  # the cache moved the distributions
    # the first token comes from the prefill, which attends to the unquantised states: the same distribution
    for key, r in base.items():
        assert records["hf-5.24.0_kv-quanto-int2_p64_c1_r0"][key]["top"][0] == r["top"][0]
    data = {r["kv_dtype"]: r for r in kvquant.rows(run_dir, cells, {"hf-5.24.0": "bf16"})}
    assert data["quanto-int2"]["divergence"] == int2


# --- the GPU check's KV-quantisation step (f), dry-run on the CPU: the real probe, the embedded model's config ---
def test_gpu_check_kv_quant_step_runs_on_the_cpu(tmp_path, smollm2):
    from kvbench.common.envs import env_python
    from kvbench.selfcheck import gpu_check as gc

    python = str(env_python(engine_env("hf")))
    budget = gc.Budget(300)
    rows = gc.check_kv_quant(python, smollm2.hf_dir / "config.json", "smollm2-random", budget, tmp_path,
                             device="cpu", prompt=64, new=4, requests=1, limit_s=240)
    by = {r["kv_dtype"]: r for r in rows}
    assert sorted(by) == ["bf16", "quanto-int2", "quanto-int4"], rows
    for r in rows:  # the bytes the cache object held equal the hf rules, on every request
        assert r["cache_ok"] is True and r["cache_bytes"] == r["predicted_bytes"], r
    assert by["bf16"]["cache_bytes"] == 23040 * 67
    assert by["bf16"]["kl_mean"] == 0.0 and by["bf16"]["identical_share"] == 1.0  # the baseline against itself
    assert by["quanto-int2"]["top_k"] == 20 and by["quanto-int2"]["saved"] > by["quanto-int4"]["saved"] > 0.5
    result = {"kv_quant": rows}
    assert not [p for p in gc.verdict(result)[1] if p.startswith("(f)")]
    assert "## (f) KV quantisation" in gc.render_markdown(result)
