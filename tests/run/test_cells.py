"""Cells of a run and the prompts of each cell (shared prefix, multi-turn), from the embedded tokenizer."""
import pytest

from kvbench.load import LoadPoint
from kvbench.run.cells import CellPrompts, cells_for, server_variants
from kvbench.workloads import WorkloadError, load
from kvbench.workloads.prompts import PromptBuilder


@pytest.fixture(scope="module")
def builder(smollm2):
    return PromptBuilder(smollm2.hf_dir / "tokenizer.json")


def test_every_workload_file_loads():
    for name in ("long_context_ladder", "concurrency_ladder", "rate_sweep", "shared_prefix", "multi_turn",
                 "kv_boundary", "smoke", "kv_quant", "kv_quant_smoke"):
        assert load(name).name == name


def test_cell_ids_are_unique_over_variants_loads_turns_and_repeats():
    w = load("multi_turn")
    cells = [c for pc in server_variants(w) for r in range(2)
             for c in cells_for(w, [256], [LoadPoint("concurrent", 4)], r, pc)]
    assert len(cells) == 2 * 2 * w.turns
    assert len({c.cell_id("vllm-0.32.0") for c in cells}) == len(cells)
    assert cells[0].variant == "prefix_caching=on,turn=1"


def test_shared_prefix_prompts_share_exactly_the_prefix(builder):
    w = load("shared_prefix")
    prompts = CellPrompts(builder, w).for_cell(cells_for(w, [2048], [LoadPoint("concurrent", 4)], 0, True)[0], 4)
    n = w.shared_prefix_tokens
    assert all(p.prompt_tokens == 2048 for p in prompts)
    assert len({p.token_ids[:n] for p in prompts}) == 1
    assert len({p.token_ids[n:] for p in prompts}) == 4
    builder.verify(prompts[0])  # the text still re-encodes to the same ids across the join


def test_multi_turn_prompts_extend_the_previous_turn(builder):
    w = load("multi_turn")
    cp = CellPrompts(builder, w)
    cells = cells_for(w, [256], [LoadPoint("concurrent", 4)], 0, True)
    turns = [cp.for_cell(c, 4) for c in cells]
    for t, prompts in enumerate(turns, start=1):
        assert prompts[0].prompt_tokens == t * 256 + (t - 1) * w.output_tokens
    for earlier, later in zip(turns, turns[1:]):
        for a, b in zip(earlier, later):
            assert b.token_ids[:a.prompt_tokens] == a.token_ids
    assert turns[0][0].token_ids != turns[0][1].token_ids  # conversations differ


def test_same_prompts_for_both_prefix_caching_variants(builder):
    w = load("shared_prefix")
    cp = CellPrompts(builder, w)
    on, off = (cells_for(w, [2048], [LoadPoint("concurrent", 1)], 0, v)[0] for v in (True, False))
    assert [p.token_ids for p in cp.for_cell(on, 2)] == [p.token_ids for p in cp.for_cell(off, 2)]


def test_multi_turn_rung_must_fit_all_turns():
    w = load("multi_turn")
    # 4 turns of 256 + 3 replies of 64 + the last reply: 1,280 tokens; a 1,024 context has no room
    assert w.prompt_lengths(8192) == [256] and w.prompt_lengths(1024) == []


@pytest.mark.parametrize("toml, field", [
    ('load_profile = "poisson"\nrequest_rates = [1.0]\n', "requests"),
    ('load_profile = "poisson"\nrequest_rates = "saturation"\nrequests = 4\n', "concurrency"),
    ('concurrency = [1]\nrequest_rates = [1.0]\n', "request_rates"),
    ('concurrency = [1]\nfamily = "kv_boundary"\n', "kv_pool_sequences"),
    ('concurrency = [1]\nfamily = "shared_prefix"\n', "shared_prefix_tokens"),
    ('concurrency = [1]\nload_profile = "burst"\n', "load_profile"),
])
def test_workload_errors_name_the_field(tmp_path, toml, field):
    path = tmp_path / "w.toml"
    path.write_text('name = "w"\nseed = 1\nprompt_tokens = [16]\noutput_tokens = 4\n' + toml)
    with pytest.raises(WorkloadError, match=field):
        load(str(path))
