"""KV quantisation without an engine: the divergence math on hand-made distributions (the exact-zero
self-comparison among them), the dtypes a kv_quant run sweeps per engine, its cells and prompts, the
silent-fallback flag, the engines' logprob parsers on scripted events, the report on a hand-made run and
`kvbench run --kv-dtypes` refusals. The real engine: tests/run/test_kvquant_engines.py."""
import json
import math

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.backends import kv_rules
from kvbench.backends.llamacpp.adapter import CompletionEvents, LlamaCppBackend
from kvbench.backends.types import KVPool, RequestResult
from kvbench.backends.vllm.adapter import read_logprobs
from kvbench.cli import app
from kvbench.common import divergence as dv
from kvbench.kv.geometry import KVGeometry, LayerKV
from kvbench.kv.rules import KVRuleError
from kvbench.load import LoadPoint
from kvbench.run.cells import cells_for
from kvbench.run.kvquant import KVDtypeError, declined_dtype, kv_quant_dtypes, logprob_records
from kvbench.store.schema import CellRow
from kvbench.workloads import Workload, load
from kvbench.workloads.texts import paragraphs

from tests.helpers import DATA

L = math.log


def top(**probs):
    """{id: log p} from id=prob keyword pairs written t<id>."""
    return {int(k[1:]): L(v) for k, v in probs.items()}


# --- the math -------------------------------------------------------------------------------------
def test_kl_of_a_distribution_with_itself_is_exactly_zero():
    p = top(t1=0.5, t2=0.3, t3=0.1)
    assert dv.topk_kl(p, dict(p)) == 0.0
    seq = [p, top(t4=0.9, t5=0.05)]
    m = dv.greedy_match([1, 4], [1, 4])
    assert dv.sequence_kl(seq, seq, m) == [0.0, 0.0]
    one = {"a": {"tokens": [1, 4], "top": seq, "k": 3}}
    d = dv.compare_requests(one, {"a": dict(one["a"])})
    assert (d.kl_mean, d.kl_max, d.identical_share, d.first_difference_min) == (0.0, 0.0, 1.0, None)


def test_kl_with_full_support_is_the_exact_kl():
    # both lists hold the whole distribution: no rest bucket, the textbook KL
    p, q = top(t1=0.5, t2=0.5), top(t1=0.9, t2=0.1)
    assert dv.topk_kl(p, q) == pytest.approx(0.5 * L(0.5 / 0.9) + 0.5 * L(0.5 / 0.1))


def test_kl_pools_ids_outside_both_lists_into_one_bucket():
    # baseline top-2 {1: .6, 2: .3} (rest .1); quantised top-2 {1: .5, 3: .3} (id 2 not in its list)
    p, q = top(t1=0.6, t2=0.3), top(t1=0.5, t3=0.3)
    # shared {1}; rest: p 0.4, q 0.5
    expected = 0.6 * L(0.6 / 0.5) + 0.4 * L(0.4 / 0.5)
    assert dv.topk_kl(p, q) == pytest.approx(expected)
    # a lower bound on the full KL of any completion, e.g. p = (.6, .3, .05, .05), q = (.5, .1, .3, .1)
    full = 0.6 * L(.6 / .5) + 0.3 * L(.3 / .1) + 0.05 * L(.05 / .3) + 0.05 * L(.05 / .1)
    assert dv.topk_kl(p, q) <= full


def test_greedy_match_first_difference_and_comparable_positions():
    m = dv.greedy_match([5, 6, 7, 8], [5, 6, 9, 8])
    assert (m.identical, m.first_difference, m.compared, m.matched_share) == (False, 2, 4, 0.5)
    assert dv.comparable_positions(m) == 3  # positions 0, 1 and the first differing one share their context
    assert dv.greedy_match([1, 2], [1, 2, 3]).first_difference == 2  # a length difference is a difference
    assert dv.greedy_match([], []).matched_share == 1.0
    # KL only over the comparable positions: the 4th position's distributions condition on different tokens
    a = [top(t5=.9, t1=.1), top(t6=.9, t1=.1), top(t7=.6, t9=.4), top(t8=1.0)]
    b = [top(t5=.9, t1=.1), top(t6=.8, t1=.2), top(t9=.6, t7=.4), top(t3=1.0)]
    kls = dv.sequence_kl(a, b, m)
    assert len(kls) == 3 and kls[0] == 0.0 and kls[1] > 0 and kls[2] > 0


def test_perplexity_leaves_out_unknown_entries():
    assert dv.perplexity([None, L(0.5), L(0.5)]) == pytest.approx(2.0)
    assert dv.perplexity([None]) is None


def test_compare_requests_pools_requests():
    base = {"r0": {"tokens": [1, 2], "top": [top(t1=1.0), top(t2=1.0)], "k": 1, "prompt_logprobs": [None, L(.25)]},
            "r1": {"tokens": [3, 4], "top": [top(t3=1.0), top(t4=1.0)], "k": 1, "prompt_logprobs": [None, L(.25)]}}
    other = {"r0": {"tokens": [1, 2], "top": [top(t1=1.0), top(t2=1.0)], "k": 1, "prompt_logprobs": [None, L(.25)]},
             "r1": {"tokens": [3, 5], "top": [top(t3=1.0), top(t5=1.0)], "k": 1, "prompt_logprobs": [None, L(.5)]}}
    d = dv.compare_requests(base, other)
    assert (d.requests, d.identical_share, d.first_difference_min, d.matched_share_mean) == (2, 0.5, 1, 0.75)
    assert d.kl_positions == 4 and d.top_k == 1  # r0: 2 positions, r1: 2 (up to and including the difference)
    assert d.ppl_baseline == pytest.approx(4.0) and d.ppl_other == pytest.approx(math.sqrt(8))
    assert dv.compare_requests(base, {"x": base["r0"]}) is None


# --- what a run sweeps ------------------------------------------------------------------------------
GEOM = KVGeometry(layers=(LayerKV("full", 3, 64, 64),) * 30, dtype="bf16", model_type="llama", source="gguf")


def test_each_engine_offers_its_own_quantised_dtypes_baseline_first():
    w = load("kv_quant_smoke")
    assert kv_quant_dtypes(w, kv_rules("llamacpp"), GEOM) == ["f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
    assert kv_quant_dtypes(w, kv_rules("vllm"), GEOM) == ["bf16", "fp8", "fp8_e4m3", "fp8_e5m2"]
    assert kv_quant_dtypes(w, kv_rules("ollama"), GEOM) == ["f16", "q8_0", "q4_0"]  # from its rules only
    assert kv_quant_dtypes(w, kv_rules("hf"), GEOM) == ["bf16", "quanto-int4", "quanto-int2"]  # QuantizedCache
    assert kv_quant_dtypes(w, kv_rules("hf"), GEOM, ["auto", "quanto-int2"]) == ["bf16", "quanto-int2"]
    assert kv_quant_dtypes(w, kv_rules("llamacpp"), GEOM, ["q4_0", "q8_0", "q4_0"]) == ["f16", "q4_0", "q8_0"]
    with pytest.raises(KVDtypeError, match="llamacpp has no KV dtype 'fp8'"):
        kv_quant_dtypes(w, kv_rules("llamacpp"), GEOM, ["fp8"])
    assert kv_quant_dtypes(load("smoke"), kv_rules("llamacpp"), GEOM) == [None]  # not a kv_quant workload


def test_kv_quant_cells_differ_by_dtype_and_send_the_same_prompts(smollm2):
    from kvbench.run.cells import CellPrompts
    from kvbench.workloads.prompts import PromptBuilder

    w = load("kv_quant_smoke")
    a, b = (cells_for(w, [64], [LoadPoint("concurrent", 1)], 0, None, d)[0] for d in ("f16", "q8_0"))
    assert a.cell_id("llamacpp-0.3.36") == "llamacpp-0.3.36_kv-f16_p64_c1_r0" and b.variant == "kv_dtype=q8_0"
    builder = PromptBuilder(smollm2.hf_dir / "tokenizer.json")
    natural = builder.from_text("In the beginning God created the heaven and the earth. " * 20, 32, 1, "k", 4)
    assert natural.prompt_tokens == 32
    prompts = CellPrompts(builder, w)
    pa, pb = prompts.for_cell(a, 2), prompts.for_cell(b, 2)
    assert [p.token_ids for p in pa] == [p.token_ids for p in pb] and pa[0].top_logprobs == 20


def test_workload_needs_a_baseline_and_natural_text_only_for_kv_quant():
    base = dict(name="x", seed=1, prompt_tokens=[64], output_tokens=4, concurrency=[1])
    with pytest.raises(ValueError, match="baseline"):
        Workload(**base, family="kv_quant", kv_dtypes=["q8_0"])
    with pytest.raises(ValueError, match="kv_quant\" only"):
        Workload(**base, prompt_text="kjv")


def test_paragraphs_of_the_bible_program_output():
    raw = "\nGenesis 1\n\n  1 In the beginning.\n  2 And the earth.\n\nGenesis 2\n\n  1 Thus the heavens.\n"
    assert paragraphs(raw) == "In the beginning. And the earth.\n\nThus the heavens."


# --- the silent fallback --------------------------------------------------------------------------
def _row():
    return CellRow(run_id="r", cell_id="c", backend="b", engine="llamacpp", engine_version="v", model="m",
                   workload="w", prompt_tokens=64, output_tokens=8, concurrency=1, kv_dtype="q8_0", status="ok")


@pytest.mark.parametrize("bytes_per_token, declined", [(23_040, True), (12_240, False)])
def test_a_quantised_pool_the_size_of_the_baseline_is_flagged(bytes_per_token, declined):
    rules, row = kv_rules("llamacpp"), _row()
    declined_dtype(row, rules, GEOM, "q8_0", KVPool(512 * bytes_per_token, 512, "log"))
    assert (row.status == "flagged") is declined
    assert any("KV dtype q8_0 declined" in f for f in row.flags) is declined


# --- transformers' QuantizedCache: the bytes it holds, from quanto's layout -----------------------
SMOL = GEOM  # SmolLM2-135M's: 30 layers of 3 KV heads of 64, bf16


@pytest.mark.parametrize("dtype, nbits", [("quanto-int4", 4), ("quanto-int2", 2)])
def test_hf_quantised_cache_rule_is_quantos_layout(dtype, nbits):
    from kvbench.kv.rules import KVQuestion

    rules = kv_rules("hf")

    def by_hand(tokens, decoded, batch=1):  # per K or V tensor of a layer: packed rows, scale + shift, residual
        residual = decoded % 128
        rows = batch * 3 * (tokens - residual) * 64 // 64
        return 30 * 2 * (math.ceil(rows * nbits / 8) * 64 + 2 * rows * 2 + batch * 3 * residual * 64 * 2)

    for tokens, decoded, batch in ((71, 7, 1), (259, 2, 1), (269, 139, 1), (300, 0, 3), (64, 0, 1)):
        q = KVQuestion(SMOL, dtype, tokens, batch, options={"decoded_tokens": decoded})
        assert rules.answer(q).bytes_per_gpu == by_hand(tokens, decoded, batch), (tokens, decoded, batch)
    # the long-run figure per token: nbits codes and a bf16 scale and shift per group of 64
    assert rules.bytes_per_token(KVQuestion(SMOL, dtype)) == 30 * 2 * 3 * 64 * (nbits / 8 + 4 / 64)
    assert "cache_implementation=\"quantized\"" in rules.kv_dtype_flag(dtype)
    sliding = KVGeometry(layers=(LayerKV("full", 3, 64, 64), LayerKV("sliding", 3, 64, 64, span=32)))
    with pytest.raises(KVRuleError, match="full-attention layers only"):
        rules.answer(KVQuestion(sliding, dtype, 100))


def test_hf_worker_done_event_carries_ids_and_topk():
    from kvbench.backends.hf.adapter import HFBackend

    r = RequestResult("x", 4, 2, 0.0)
    HFBackend._read_event({"token_ids": [11], "worker_time": 1.0}, 1.0, r)
    HFBackend._read_event({"done": True, "usage": {"prompt_tokens": 4, "completion_tokens": 2}, "kv": {},
                           "output_ids": [11, 12], "top_logprobs": [[[11, -0.1], [12, -2.5]], [[12, -0.3]]]}, 1.1, r)
    assert r.output_ids == [11, 12] and r.top_logprobs == [{11: -0.1, 12: -2.5}, {12: -0.3}]
    assert logprob_records([r], 20, HFBackend.capabilities.kv_quantisation.top_logprobs_max)[0]["k"] == 20


def test_report_reads_an_engine_without_a_pool_from_its_cache_bytes(tmp_path):
    from kvbench.reports import kvquant

    def cell(dtype, held):
        return {"cell_id": f"h_kv-{dtype}_p64_c1_r0", "backend": "h", "engine": "hf", "kv_dtype": dtype,
                "prompt_tokens": 64, "output_tokens": 8, "status": "ok", "replica": "", "flags": [],
                "kv_pool_bytes_engine": None, "kv_pool_tokens_engine": None, "kv_pool_bytes_predicted": None,
                "kv_in_use_peak_bytes": held, "kv_in_use_peak_tokens": 71, "kv_peak_bytes_per_gpu_predicted": held,
                "gpus_used": 1, "itl_s_p50": 0.01}
    cells = pd.DataFrame([cell("bf16", 71 * 23_040), cell("quanto-int4", 576_000)])
    data = {r["kv_dtype"]: r for r in kvquant.rows(tmp_path, cells, {"h": "bf16"})}
    assert data["bf16"]["bytes_per_token"] == 23_040
    assert data["quanto-int4"]["bytes_per_token"] == data["quanto-int4"]["bytes_per_token_predicted"] == 576_000 / 71
    assert data["quanto-int4"]["saved"] == pytest.approx(1 - 576_000 / (71 * 23_040))


# --- the engines' answers -------------------------------------------------------------------------
def test_llamacpp_completion_probabilities_are_read_per_token():
    r = RequestResult("x", 4, 2, 0.0)
    event = {"tokens": [11], "completion_probabilities": [
        {"id": 11, "logprob": -0.1, "top_logprobs": [{"id": 11, "logprob": -0.1, "token": "a"},
                                                     {"id": 12, "logprob": -2.5, "token": "b"}]}]}
    CompletionEvents()(event, 1.0, r)
    assert r.output_ids == [11] and r.top_logprobs == [{11: -0.1, 12: -2.5}]
    recs = logprob_records([r], 20, LlamaCppBackend.capabilities.kv_quantisation.top_logprobs_max)
    assert recs[0]["k"] == 20 and recs[0]["top"] == [[[11, -0.1], [12, -2.5]]]


def test_tokens_without_their_probabilities_are_recorded_without_any():
    """llama-server with a drafter sends every token's id but probabilities only for the tokens the target
    sampled itself (a real llama-server 0.3.36 stream with --model-draft and n_probs 2: 8 tokens, 5 of them
    accepted drafts, one list of probabilities): lists out of step with the tokens would compare the wrong
    positions, so the record keeps the ids (greedy identity) and no top-k (no KL). Ids missing (a held-back
    UTF-8 token) make the record no record: the report leaves the request out."""
    r = RequestResult("x", 13, 8, 0.0)
    events = CompletionEvents()
    stream = (DATA / "speculation" / "llamacpp_stream_draft_n_probs.txt").read_text()
    for line in stream.splitlines():
        if line.startswith("data: "):
            events(json.loads(line[6:]), 1.0, r)
    assert (r.spec_draft_tokens, r.spec_accepted_tokens, sum(r.chunk_tokens)) == (5, 5, 8)
    [record] = logprob_records([r], 20, 20)
    assert (record["error"], len(record["tokens"]), record["top"], record["k"]) == (None, 8, [], 0)
    assert len(r.top_logprobs) == 1  # what the server sent
    one = {"id": 11, "logprob": -0.1, "top_logprobs": [{"id": 11, "logprob": -0.1, "token": "a"}]}
    held = RequestResult("y", 4, 2, 0.0)
    CompletionEvents()({"tokens_predicted": 2, "tokens": [12], "completion_probabilities": [one]}, 1.0, held)
    assert logprob_records([held], 20, 20)[0]["error"] == "incomplete: the engine sent the ids of 1 of its 2 output tokens"


def test_vllm_echoed_prompt_logprobs_lead_the_first_chunk():
    r = RequestResult("x", 3, 1, 0.0)
    event = {"choices": [{"token_ids": [7], "logprobs": {
        "token_logprobs": [None, -1.0, -2.0, -0.5],
        "top_logprobs": [None, {"token_id:5": -1.0}, {"token_id:6": -2.0}, {"token_id:7": -0.5, "token_id:8": -1.5}]}}]}
    read_logprobs(event, r)
    assert r.prompt_logprobs == [None, -1.0, -2.0]
    assert r.output_ids == [7] and r.top_logprobs == [{7: -0.5, 8: -1.5}]


# --- the report on a hand-made run ----------------------------------------------------------------
def test_report_pairs_each_dtype_with_the_baseline(tmp_path):
    from kvbench.reports import kvquant

    def cell(dtype, bpt):
        return {"cell_id": f"b_kv-{dtype}_p64_c1_r0", "backend": "b", "engine": "llamacpp", "kv_dtype": dtype,
                "prompt_tokens": 64, "output_tokens": 8, "status": "ok", "replica": "", "flags": [],
                "kv_pool_bytes_engine": 512 * bpt, "kv_pool_tokens_engine": 512, "kv_pool_bytes_predicted": 512 * bpt,
                "itl_s_p50": 0.01}
    cells = pd.DataFrame([cell("f16", 23_040), cell("q8_0", 12_240)])
    (tmp_path / "logprobs").mkdir()
    same = [{"request_id": "q0", "error": None, "k": 2, "tokens": [1, 2],
             "top": [[[1, -0.1], [3, -2.4]], [[2, -0.2], [3, -1.8]]], "prompt_logprobs": None}]
    for dtype in ("f16", "q8_0"):  # a planted bad cache: the baseline's own records under the q8_0 cell
        (tmp_path / "logprobs" / f"b_kv-{dtype}_p64_c1_r0.json").write_text(
            json.dumps({"cell_id": f"b_kv-{dtype}_p64_c1_r0", "requests": same}))
    data = kvquant.rows(tmp_path, cells, {"b": "f16"})
    q = next(r for r in data if r["kv_dtype"] == "q8_0")
    assert q["divergence"].kl_mean == 0.0 and q["divergence"].identical_share == 1.0
    assert q["saved"] == pytest.approx(1 - 12_240 / 23_040)
    assert q["sequences"] == 2**30 // (12_240 * 72)
    frame = kvquant.table(data, {"b": "not measured: synthetic prompts"})
    assert frame.iloc[1]["KL mean"] == "0 (top-2)" and frame.iloc[1]["identical"] == "100 % of 1"
    assert kvquant.plot(data, tmp_path / "p.png") is not None  # a zero KL is drawn at the floor


# --- the command ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--workload", "kv_quant_smoke", "--kv-dtypes", "fp8"], "llamacpp has no KV dtype 'fp8'"),
    (["--workload", "smoke", "--kv-dtypes", "q8_0"], "not a kv_quant workload"),
    (["--workload", "kv_quant_smoke", "-b", "openai:url=http://127.0.0.1:9"], "no KV rules"),
])
def test_bad_kv_dtypes_are_refused_before_any_run_folder(tmp_path, args, message):
    argv = ["run", "--results-dir", str(tmp_path / "runs"), *args]
    if "-b" not in args:
        argv += ["-b", "llamacpp"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists()


# --- the GPU check's step (f) on hand-made probe events ---------------------------------------------
def test_gpu_check_kv_quant_rows_from_probe_events():
    from kvbench.selfcheck import gpu_check as gc

    caches = gc.kv_quant_caches()
    assert caches["bf16"] is None and caches["quanto-int4"]["nbits"] == 4 and caches["quanto-int2"]["nbits"] == 2
    reqs = [{"tokens": [5, 6], "top": [[[5, -0.1], [7, -2.5]], [[6, -0.2], [8, -1.9]]]}]
    other = [{"tokens": [5, 8], "top": [[[5, -0.1], [7, -2.5]], [[8, -0.3], [6, -1.5]]]}]
    events = [{"event": "ready"},
              {"event": "kvq_cell", "kv_dtype": "bf16", "cache_bytes": [23040 * 7], "requests": reqs},
              {"event": "kvq_cell", "kv_dtype": "quanto-int4", "cache_bytes": [999], "requests": other},
              {"event": "kvq_cell", "kv_dtype": "quanto-int2", "error": "ValueError: planted"}]
    rows = {r["kv_dtype"]: r for r in gc.kv_quant_rows("m", GEOM, events, 6, 2)}
    assert rows["bf16"]["cache_ok"] is True and rows["bf16"]["kl_mean"] == 0.0  # the baseline against itself
    assert rows["quanto-int4"]["cache_ok"] is False and rows["quanto-int4"]["first_difference"] == 1
    assert rows["quanto-int4"]["kl_mean"] > 0 and rows["quanto-int4"]["top_k"] == 2
    problems = gc.verdict({"kv_quant": list(rows.values())})[1]
    assert "(f) m quanto-int4: cache bytes disagree with the hf rules" in problems
    assert "(f) m quanto-int2: ValueError: planted" in problems
    md = gc.render_markdown({"kv_quant": list(rows.values())})
    assert "## (f) KV quantisation" in md and "| m | quanto-int2 | 6 + 2 | ValueError: planted" in md


@pytest.mark.parametrize("engine", ["vllm", "llamacpp", "hf", "sglang", "tgi", "ollama"])
def test_kv_dtypes_auto_is_taken_by_every_engine_before_the_model_is_read(engine, tmp_path):
    """``--kv-dtypes auto,...`` is checked before the model is located: ``auto`` needs no geometry (it used to
    raise AttributeError for engines whose auto reads the model's dtype)."""
    r = CliRunner().invoke(app, ["run", "-b", engine, "--workload", "kv_quant_smoke", "--kv-dtypes", "auto",
                                 "--model", str(tmp_path / "absent"), "--results-dir", str(tmp_path / "r")])
    assert r.exit_code == 2, r.output
    assert "no such file or folder" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "r").exists()
