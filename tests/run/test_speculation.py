"""A cell's speculation columns from what the engine reported (bench/run/speculation.py, docs/speculation.md):
each figure's arithmetic on counts chosen so that a wrong formula gives another number, where the figures
come from (the requests' own counts, else the counters' rise), "not reported" only where the engine said
nothing, and the speculation options refused in one line (exit 2) where an engine lacks the method. The
engines' wire formats: tests/backends/llamacpp/test_speculation.py, tests/backends/vllm/test_speculation.py."""
import pytest

from kvbench.backends.types import RequestResult, SpeculationCounters
from kvbench.run.backend_config import BackendConfig, ConfigError
from kvbench.run.speculation import (
    Drafted,
    acceptance_rate,
    counter_rise,
    measured,
    speculation_columns,
    steps_per_output_token,
    tokens_per_step,
)
from kvbench.store.schema import CellRow

from tests.helpers import kvbench_here

SOURCE = "the counters (test)"


def request(i: int, output: int, drafted: int | None = None, accepted: int | None = None) -> RequestResult:
    r = RequestResult(f"r{i}", 128, output, 0.0, chunk_times=[0.1 * (k + 1) for k in range(output)],
                      chunk_tokens=[1] * output, t_done=0.1 * output + 0.01)
    r.spec_draft_tokens, r.spec_accepted_tokens = drafted, accepted
    return r


def counters(drafted: float, accepted: float, drafts: float | None) -> SpeculationCounters:
    return SpeculationCounters(drafted, accepted, drafts, SOURCE)


def row(**kw) -> CellRow:
    return CellRow(run_id="t", cell_id="c", backend="llamacpp-0.3.36", engine="llamacpp", engine_version="0.3.36",
                   model="smollm2", workload="speculation", prompt_tokens=128, output_tokens=32, concurrency=1,
                   kv_dtype="f16", status="ok", **kw)


# --- each figure's arithmetic ------------------------------------------------------------------------------------

def test_acceptance_is_accepted_over_drafted():
    assert acceptance_rate(Drafted(23, 16, 7, SOURCE)) == pytest.approx(16 / 23)
    assert acceptance_rate(Drafted(30, 0, 1, SOURCE)) == 0.0
    assert acceptance_rate(Drafted(0, 0, 0, SOURCE)) is None  # nothing drafted: no rate, not 0 %


def test_tokens_a_step_is_one_plus_accepted_over_drafts():
    # 7 verification steps accepted 16 drafts between them, each step also yields the target's own token
    assert tokens_per_step(Drafted(23, 16, 7, SOURCE)) == pytest.approx(1 + 16 / 7)
    assert tokens_per_step(Drafted(30, 0, 1, SOURCE)) == 1.0
    assert tokens_per_step(Drafted(23, 16, None, SOURCE)) is None  # the engine does not count its drafts
    assert tokens_per_step(Drafted(0, 0, 0, SOURCE)) is None


def test_target_passes_a_token_is_output_less_accepted_over_output():
    assert steps_per_output_token(Drafted(23, 16, 7, SOURCE), 24) == pytest.approx((24 - 16) / 24)
    assert steps_per_output_token(Drafted(30, 0, 1, SOURCE), 32) == 1.0  # nothing accepted: one pass a token
    assert steps_per_output_token(Drafted(23, 16, 7, SOURCE), 0) is None  # no output
    # more accepted than generated: counters that counted another client's requests too
    assert steps_per_output_token(Drafted(60, 40, 9, SOURCE), 32) is None


# --- where the figures come from ---------------------------------------------------------------------------------

def test_counter_rise_is_the_difference_over_the_cell():
    d = counter_rise(counters(100, 50, 20), counters(123, 66, 27))
    assert (d.draft_tokens, d.accepted_tokens, d.drafts, d.source) == (23, 16, 7, SOURCE)
    assert counter_rise(counters(100, 50, None), counters(123, 66, None)).drafts is None
    assert counter_rise(None, counters(123, 66, 27)) is None and counter_rise(counters(1, 1, 1), None) is None
    assert counter_rise(counters(100, 50, 20), counters(100, 50, 20)) is None  # nothing drafted


def test_the_requests_own_counts_win_and_the_drafts_come_from_the_counters():
    # llama.cpp: per request; the counters rose by other figures (a warmup), so only their drafts are taken
    results = [request(0, 24, 23, 16), request(1, 24), request(2, 24, 5, None)]
    d = measured(results, counters(0, 0, 0), counters(99, 99, 7))
    assert (d.draft_tokens, d.accepted_tokens, d.drafts) == (28, 16, 7)
    assert d.source.startswith("drafted/accepted tokens per request (2 of 3 requests drafted); drafts: ")
    # no counters: per request only, no drafts
    d = measured(results, None, None)
    assert (d.draft_tokens, d.accepted_tokens, d.drafts) == (28, 16, None) and "drafts:" not in d.source
    # vLLM: no request says anything, the counters' rise is the cell's
    d = measured([request(0, 24)], counters(10, 4, 3), counters(27, 15, 8))
    assert (d.draft_tokens, d.accepted_tokens, d.drafts, d.source) == (17, 11, 5, SOURCE)
    assert measured([request(0, 24)], None, None) is None


# --- the row -----------------------------------------------------------------------------------------------------

def test_a_row_from_per_request_counts_and_the_counters():
    r = row()
    results = [request(0, 24, 23, 16), request(1, 24)]  # 48 output tokens, 16 accepted
    speculation_columns(r, "ngram", True, results, (counters(100, 50, 20), counters(123, 66, 27)))
    assert r.spec_method == "ngram"
    assert (r.spec_draft_tokens, r.spec_accepted_tokens, r.spec_drafts) == (23, 16, 7)
    assert r.spec_acceptance_rate == pytest.approx(16 / 23)
    assert r.spec_tokens_per_step == pytest.approx(1 + 16 / 7)
    assert r.spec_steps_per_output_token == pytest.approx((48 - 16) / 48)
    assert "1 of 2 requests drafted" in r.spec_source


def test_a_row_from_the_counters_alone():
    r = row()
    speculation_columns(r, "draft", True, [request(0, 32), request(1, 32)], (counters(0, 0, 0), counters(30, 21, 10)))
    assert (r.spec_draft_tokens, r.spec_accepted_tokens, r.spec_drafts) == (30, 21, 10)
    assert r.spec_acceptance_rate == pytest.approx(0.7)
    assert r.spec_tokens_per_step == pytest.approx(3.1)
    assert r.spec_steps_per_output_token == pytest.approx((64 - 21) / 64)
    assert r.spec_source == SOURCE


def test_a_drafter_that_drafted_nothing_says_zero_not_not_reported():
    """Free text on llama.cpp's n-gram drafter: no request drafted, and /metrics says so (its counters were
    read around the cell and did not rise): 0 drafted, one target pass a token, no acceptance rate."""
    r = row()
    speculation_columns(r, "ngram", True, [request(0, 32), request(1, 32)], (counters(30, 0, 1), counters(30, 0, 1)))
    assert (r.spec_draft_tokens, r.spec_accepted_tokens, r.spec_drafts) == (0, 0, 0)
    assert r.spec_acceptance_rate is None and r.spec_tokens_per_step is None
    assert r.spec_steps_per_output_token == 1.0
    assert r.spec_source == SOURCE


def test_not_reported_only_where_a_drafter_ran_and_the_engine_said_nothing():
    said_nothing = row()
    speculation_columns(said_nothing, "ngram", True, [request(0, 32)], (None, None))
    assert said_nothing.spec_method == "ngram" and said_nothing.spec_source == "not reported"
    assert said_nothing.spec_draft_tokens is None and said_nothing.spec_acceptance_rate is None
    # counters read once only (a failed read after the cell): nothing is made of them
    once = row()
    speculation_columns(once, "ngram", True, [request(0, 32)], (counters(5, 1, 1), None))
    assert once.spec_source == "not reported" and once.spec_draft_tokens is None
    # no drafter (llama-server exports its counters at 0 all the same), or an engine without speculation
    for method, can in (("", True), ("", False)):
        plain = row()
        speculation_columns(plain, method, can, [request(0, 32)], (counters(0, 0, 0), counters(0, 0, 0)))
        assert plain.spec_method == "" and plain.spec_source is None and plain.spec_draft_tokens is None
        assert plain.spec_steps_per_output_token is None


# --- refused in one line where the engine lacks the method -------------------------------------------------------

@pytest.mark.parametrize("backend, says", [
    ("hf:speculative=ngram", "option 'speculative': the hf adapter has no speculative decoding"),
    ("ollama:speculative=ngram", "option 'speculative': the ollama adapter has no speculative decoding"),
    ("tgi:draft_model=/tmp", "option 'draft_model': the tgi adapter has no speculative decoding"),
    ("llamacpp:speculative=eagle", "option 'speculative' for llamacpp takes one of none, ngram, draft, not 'eagle'"),
    ("vllm:speculative=eagle", "vllm: speculative=eagle needs draft_model=PATH"),
    ("llamacpp:speculative_tokens=4", "llamacpp: speculative_tokens without a drafter: give speculative=ngram|draft"),
    ("vllm:speculative=ngram,draft_model=/tmp", "vllm: draft_model is the drafter of speculative=draft or eagle, "
                                                "not of speculative=ngram"),
    ("llamacpp:speculative=ngram,speculative_tokens=65", "takes an integer up to 64, not 65"),
])
def test_speculation_options_an_engine_cannot_take_are_refused(backend, says):
    with pytest.raises(ConfigError, match="^[^\n]*$") as refused:
        BackendConfig.parse(backend)
    assert says in str(refused.value)


def test_a_draft_model_that_is_not_the_engines_kind_is_refused(tmp_path):
    not_gguf = tmp_path / "draft.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        BackendConfig.parse(f"llamacpp:speculative=draft,draft_model={not_gguf}")
    with pytest.raises(ConfigError, match=r"no config.json in it \(vLLM's drafter is an HF folder\)"):
        BackendConfig.parse(f"vllm:speculative=draft,draft_model={tmp_path}")
    (tmp_path / "config.json").write_text("{}")
    assert BackendConfig.parse(f"vllm:speculative=draft,draft_model={tmp_path}").options["speculative"] == "draft"


def test_kvbench_run_refuses_them_with_exit_2_in_one_line(tmp_path):
    for backend, says in (("hf:speculative=ngram", "the hf adapter has no speculative decoding"),
                          ("ollama:speculative=draft", "the ollama adapter has no speculative decoding")):
        r = kvbench_here("run", "-b", backend, "--workload", "speculation", "--results-dir", tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr
        error = [line for line in (r.stderr or r.stdout).splitlines() if line.strip()]
        assert len(error) == 1 and says in error[0], error
    assert not any(tmp_path.iterdir())  # refused before a run folder was made
