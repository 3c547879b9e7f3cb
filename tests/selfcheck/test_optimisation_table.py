"""The optimisation table's parts that start no engine: its columns and their configurations, the room each
asks of an engine, the verdict on a trial, the table assembled from synthetic trials, the planner beside each
measured cell, and the articles' scenario planned (kvbench.selfcheck.optimisation, ..optimisation_table)."""
from __future__ import annotations

import json

import pytest

from kvbench.common.models import ModelFiles
from kvbench.kv.config_gguf import geometry_from_gguf
from kvbench.selfcheck.optimisation import table as tables
from kvbench.selfcheck.optimisation.columns import Config, Scale, registered
from kvbench.selfcheck.optimisation.trials import greedy_match, spec_for, verdict
from kvbench.selfcheck.optimisation_table import build_columns, config_record, describe, main, scale_record

MIB = 2**20
BPT = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: 2 x layers x KV heads x head_dim x 2 bytes = 23,040 bytes per token
SCALE = Scale("smollm2", ("hf", "vllm", "llamacpp"), 48 * MIB, 256, 32, 2048, 8192)


def columns(scale=SCALE, chosen=None, settings=None):
    return build_columns(scale, chosen or list(registered()), settings or {})


def test_the_columns_are_the_articles_in_their_order():
    assert list(registered()) == ["static", "paged", "kv8", "kv4", "continuous", "prefix", "speculation"]


def test_each_column_runs_the_configurations_the_engines_rules_give_it():
    built = {column.key: [c.key for c in configs] for column, configs in columns()}
    assert built == {"static": ["hf-static", "llamacpp-slots"], "paged": ["vllm-paged", "llamacpp-unified"],
                     "kv8": ["vllm-paged-fp8", "llamacpp-unified-q8_0"], "kv4": ["llamacpp-unified-q4_0"],
                     "continuous": ["llamacpp-unified-q4_0-cb"], "prefix": ["vllm-paged-fp8-prefix"],
                     "speculation": ["vllm-paged-fp8-ngram", "llamacpp-unified-q4_0-ngram"]}
    desc = {d["key"]: d for d in describe(SCALE, columns())}
    # an engine a column has nothing for is named with the reason, from its rules
    assert desc["kv4"]["skipped"] == {"hf": "no 4-bit KV dtype (it takes quanto-int4, quanto-int2)",
                                      "vllm": "no 4-bit KV dtype (it takes fp8, fp8_e4m3, fp8_e5m2)"}
    assert "own copy" in desc["prefix"]["skipped"]["llamacpp"]
    # the contiguous slot reserves the scale's limit; the stacked configurations keep what came before
    static = {c["key"]: c for c in desc["static"]["configs"]}
    assert static["llamacpp-slots"]["reserve"] == 2048 and static["hf-static"]["reserve"] is None
    cb = desc["continuous"]
    assert cb["configs"][0]["kv_dtype"] == "q4_0"
    assert cb["configs"][0]["options"]["extra_args"] == "--cache-ram 0 --load-mode none --no-repack --kv-unified"
    assert cb["baselines"]["llamacpp-unified-q4_0-cb"]["options"]["extra_args"] == \
        "--cache-ram 0 --load-mode none --no-repack --kv-unified --no-cont-batching"
    assert cb["configs"][0]["plan_options"] == {"cache_ram_mib": 0, "unified": True}
    spec = {c["key"]: c for c in desc["speculation"]["configs"]}
    assert spec["llamacpp-unified-q4_0-ngram"]["options"]["speculative"] == "ngram"
    assert "speculative" not in desc["speculation"]["baselines"]["llamacpp-unified-q4_0-ngram"]["options"]


def test_a_columns_settings_and_engines_are_its_own():
    built = dict((c.key, (c, cfgs)) for c, cfgs in columns(settings={"prefix": {"prefix_tokens": 64},
                                                                     "speculation": {"engines": ["llamacpp"]}}))
    assert built["prefix"][1][0].prefix_tokens == 64
    assert [c.engine for c in built["speculation"][1]] == ["llamacpp"]
    with pytest.raises(Exception):
        columns(settings={"prefix": {"no_such_setting": 1}})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvbench.common.models import embedded_gguf

    gguf = embedded_gguf("smollm2")
    return ModelFiles("smollm2", tmp_path_factory.mktemp("hf"), gguf, "0", geometry_from_gguf(gguf))


def test_the_room_asked_of_an_engine(model):
    pool = Config("vllm", "v", pool=True)
    spec = spec_for(pool, model, SCALE, 8, 100 * MIB)
    # one pool of the batch's tokens a request may take whole: one sequence of 8 x 256, 8 at once
    assert (spec.max_context, spec.max_concurrency, spec.pool_sequences) == (2048, 8, 1)
    assert spec.memory_limit_bytes == 100 * MIB and spec.prefix_caching is False
    shared = spec_for(pool.with_(prefix_tokens=128, prefix_caching=True), model, SCALE, 8, None)
    assert shared.max_context == 8 * 256 - 7 * 128 and shared.prefix_caching is True  # the prefix held once
    # a pool past the model's limit: sequences of the limit, enough of them
    big = spec_for(pool, model, SCALE, 40, None)
    assert (big.max_context, big.pool_sequences) == (8192, 2)
    # slots: each the request's tokens, or the limit it reserves
    assert spec_for(Config("llamacpp", "l"), model, SCALE, 8, None).max_context == 256
    assert spec_for(Config("llamacpp", "l", reserve=2048), model, SCALE, 2, None).max_context == 2048


def _facts(phases, oom=0, exit=""):
    return {"oom_kills": oom, "exit": exit, "phases": phases}


def _phase(name, n, ok, running=None, batch=None):
    return {"name": name, "requests": n, "ok": ok, "running_peak": running, "waiting_peak": 0, "batch_size": batch}


def test_the_verdict_on_a_phase():
    assert verdict(_facts([_phase("batch", 8, 8, running=8)]), "batch", 8) == "ran"
    assert verdict(_facts([_phase("batch", 8, 8, running=5)]), "batch", 8) == "queued"  # the engine held 5
    assert verdict(_facts([_phase("batch", 8, 8, running=5)]), "batch", 8, held_check=False) == "ran"
    assert verdict(_facts([_phase("batch", 4, 4, batch=2)]), "batch", 4) == "queued"  # the worker split it
    assert verdict(_facts([], oom=1, exit="out of memory"), "batch", 8) == "killed"  # killed at start
    assert verdict(_facts([_phase("batch", 8, 3)], exit="cut"), "batch", 8) == "failed"
    # the batch ran, the longest request after it was killed: the batch still ran
    facts = _facts([_phase("batch", 8, 8, running=8), _phase("longest", 1, 0)], oom=1, exit="out of memory")
    assert verdict(facts, "batch", 8) == "ran" and verdict(facts, "longest", 1) == "killed"


def test_greedy_match_of_the_same_requests():
    a = [{"request_id": f"r{i}", "whole": True, "output_ids": [1, 2, 3, 4]} for i in range(4)]
    b = [dict(r) for r in a]
    b[1] = {**b[1], "output_ids": [1, 2, 9, 4]}
    b[3] = {**b[3], "output_ids": [7, 2, 3, 4]}
    b.append({"request_id": "r9", "whole": True, "output_ids": [1]})  # not on the other side
    assert greedy_match(a, b) == {"requests": 4, "identical": 2, "first_difference_median": 1.0}
    assert greedy_match(a, [{"request_id": "r0", "whole": False, "output_ids": [1]}]) is None


# --- the table from synthetic trials ----------------------------------------------------------------

def _rung(config, batch, verdict, longest=None, longest_verdict=None, wall=80 * MIB, tok_s=10.0):
    t = {"trial": f"col-{config}-b{batch}", "config": config, "purpose": "rung", "rung": batch, "verdict": verdict,
         "wall_bytes": wall, "metrics": {"output_tokens_per_s": tok_s, "ttft_s_p50": 1.5, "itl_s_p50": 0.05}}
    if longest_verdict:
        t.update(longest_tokens=longest, longest_verdict=longest_verdict)
    return t


def _run(configs_by_column, kinds=None, baselines=None):
    kinds = kinds or {}
    return {"scale": scale_record(SCALE),
            "columns": [{"key": key, "title": key, "kind": kinds.get(key, "capacity"), "configs": cfgs,
                         "baselines": (baselines or {}).get(key, {}), "skipped": {}}
                        for key, cfgs in configs_by_column.items()]}


PAGED = config_record(Config("llamacpp", "llama.cpp: unified", options={"extra_args": "--kv-unified"},
                             plan_options={"unified": True}, key="u"))
Q8 = config_record(Config("llamacpp", "llama.cpp: unified q8_0", kv_dtype="q8_0", plan_options={"unified": True},
                          key="u8"))


def test_a_capacity_cell_is_the_ladders_boundary():
    trials = [_rung("u", 8, "ran", 2048, "ran", tok_s=12.0), _rung("u", 9, "killed"), _rung("u", 7, "ran", 1792, "ran"),
              _rung("other", 20, "ran")]
    cell = tables.capacity_cell("paged", PAGED, trials)
    assert (cell.held, cell.not_held, cell.not_held_verdict) == (8, 9, "killed")
    assert cell.metrics["output_tokens_per_s"] == 12.0  # the largest batch that ran
    assert (cell.longest, cell.longest_not) == (2048, None)
    assert cell.trials == ["col-u-b7", "col-u-b8", "col-u-b9"] and cell.wall_bytes == 80 * MIB
    # nothing ran: no count, the smallest that did not is the bound
    none = tables.capacity_cell("paged", PAGED, [_rung("u", 2, "killed"), _rung("u", 1, "killed")])
    assert (none.held, none.not_held) == (None, 1)
    assert tables.held_text(none).startswith("0 (1 killed)")
    # a longest request killed after its batch ran
    cell = tables.capacity_cell("paged", PAGED, [_rung("u", 4, "ran", 1024, "killed"),
                                                 _rung("u", 2, "ran", 512, "ran")])
    assert (cell.longest, cell.longest_not) == (512, 1024)
    assert tables.capacity_cell("paged", PAGED, []).note == "not run"


def test_the_table_assembled_with_the_output_change_and_the_compared_columns():
    cb = config_record(Config("llamacpp", "llama.cpp: cb", key="cb"))
    static = config_record(Config("llamacpp", "llama.cpp: static", key="st"))
    run = _run({"paged": [PAGED], "kv8": [Q8], "continuous": [cb]}, kinds={"continuous": "arrivals"},
               baselines={"continuous": {"cb": static}})
    trials = [_rung("u", 8, "ran"), _rung("u", 6, "ran"), _rung("u", 9, "killed"), _rung("u8", 16, "ran"),
              _rung("u8", 17, "killed"),
              {"trial": "continuous-cb", "config": "cb", "purpose": "arrivals", "verdict": "ran", "wall_bytes": 1,
               "metrics": {"output_tokens_per_s": 30.0, "ttft_s_p50": 2.0, "itl_s_p50": 0.1}},
              {"trial": "continuous-st", "config": "st", "purpose": "arrivals", "verdict": "ran", "wall_bytes": 1,
               "metrics": {"output_tokens_per_s": 20.0, "ttft_s_p50": 4.0, "itl_s_p50": 0.1}}]
    out = [{"request_id": f"r{i}", "phase": "batch", "whole": True, "output_ids": [i, 1, 2]} for i in range(16)]
    requests = {"col-u-b8": out[:8], "col-u-b6": out[:6],
                "col-u8-b16": [{**r, "output_ids": [r["request_id"] == "r3" and 99 or int(r["request_id"][1:]), 1, 2]}
                               for r in out]}
    cells = tables.assemble(run, trials, requests, with_plan=False)
    paged, q8, cont = cells[0][0], cells[1][0], cells[2][0]
    assert q8.output_change == {"requests": 8, "identical": 7, "first_difference_median": 0.0, "batch": 16,
                                "baseline_batch": 8,
                                "noise_floor": {"requests": 6, "identical": 6, "first_difference_median": None}}
    assert paged.output_change is None and tables.change_text(paged) == "baseline (16-bit)"
    assert "7/8 identical" in tables.change_text(q8)
    assert cont.compared["config"]["metrics"]["output_tokens_per_s"] == 30.0
    assert "(1.50x)" in tables.compared_text(cont, "static")
    summary = tables.summary_table(run, cells)
    assert "llama.cpp: 8 (9 killed)" in summary and "llama.cpp: 16 (17 killed)" in summary
    assert "as kv8 (memory unchanged)" in summary  # batching changes no memory: the column before's count


def test_the_planner_beside_each_measured_cell():
    """The planner's count for the budget above its own idle footprint, by hand: SmolLM2's 23,040 bytes a token
    (f16), 12,240 (q8_0: 34 bytes per 32 values), 6,480 (q4_0: 18 per 32), requests of 256 tokens in 48 MiB,
    and a slot's row of logits and sampler candidates (49,152 x 16 bytes), one of them in the idle footprint."""
    scale = scale_record(SCALE)
    slot = 49_152 * 16
    for dtype, per_token in (("auto", BPT), ("q8_0", BPT * 34 // 64), ("q4_0", BPT * 18 // 64)):
        p = tables.planned({**PAGED, "kv_dtype": dtype}, scale, 200 * MIB)
        assert p["held"] == (48 * MIB + slot) // (256 * per_token + slot), dtype
        assert p["kv_bytes_per_token"] == per_token
        # at the wall itself the planner counts llama.cpp's mmapped weights (92.1 MiB) before any request
        assert p["held_at_wall"] == (200 * MIB - 96_576_768) // (256 * per_token + slot)
    # a slot reserving 2,048 tokens: 45 MiB each, one in 48 MiB
    slots = config_record(Config("llamacpp", "s", reserve=2048))
    assert tables.planned(slots, scale, 200 * MIB)["held"] == 1
    # vLLM: whole blocks of 128 tokens (2 a request), one null block per pool; fp8 halves them
    vllm = config_record(Config("vllm", "v", pool=True))
    block = 128 * BPT
    assert tables.planned(vllm, scale, 3 * 2**30)["held"] == (48 * MIB // block - 1) // 2
    assert tables.planned({**vllm, "kv_dtype": "fp8"}, scale, 3 * 2**30)["held"] == (48 * MIB // (block // 2) - 1) // 2
    # a shared prefix of one block: the prefix held once, one block more a request
    shared = tables.planned({**vllm, "kv_dtype": "fp8", "prefix_tokens": 128}, scale, 3 * 2**30)["held"]
    assert shared == (48 * MIB // (block // 2) - 1) - 1
    cell = tables.Cell("paged", PAGED, held=6, plan={"held": 8, "longest": 2048, "held_at_wall": 0})
    assert cell.ratio == 0.75 and "plan 8, 0.75x" in tables.held_text(cell)
    assert tables.Cell("paged", PAGED, held=3, plan={"held": 0}).ratio is None


def test_the_articles_scenario_planned():
    """A 70B at int4 on one H100-80GB: 8K requests of 2.5 GiB of bf16 KV each, 128K of 40 GiB."""
    rows = {(r["tokens"], r["label"]): r for r in tables.scenario()}
    slot = "llama.cpp, a slot per request reserving the model's limit"
    paged, fp8 = "vLLM, paged blocks, limit = the request", "vLLM fp8, limit = the request"
    assert rows[(8192, slot)]["held"] == 1 and rows[(8192, slot)]["verdict"] == "right"
    assert rows[(8192, paged)]["held"] == 12 and rows[(8192, paged)]["verdict"].startswith("too low")
    assert rows[(8192, fp8)]["held"] == 24 and rows[(8192, fp8)]["kv_gib_per_request"] == 1.25
    assert rows[(8192, paged)]["kv_gib_per_request"] == 2.5
    assert rows[(131072, paged)]["held"] == 0 and rows[(131072, paged)]["verdict"] == "right: none fits"
    assert rows[(131072, fp8)]["held"] == 1 and rows[(131072, fp8)]["verdict"].startswith("right")
    # no optimisation at 128K: one slot of 40 GiB beside 37 GiB of weights still fits on llama.cpp's rules
    assert rows[(131072, slot)]["held"] == 1 and rows[(131072, slot)]["verdict"] == "wrong: 1 fit(s)"
    assert tables.verdict_on("3-4", 3) == "right" and tables.verdict_on("6-8", 2) == "too high: kvbench plans 2"
    text = tables.scenario_table(tables.scenario())
    assert "more again" in text and "not a memory figure" in text


def test_the_table_and_plot_from_a_folder_start_no_engine(tmp_path, capsys, monkeypatch):
    """``--table-from DIR`` recomputes table.md's text and the plot from run.json, trials.jsonl and requests/."""
    run = _run({"paged": [PAGED], "kv8": [Q8]})
    run.update(command="python -m kvbench.selfcheck.optimisation_table", seconds=60,
               walls={"llamacpp": {"idle_bytes": 35 * MIB, "wall_bytes": 83 * MIB, "trial": "calibrate-llamacpp"}})
    trials = [_rung("u", 8, "ran", 2048, "ran"), _rung("u", 9, "killed"), _rung("u8", 16, "ran")]
    for t in trials:
        t["requests_file"] = f"requests/{t['trial']}.jsonl"
    (tmp_path / "requests").mkdir()
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trials))
    line = {"request_id": "r0", "phase": "batch", "whole": True, "output_ids": [1, 2]}
    (tmp_path / "requests" / "col-u-b8.jsonl").write_text(json.dumps(line) + "\n")
    assert main(["--table-from", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| requests of 256 tokens held at once" in text and "8 (9 killed); plan 7, 1.14x" in text
    assert (tmp_path / "held.png").stat().st_size > 10_000
