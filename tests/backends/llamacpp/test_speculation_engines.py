"""Speculative decoding on a real llama-server (the embedded model): `-b llamacpp:speculative=ngram` on the
speculation workload's two prompt kinds, small. The copy cell's prompts (a passage given twice) make n-gram
lookup draft; the engine's own counts reach the rows: drafted > 0 and accepted <= drafted, the drafts from its
/metrics counters, the requests' counts adding up to the row's; the free cell, where nothing in the request
repeats, says 0 drafted (its counters read around the cell did not rise), not "not reported". The wire
formats alone: test_speculation.py."""
import io

import pytest
from rich.console import Console

from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load, load_cells
from kvbench.workloads import load as load_workload

from tests.helpers import engine_env

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2):
    engine_env("llamacpp")
    # the workload's prompts unsalted (its seed, 128 tokens, both kinds: the same tokens every time), fewer
    # output tokens, no warmup
    workload = load_workload("speculation").model_copy(update={"output_tokens": 16, "warmup_requests": 0,
                                                               "requests": 2})
    root = tmp_path_factory.mktemp("spec")
    opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse("llamacpp:speculative=ngram")],
                      results_dir=root, run_id="spec", prompt_salt="none", start_timeout_s=120, request_timeout_s=120,
                      estimate=False)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    return run_dir, load_cells(run_dir), load(run_dir, what="requests")


def test_the_copy_cell_drafted_and_the_engine_said_how_much_was_accepted(run):
    _, cells, requests = run
    assert set(cells.status) == {"ok"}, cells.error.tolist()
    assert set(cells.spec_method) == {"ngram"}
    copy = cells[cells.variant.str.contains("prompt=copy")].iloc[0]
    assert "speculative=ngram" in copy.variant
    assert copy.spec_draft_tokens > 0, copy.spec_source
    assert 0 <= copy.spec_accepted_tokens <= copy.spec_draft_tokens
    assert copy.spec_acceptance_rate == pytest.approx(copy.spec_accepted_tokens / copy.spec_draft_tokens)
    # the drafts (verification steps) from /metrics: at least one, and no more than the tokens drafted
    assert 1 <= copy.spec_drafts <= copy.spec_draft_tokens
    assert copy.spec_source.startswith("drafted/accepted tokens per request")
    assert "llamacpp:spec_decode_num_drafts_total" in copy.spec_source
    # the row is the sum of its requests' own counts (timings.draft_n of each last event)
    mine = requests[(requests.cell_id == copy.cell_id) & ~requests.warmup]
    assert mine.spec_draft_tokens.sum() == copy.spec_draft_tokens
    assert mine.spec_accepted_tokens.sum() == copy.spec_accepted_tokens
    output = mine.output_tokens_received.sum()
    assert copy.spec_steps_per_output_token == pytest.approx((output - copy.spec_accepted_tokens) / output)


def test_the_free_cell_says_what_it_drafted(run):
    _, cells, _ = run
    free = cells[cells.variant.str.contains("prompt=free")].iloc[0]
    assert free.spec_source != "not reported" and free.spec_draft_tokens >= 0
    assert 0 <= free.spec_accepted_tokens <= free.spec_draft_tokens
