"""The prefix cache under control: each run's prompt salt, the hit rate an ideal cache gives a cell, and the
hit rate a row records from what the engine says (docs/workloads.md "Cold and warm"). Real engines:
tests/run/test_prefix_cache_engines.py."""

import json
from pathlib import Path

import pytest

from kvbench.backends import kv_rules
from kvbench.backends.types import PrefixCacheCounters, RequestResult
from kvbench.kv.rules import KVQuestion
from kvbench.load import LoadPoint, LoadResult
from kvbench.run.cells import CellPrompts, cells_for
from kvbench.run.prompt_salt import UNSALTED, PromptSalt
from kvbench.run.prefix_cache import expected_hit_tokens, meant_warm
from kvbench.run.rows import CellMeasurement, EngineRun, summarize
from kvbench.workloads import load
from kvbench.workloads.prompts import PromptBuilder
from tests.helpers import REPO, DATA


@pytest.fixture(scope="module")
def builder(smollm2):
    return PromptBuilder(smollm2.hf_dir / "tokenizer.json")


def first_cell(workload, concurrency=4, prefix_caching=None, turn=1):
    cells = cells_for(workload, [workload.prompt_lengths(8192)[0]], [LoadPoint("concurrent", concurrency)], 0,
                      prefix_caching)
    return next(c for c in cells if c.turn in (0, turn))


def test_two_runs_share_no_prompt_and_one_run_gives_every_engine_the_same(builder):
    w = load("smoke")
    cell = first_cell(w)
    a, b = PromptSalt.parse("auto", isolated=False), PromptSalt.parse("auto", isolated=False)
    assert a.value != b.value and a.in_tokens
    run_a, run_b = CellPrompts(builder, w, a).for_cell(cell, 4), CellPrompts(builder, w, b).for_cell(cell, 4)
    # no prompt of one run starts like one of the other's (the first tokens already differ)
    assert {p.token_ids[:4] for p in run_a}.isdisjoint({p.token_ids[:4] for p in run_b})
    assert run_a == CellPrompts(builder, w, a).for_cell(cell, 4)  # one salt: the same prompts again
    assert [p.request_id for p in run_a] == [p.request_id for p in run_b]  # ids are the cell's, not the salt's
    builder.verify(run_a[0])


def test_no_salt_reproduces_the_unsalted_prompts_of_earlier_runs(builder):
    w = load("smoke")
    cell = first_cell(w)
    none = PromptSalt.parse("none", isolated=False)
    assert none == UNSALTED and none.applied.startswith("none")
    # the draw of every run before salts: the builder with the cell's key and no salt
    key = f"p{cell.prompt_tokens}-{cell.load.slug}-r0-0"
    assert CellPrompts(builder, w, none).for_cell(cell, 1)[0] == builder.build(cell.prompt_tokens, w.seed, key,
                                                                                  w.output_tokens)


def test_an_isolating_engine_gets_the_salt_in_its_field_and_the_unsalted_tokens(builder):
    w = load("smoke")
    cell = first_cell(w)
    isolated = PromptSalt.parse("pinned-1", isolated=True)
    prompts = CellPrompts(builder, w, isolated).for_cell(cell, 2)
    assert [p.cache_salt for p in prompts] == ["pinned-1"] * 2 and not isolated.in_tokens
    assert [p.token_ids for p in prompts] == [p.token_ids for p in CellPrompts(builder, w).for_cell(cell, 2)]
    assert all(p.cache_salt is None for p in CellPrompts(builder, w, PromptSalt("pinned-1")).for_cell(cell, 2))


def test_a_salted_shared_prefix_run_still_shares_its_prefix(builder):
    w = load("shared_prefix")
    cell = first_cell(w, prefix_caching=True)
    salted = CellPrompts(builder, w, PromptSalt("s1")).for_cell(cell, 4)
    unsalted = CellPrompts(builder, w).for_cell(cell, 4)
    n = w.shared_prefix_tokens
    assert len({p.token_ids[:n] for p in salted}) == 1
    assert salted[0].token_ids[:n] != unsalted[0].token_ids[:n]


@pytest.mark.parametrize("text", ["", "a/b", "x" * 65, "sp ace"])
def test_a_salt_that_is_not_plain_is_refused(text):
    with pytest.raises(ValueError, match="--prompt-salt"):
        PromptSalt.parse(text, isolated=False)


def test_a_resumed_run_keeps_its_salt_and_refuses_another():
    from kvbench.store.errors import RunFolderError

    recorded = PromptSalt("abc", in_tokens=True).to_dict()
    assert PromptSalt.resumed(recorded, None, isolated=False) == PromptSalt("abc")
    assert PromptSalt.resumed(recorded, "abc", isolated=False) == PromptSalt("abc")
    assert PromptSalt.resumed(None, "auto", isolated=True) == UNSALTED  # a run from before salts
    with pytest.raises(RunFolderError, match="prompt salt abc, not other"):
        PromptSalt.resumed(recorded, "other", isolated=False)


def test_the_ideal_hits_of_a_shared_prefix_and_of_later_turns():
    sp = load("shared_prefix")  # 2,048-token prompts, the first 1,792 shared
    on, off = first_cell(sp, 4, True), first_cell(sp, 4, False)
    assert meant_warm(sp, on) and not meant_warm(sp, off)
    # vLLM's CPU block of 128 tokens: 1,792 is 14 whole blocks; a 100-token unit keeps 1,700
    assert expected_hit_tokens(sp, on, 8, 128, prefix_seen=False) == 7 * 1792
    assert expected_hit_tokens(sp, on, 8, 128, prefix_seen=True) == 8 * 1792
    assert expected_hit_tokens(sp, on, 8, 100, prefix_seen=True) == 8 * 1700
    assert expected_hit_tokens(sp, off, 8, 128, prefix_seen=True) == 0
    assert expected_hit_tokens(sp, on, 8, None, prefix_seen=True) == 0  # an engine with no prefix cache
    mt = load("multi_turn")  # turns of 256 new tokens, 64-token replies
    t1, t3 = (first_cell(mt, 4, True, turn) for turn in (1, 3))
    assert not meant_warm(mt, t1) and meant_warm(mt, t3)
    # turn 3 resends turn 2's prompt (256 + 64 + 256 = 576 tokens): 4 blocks of 128, or all 576 token by token
    assert expected_hit_tokens(mt, t3, 4, 128, False) == 4 * 512
    assert expected_hit_tokens(mt, t3, 4, 1, False) == 4 * 576
    assert not meant_warm(load("smoke"), first_cell(load("smoke")))


def test_the_engines_reuse_units(smollm2):
    geometry = smollm2.geometry
    assert kv_rules("vllm").prefix_reuse_unit(KVQuestion(geometry, device="cpu")) == 128
    assert kv_rules("vllm").prefix_reuse_unit(KVQuestion(geometry), {"block_size": 16}) == 16
    assert kv_rules("llamacpp").prefix_reuse_unit(KVQuestion(geometry)) == 1
    assert kv_rules("hf").prefix_reuse_unit(KVQuestion(geometry)) is None
    assert kv_rules("vllm").shares_prefix_kv and not kv_rules("llamacpp").shares_prefix_kv


def measured(smollm2, workload, cell, cached, counters=(None, None), prompt=None, engine="vllm"):
    prompt = prompt or cell.prompt_tokens
    results = []
    for i, c in enumerate(cached):
        r = RequestResult(f"r{i}", prompt, 4, t_sent=0.0, chunk_times=[0.1, 0.2], chunk_tokens=[1, 3], t_done=0.2,
                          prompt_tokens_reported=prompt, output_tokens_reported=4, prompt_tokens_cached=c)
        results.append(r)
    run = EngineRun("run", engine, engine, "1", smollm2, workload.model_copy(update={"output_tokens": 4}), "bf16", False,
                    rules=kv_rules(engine))
    m = CellMeasurement(cell, LoadResult(results, 0.0, 0.2), 0.0, "bf16", prefix_counters=counters)
    return summarize(run, m)


def test_a_row_takes_the_requests_cached_tokens_and_flags_a_cold_cell_that_hit(smollm2):
    w = load("smoke")
    cell = first_cell(w)
    cold = measured(smollm2, w, cell, [0, 0, 0, 0])
    assert cold.prefix_cache_expected == "cold" and cold.prefix_cache_hit_rate == 0.0
    assert cold.prefix_cache_expected_hit_rate == 0.0 and cold.status == "ok"
    assert cold.prefix_cache_source.startswith("cached prompt tokens per request (4 of 4")
    hit = measured(smollm2, w, cell, [cell.prompt_tokens - 1] * 4)
    assert hit.status == "flagged" and hit.flags[0].startswith("prefix cache hit on a cell meant cold")
    assert hit.prefix_cache_hit_tokens == 4 * (cell.prompt_tokens - 1)
    none = measured(smollm2, w, cell, [None] * 4)
    assert none.prefix_cache_source == "not reported" and none.prefix_cache_hit_rate is None


def test_a_row_takes_the_counters_difference_when_requests_say_nothing(smollm2):
    w = load("smoke")
    cell = first_cell(w)
    before, after = PrefixCacheCounters(1000, 200, "counters"), PrefixCacheCounters(1000 + 4 * cell.prompt_tokens,
                                                                                      200 + 64, "counters")
    row = measured(smollm2, w, cell, [None] * 4, (before, after))
    assert row.prefix_cache_hit_tokens == 64 and row.prefix_cache_query_tokens == 4 * cell.prompt_tokens
    assert row.prefix_cache_source == "counters"
    idle = measured(smollm2, w, cell, [None] * 4, (before, before))  # nothing counted during the cell
    assert idle.prefix_cache_source == "not reported"


def test_a_warm_cell_sets_its_expected_hit_rate_beside_the_measured_one(smollm2):
    sp = load("shared_prefix")
    cell = first_cell(sp, 4, True)
    row = measured(smollm2, sp, cell, [0, 1792, 1792, 1792])
    assert row.prefix_cache_expected == "warm" and row.status == "ok"
    # an unknown block size (no pool reported): the rules' default for the device the question names (gpu: 16)
    assert row.prefix_cache_expected_hit_rate == pytest.approx(3 * 1792 / (4 * 2048))
    assert row.prefix_cache_hit_rate == pytest.approx(3 * 1792 / (4 * 2048))


@pytest.mark.parametrize("args, says", [
    (["--prompt-salt", "a/b"], "--prompt-salt 'a/b': 1-64 letters"),
    (["-b", "hf", "--reset-cache-between-cells"], "--reset-cache-between-cells: hf cannot empty a prefix cache "
                                                  "(engines that can: llamacpp, sglang, vllm)"),
])
def test_prefix_cache_options_are_refused_before_any_run_folder(tmp_path, args, says):
    from tests.test_cli import kvbench

    out = kvbench("run", "--results-dir", str(tmp_path), "--workload", "smoke", *args, timeout=120)
    assert out.returncode == 2 and says in " ".join(out.stderr.split()), out.stderr
    assert list(tmp_path.iterdir()) == []


# --- kvbench plan --shared-prefix: KV in use with the prefix held once ----------------------------------

CONFIGS = DATA / "configs"


def plan_json(*args):
    from typer.testing import CliRunner

    from kvbench.cli import app

    result = CliRunner().invoke(app, ["plan", *args, "--json"], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_vllm_holds_a_shared_prefix_once_in_whole_blocks():
    # SmolLM2: 23,040 B per token; 4 requests of 2,080 tokens on vLLM's CPU blocks of 128: 17 blocks each unshared;
    # a prefix of 1,800 tokens shares 14 whole blocks (1,792 tokens), the 8 left are each request's own
    code, out = plan_json("smollm2", "--engine", "vllm", "--device", "cpu", "--context", "2080", "--batch", "4",
                          "--shared-prefix", "1800")
    assert code == 0, out
    shared = json.loads(out)["shared_prefix"]
    block = 128 * 23040
    assert shared["kv_bytes_per_gpu_unshared"] == 4 * 17 * block
    assert shared["kv_bytes_per_gpu"] == 4 * 17 * block - 3 * 14 * block
    assert "1,792 tokens in whole units of 128" in shared["rule"] and "8 tokens of a partial unit" in shared["rule"]


def test_an_engine_that_does_not_share_holds_a_copy_per_request():
    code, out = plan_json(str(CONFIGS / "llama-3.1-8b.json"), "--engine", "llamacpp", "--context", "8k", "--batch", "8",
                          "--shared-prefix", "4k")
    shared = json.loads(out)["shared_prefix"]
    assert code == 0 and shared["kv_bytes_per_gpu"] == shared["kv_bytes_per_gpu_unshared"]
    assert "every sequence holds its own copy" in shared["rule"]


@pytest.mark.parametrize("args, says", [
    (["smollm2", "--engine", "vllm", "--context", "2080", "--shared-prefix", "2080"], "must be shorter than the request"),
    ([str(CONFIGS / "gemma-3-1b-it.json"), "--engine", "vllm", "--context", "8k", "--batch", "2",
      "--shared-prefix", "4k"], "sliding-window or chunked layers is not planned"),
    (["smollm2", "--engine", "vllm", "--shared-prefix", "lots"], "--shared-prefix takes a number of tokens"),
])
def test_a_shared_prefix_the_plan_cannot_vouch_for_is_refused_in_one_line(args, says):
    code, out = plan_json(*args)
    assert code == 2 and says in out and len(out.strip().splitlines()) == 1, out


# --- the published shared-prefix run -----------------------------------------------------------------

PUBLISHED = REPO / "results" / "published" / "20261201-shared-prefix-cpu"


def test_the_published_shared_prefix_run_matches_the_ideal_and_the_plan():
    """vLLM served exactly the ideal hit rate and held the prefix once, to the byte what `kvbench plan
    --shared-prefix` says; llama.cpp, per slot, served less; caching off served nothing."""
    from kvbench.store.readers import load_cells
    from kvbench.store.schema import SCHEMA_VERSION

    cells = load_cells(PUBLISHED)  # read as rows of the current schema
    assert (cells.status == "ok").all() and (cells.schema_version == SCHEMA_VERSION).all()
    off = cells[cells.variant == "prefix_caching=off"]
    assert (off.prefix_cache_hit_rate == 0).all() and (off.prefix_cache_expected == "cold").all()
    on = cells[cells.variant == "prefix_caching=on"]
    assert (on.prefix_cache_expected == "warm").all()
    assert (on.prefix_cache_hit_rate <= on.prefix_cache_expected_hit_rate + 1e-12).all()
    vllm = on[on.engine == "vllm"].set_index("concurrency")
    assert (vllm.prefix_cache_hit_rate == vllm.prefix_cache_expected_hit_rate).all()
    assert (vllm.kv_in_use_peak_bytes == vllm.kv_peak_bytes_per_gpu_predicted).all()
    code, out = plan_json("smollm2", "--engine", "vllm", "--device", "cpu", "--context", "2080", "--batch", "4",
                          "--shared-prefix", "1792")
    assert code == 0 and json.loads(out)["shared_prefix"]["kv_bytes_per_gpu"] == vllm.kv_in_use_peak_bytes[4]
    # warm beats cold at every load on both engines (TTFT p50)
    for (engine, conc), group in cells.groupby(["engine", "concurrency"]):
        by = group.set_index("variant").ttft_s_p50
        assert by["prefix_caching=on"] < by["prefix_caching=off"], (engine, conc)
    readme = (PUBLISHED.parent / "README.md").read_text()
    assert "| vllm-0.32.0 | on | 4 | 87.5 % | 87.5 % |" in readme and "73.12 MiB | 73.12 MiB |" in readme


# --- kvbench compare: a warm cell is not compared with a cold one ------------------------------------------

def with_hit_rate(run_dir: Path, rate: float) -> Path:
    """The run with every cell's measured prefix-cache hit rate set (its cells meant cold)."""
    path = run_dir / "cells.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r | {"prefix_cache_expected": "cold", "prefix_cache_hit_rate": rate,
                                            "prefix_cache_source": "synthetic"}) + "\n" for r in rows))
    for parquet in run_dir.glob("*.parquet"):
        parquet.unlink()
    return run_dir


def test_compare_leaves_out_a_cell_warm_on_one_side_and_cold_on_the_other(tmp_path):
    from tests.synth import make_run
    from tests.compare.test_runs import kvbench

    base = with_hit_rate(make_run(tmp_path, "b", prompts=(1024,), seed=1, repeats=3), 0.0)
    warm = with_hit_rate(make_run(tmp_path, "w", backends=[("vllm", "0.32.0")], prompts=(1024,), seed=2,
                                  repeats=3), 0.8)
    refused = kvbench("compare", str(base), str(warm), "--format", "json")
    result = json.loads(refused.stdout)
    assert result["summary"]["cache_mismatch"] == 2 and result["summary"]["compared_cells"] == 0
    assert {(m["baseline_cache"], m["candidate_cache"]) for m in result["cache_mismatch"]} == {("cold", "warm")}
    assert refused.exit_code == 2  # nothing compared
    assert "PREFIX CACHE: 6 cell(s) of the candidate meant cold were served" in refused.stderr
    allowed = kvbench("compare", str(base), str(warm), "--allow-cache-mismatch")
    assert "warm against cold" in allowed.stdout and "compared: --allow-cache-mismatch" in allowed.stdout
    assert allowed.exit_code in (0, 1, 3, 4)
    same = with_hit_rate(make_run(tmp_path, "s", backends=[("vllm", "0.32.0")], prompts=(1024,), seed=3,
                                  repeats=3), 0.0)
    assert json.loads(kvbench("compare", str(base), str(same), "--format", "json").stdout)["summary"][
        "cache_mismatch"] == 0


def test_the_reports_show_the_prefix_cache_or_say_it_was_not_recorded(tmp_path):
    from kvbench import reports

    # the tables' subject: no plots (tests/reports/ check those)
    md, _, _ = reports.write([PUBLISHED], output=tmp_path / "report.md", plots=False)
    text = md.read_text()
    assert "| vllm-0.32.0 | prefix_caching=on | 2048 | 4 | warm | 87.5% | 87.5% | 14,336 / 16,384 |" in text
    assert "| 73.12 MiB | 73.12 MiB |" in text
    old, _, _ = reports.write([PUBLISHED.parent / "20261129-vllm-upgrade-cpu"], output=tmp_path / "old.md",
                           plots=False)
    assert "Not recorded: the run is from before kvbench recorded the prefix cache" in old.read_text()


def test_kvbench_backends_lists_what_each_engine_has_for_its_prefix_cache():
    from typer.testing import CliRunner

    from kvbench.cli import app

    engines = json.loads(CliRunner().invoke(app, ["backends", "--json"]).output)["engines"]
    assert engines["vllm"]["prefix_cache"]["isolation_field"] == "cache_salt"
    assert engines["vllm"]["prefix_cache"]["reset"].startswith("POST /reset_prefix_cache")
    assert engines["llamacpp"]["prefix_cache"]["hits_reported"].startswith("timings.cache_n")
    assert engines["sglang"]["prefix_cache"]["reset"].startswith("POST /flush_cache")
    assert engines["hf"]["prefix_cache"] == {"isolation_field": None, "reset": None, "hits_reported": None}
