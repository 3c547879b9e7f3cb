"""Did speculation pay off (bench/reports/speculation_paired.py), from made-up records: the partner is the
backend serving the same weights without a drafter (not merely the same engine), requests pair by repeat and
place in the cell, the change and its interval are the paired t-interval's on those pairs, and a cell that
cannot be paired says why. Every number is made up."""
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from kvbench.reports import speculation_paired as p

DRAFT, Q4, F16 = "llamacpp+speculative=draft", "llamacpp+default", "llamacpp+gguf=converted"


def info(**served):
    labels = {DRAFT: {"speculative": "draft"}, Q4: {}, F16: {"gguf": "converted"}}
    return {"run_id": "r", "served_models": served,
            "backends": [{"engine": "llamacpp", "version": "0.3.36", "options": labels[k], "label": k} for k in served]}


def test_the_partner_serves_the_same_weights_not_merely_the_same_engine():
    both = info(**{DRAFT: ["/m/f16.gguf"], Q4: ["/m/q4_1.gguf"], F16: ["/m/f16.gguf"]})
    assert p.partners(both) == {DRAFT: F16}
    assert p.partners(info(**{DRAFT: ["/m/f16.gguf"], Q4: ["/m/q4_1.gguf"]})) == {DRAFT: None}
    # an attached server that named nothing it serves pairs with nothing
    assert p.partners(info(**{DRAFT: None, Q4: None})) == {DRAFT: None}


def cells(status=("ok", "ok"), accepted=90):
    rows = []
    for label, s, tps in ((DRAFT, status[0], 30.0), (F16, status[1], 20.0)):
        rows.append({"run_id": "r", "backend": label, "cell_id": f"{label}_p128_c1_copy_r0", "status": s,
                     "variant": "prompt=copy", "prompt_tokens": 128, "load_profile": "concurrent", "concurrency": 1,
                     "request_rate": None, "kv_dtype": "f16", "spec_method": "draft" if label == DRAFT else "",
                     "spec_acceptance_rate": 0.9 if label == DRAFT else None, "output_tokens_per_s": tps,
                     "spec_accepted_tokens": accepted if label == DRAFT else None, "spec_steps_per_output_token": None,
                     "kv_pool_bytes_engine": 256 * 23040, "kv_pool_tokens_engine": 256, "repeat": 0})
    return pd.DataFrame(rows)


def requests(without, with_, ordinals=None):
    rows = []
    for label, e2es in ((F16, without), (DRAFT, with_)):
        for i, e2e in enumerate(e2es):
            rows.append({"run_id": "r", "cell_id": f"{label}_p128_c1_copy_r0", "warmup": False, "error": None,
                         "repeat": 0, "ordinal": (ordinals or range(len(e2es)))[i] if label == DRAFT else i,
                         "e2e_s": e2e, "ttft_s": 0.1, "output_tokens_received": 32})
    rows.append({**rows[0], "warmup": True, "ordinal": None, "e2e_s": 100.0})  # a warmup pairs with nothing
    return pd.DataFrame(rows)


def test_requests_pair_by_place_and_the_change_is_the_paired_interval():
    without, with_ = [1.0, 1.2, 0.9, 1.1], [0.6, 0.75, 0.5, 0.7]
    [row] = p.rows([info(**{DRAFT: ["f16"], F16: ["f16"]})], cells(), requests(without, with_))
    assert row["partner"] == F16 and row["pairs"] == 4 and row["acceptance"] == 0.9
    logs = np.log(with_) - np.log(without)
    half = scipy_stats.t.ppf(0.975, 3) * logs.std(ddof=1) / math.sqrt(4)
    e2e = row["e2e"]
    assert e2e.change == pytest.approx(math.exp(logs.mean()) - 1)
    assert (e2e.low, e2e.high) == pytest.approx((math.exp(logs.mean() - half) - 1, math.exp(logs.mean() + half) - 1))
    assert row["verdict"] == "paid off" and row["tpot"].high < 0  # judged on the decode, TTFT aside
    # decode time per token after the first: (e2e - ttft) / 31
    tpot = np.log([(w - 0.1) / 31 for w in with_]) - np.log([(w - 0.1) / 31 for w in without])
    assert row["tpot"].change == pytest.approx(math.exp(tpot.mean()) - 1)
    assert row["throughput"].change == pytest.approx(0.5) and math.isnan(row["throughput"].low)  # one repeat
    table = p.table([row]).iloc[0]
    assert table["verdict"] == "paid off" and table["pairs"] == "4" and table["acceptance"] == "90.0%"
    assert table["E2E change"].startswith(f"{e2e.change:+.1%} [")
    assert table["KV bytes/token"] == "23,040 / 23,040" and table["pool tokens"] == "256 / 256"


def test_a_cost_and_no_clear_change_are_told_apart():
    infos = [info(**{DRAFT: ["f16"], F16: ["f16"]})]
    [slower] = p.rows(infos, cells(), requests([1.0, 1.1, 0.9], [1.5, 1.6, 1.4]))
    assert slower["verdict"] == "cost" and slower["tpot"].low > 0
    [noisy] = p.rows(infos, cells(), requests([1.0, 1.1, 0.9], [0.5, 1.6, 1.0]))
    assert noisy["verdict"] == "no clear change" and noisy["tpot"].low < 0 < noisy["tpot"].high
    # 45 % faster a token where the accepted drafts saved 10 % of the target's passes: not the drafter's
    few = cells().assign(spec_steps_per_output_token=[0.9, None])
    [beyond] = p.rows(infos, few, requests([1.0, 1.1, 0.9], [0.55, 0.6, 0.5]))
    assert beyond["tpot"].high < -0.1 and beyond["verdict"].startswith("faster than its accepted drafts explain (10.0%")
    many = cells().assign(spec_steps_per_output_token=[0.3, None])  # 70 % saved: the same gain is the drafter's
    assert p.rows(infos, many, requests([1.0, 1.1, 0.9], [0.55, 0.6, 0.5]))[0]["verdict"] == "paid off"
    # faster, but no draft was accepted: not speculation's doing (n-gram lookup on free text)
    [idle] = p.rows(infos, cells(accepted=0), requests([1.0, 1.1, 0.9], [0.5, 0.6, 0.4]))
    assert idle["tpot"].high < 0 and idle["verdict"] == p.NOTHING_ACCEPTED
    [unknown] = p.rows(infos, cells(accepted=None), requests([1.0, 1.1, 0.9], [0.5, 0.6, 0.4]))
    assert unknown["verdict"] == p.NOT_REPORTED


def test_what_cannot_be_paired_says_why():
    infos = [info(**{DRAFT: ["f16"], F16: ["f16"]})]
    # the other side's requests were other prompts (another place in the cell): no pair, no interval
    [apart] = p.rows(infos, cells(), requests([1.0, 1.1], [0.5, 0.6], ordinals=[5, 6]))
    assert apart["pairs"] == 0 and apart["e2e"] == "0 pair(s): no interval" and apart["verdict"] == "no interval"
    [failed] = p.rows(infos, cells(status=("ok", "failed")), requests([1.0], [0.5]))
    assert failed["missing"] == "a side failed"
    [alone] = p.rows([info(**{DRAFT: ["f16"], Q4: ["q4"]})], cells(), requests([1.0], [0.5]))
    assert alone["partner"] is None and "same weights" in alone["missing"]
    assert p.table([alone]).iloc[0]["verdict"].startswith("not paired: ")
    assert p.table([]) is None and "without a drafter" in p.note([])


def test_the_outputs_are_compared_where_the_run_recorded_their_tokens():
    infos = [info(**{DRAFT: ["f16"], F16: ["f16"]})]
    plain = {"q-0": {"tokens": [1, 2, 3]}, "q-1": {"tokens": [4, 5, 6]}}
    drafted = {"q-0": {"tokens": [1, 2, 3]}, "q-1": {"tokens": [4, 9, 6]}}  # the second differs at position 1
    records = {"r": {f"{DRAFT}_p128_c1_copy_r0": drafted, f"{F16}_p128_c1_copy_r0": plain}}
    [row] = p.rows(infos, cells(), requests([1.0, 1.1], [0.5, 0.6]), records)
    assert (row["output"].requests, row["output"].identical_share, row["output"].first_difference_min) == (2, 0.5, 1)
    assert p.table([row]).iloc[0]["output identical"] == "50% of 2, first diff at 1"
    # a record left out (incomplete ids: load_logprobs drops it) leaves nothing to compare
    [row] = p.rows(infos, cells(), requests([1.0, 1.1], [0.5, 0.6]), {"r": {**records["r"], f"{DRAFT}_p128_c1_copy_r0": {}}})
    assert row["output"] is None and p.table([row]).iloc[0]["output identical"] == "not recorded"
