"""Speculative decoding on a real llama-server (the embedded model): `-b llamacpp:speculative=ngram` on the
speculation workload's two prompt kinds, small, beside the same engine without a drafter. The copy cell's prompts (a passage given twice) make n-gram
lookup draft; the engine's own counts reach the rows: drafted > 0 and accepted <= drafted, the drafts from its
/metrics counters, the requests' counts adding up to the row's; the free cell, where nothing in the request
repeats, says 0 drafted (its counters read around the cell did not rise), not "not reported". The wire
formats alone: test_speculation.py."""
import io

import pytest
from rich.console import Console

from kvbench.reports import build
from kvbench.reports.speculation_paired import NOTHING_ACCEPTED
from kvbench.run.backend_config import BackendConfig, distinct_labels
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
    workload = load_workload("speculation")
    workload = workload.model_copy(update={"output_tokens": 16, "warmup_requests": 0,
                                           "load": workload.load.model_copy(update={"concurrency": [1], "requests": 2})})
    root = tmp_path_factory.mktemp("spec")
    backends = distinct_labels([BackendConfig.parse("llamacpp:speculative=ngram"), BackendConfig.parse("llamacpp")])
    opts = RunOptions(model="smollm2", workload=workload, backends=backends,
                      results_dir=root, run_id="spec", prompt_salt="none", start_timeout_s=120, request_timeout_s=120,
                      estimate=False)
    run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    cells = load_cells(run_dir)
    return run_dir, cells[cells.spec_method == "ngram"], load(run_dir, what="requests")


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


def test_each_cell_is_paired_with_the_same_cell_without_a_drafter(run):
    """The report's "did it pay off?": the plain engine of the run serves the same GGUF, so each drafted cell
    pairs with its cell, request by request (the same prompts)."""
    run_dir, cells, _ = run
    [section] = [s for s in build([run_dir]).sections if s.id == "speculation_paid_off"]
    table = section.table
    assert len(table) == len(cells) == 2
    assert set(table.backend) == {"llamacpp-0.3.36+speculative=ngram"}
    assert set(table.without) == {"llamacpp-0.3.36+default"}
    assert set(table.pairs) == {"2"}
    assert all(v == NOTHING_ACCEPTED or v in ("paid off", "cost", "no clear change") for v in table.verdict)
