"""The report's speculative-decoding section (bench/reports/speculation.py) from synthetic rows: shown only when
a cell was started with a drafter or reports drafts, each column as the row's figure formatted, a plain engine
beside it as "none (or not known)", "not reported" kept as the engine's word. Every number is made up."""
import json

from kvbench.reports import build, markdown
from kvbench.reports import speculation as s
from kvbench.reports.tables import aggregate
from kvbench.store.readers import load

from tests.synth import make_run

NGRAM = {"spec_method": "ngram", "spec_draft_tokens": 23, "spec_accepted_tokens": 16, "spec_drafts": 7,
         "spec_acceptance_rate": 16 / 23, "spec_tokens_per_step": 1 + 16 / 7, "spec_steps_per_output_token": 1 / 3,
         "spec_source": "drafted/accepted tokens per request (1 of 2 requests drafted)"}


def run_with(tmp_path, spec_by_backend: dict):
    """A synthetic run of llama.cpp and vLLM (one cell each), each row given ``spec_by_backend[label]``."""
    run = make_run(tmp_path, "spec", backends=(("llamacpp", "0.3.36"), ("vllm", "0.32.0")), prompts=(128,),
                   concurrency=(1,), repeats=1, n_requests=2)
    rows = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines()]
    for r in rows:
        r.update(spec_by_backend.get(r["backend"], {}))
    (run / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def section(report):
    return next((x for x in report.sections if x.id == "speculation"), None)


def test_the_section_shows_each_figure_beside_a_plain_engine(tmp_path):
    run = run_with(tmp_path, {"llamacpp-0.3.36": NGRAM})
    report = build([run])
    sec = section(report)
    assert sec is not None and sec.title == s.TITLE
    ids = [x.id for x in report.sections]
    assert ids.index("speculation") == ids.index("prefix_cache") + 1
    table = sec.table.set_index("backend")
    ngram, plain = table.loc["llamacpp-0.3.36"], table.loc["vllm-0.32.0"]
    assert (ngram["drafter"], ngram["drafted"], ngram["accepted"], ngram["drafts"]) == ("ngram", "23", "16", "7")
    assert ngram["acceptance"] == "69.6%"  # 16 / 23
    assert ngram["tokens a step"] == "3.29"  # 1 + 16 / 7
    assert ngram["target passes a token"] == "0.33"
    assert ngram["source"] == NGRAM["spec_source"]
    assert plain["drafter"] == "none (or not known)"
    assert (plain["drafted"], plain["acceptance"], plain["tokens a step"], plain["source"]) == ("-", "-", "-", "-")
    text = markdown.render(report, tmp_path)
    assert s.TITLE in text and "69.6%" in text


def test_not_reported_and_zero_drafted_are_told_apart(tmp_path):
    nothing = {"spec_method": "ngram", "spec_source": "not reported"}
    zero = {"spec_method": "ngram", "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_drafts": 0,
            "spec_steps_per_output_token": 1.0, "spec_source": "llamacpp:spec_decode_num_draft_tokens_total (...)"}
    table = section(build([run_with(tmp_path, {"llamacpp-0.3.36": zero, "vllm-0.32.0": nothing})])).table
    table = table.set_index("backend")
    assert (table.loc["llamacpp-0.3.36", "drafted"], table.loc["llamacpp-0.3.36", "acceptance"]) == ("0", "-")
    assert table.loc["llamacpp-0.3.36", "target passes a token"] == "1.00"
    assert (table.loc["vllm-0.32.0", "drafted"], table.loc["vllm-0.32.0", "source"]) == ("-", "not reported")


def test_no_section_without_a_drafter(tmp_path):
    report = build([run_with(tmp_path, {})])
    assert section(report) is None
    assert s.TITLE not in markdown.render(report, tmp_path)
    agg = aggregate(load(run_with(tmp_path / "b", {})))
    assert not s.speculated(agg)
    # a drafter alone (nothing reported yet) shows it; so do drafts on a row whose drafter is not known
    assert s.speculated(agg.assign(spec_method=["ngram", ""]))
    assert s.speculated(agg.assign(spec_draft_tokens=[5, None]))
    assert not s.speculated(agg.drop(columns=["spec_method"]))  # rows from before speculation was recorded


def test_a_failed_cell_shows_its_failure_and_no_figures(tmp_path):
    run = run_with(tmp_path, {"llamacpp-0.3.36": NGRAM | {"status": "failed", "error": "engine died"}})
    table = section(build([run])).table.set_index("backend")
    failed, plain = table.loc["llamacpp-0.3.36"], table.loc["vllm-0.32.0"]
    assert "engine died" in failed["failure"] and plain["failure"] == ""
    assert (failed["drafted"], failed["acceptance"], failed["tokens a step"]) == ("", "", "")
