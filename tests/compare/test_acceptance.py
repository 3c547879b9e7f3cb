"""`kvbench compare` gates a drafter's acceptance rate (bench/compare/runs.py): a drop is a regression, one value a
side compared as it is; compared only where both runs sent the same prompt tokens (one prompt salt), since each
run's own salt changes the tokens a drafter can guess. Synthetic runs: every figure is made up for the test."""
import json

from tests.compare.test_runs import as_json, kvbench
from tests.synth import make_run


def speculating(root, run_id, version, acceptance, salt):
    run = make_run(root, run_id, backends=(("llamacpp", version),), prompts=(128,), concurrency=(1,), repeats=1,
                   n_requests=4)
    rows = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines()]
    for r in rows:
        r.update(spec_method="ngram", spec_draft_tokens=100, spec_accepted_tokens=round(100 * acceptance),
                 spec_acceptance_rate=acceptance)
    (run / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = json.loads((run / "run.json").read_text())
    info["prompt_salt"] = {"value": salt, "in_tokens": True}
    (run / "run.json").write_text(json.dumps(info))
    return run


def acceptance(result) -> dict:
    [cell] = result["cells"]
    return next(m for m in cell["metrics"] if m["metric"] == "spec_acceptance_rate")


def test_a_drop_in_acceptance_with_the_same_prompts_is_a_regression(tmp_path):
    base = speculating(tmp_path, "b", "0.3.35", 0.40, "s1")
    cand = speculating(tmp_path, "c", "0.3.36", 0.20, "s1")
    m = acceptance(as_json(kvbench("compare", base, cand, "--format", "json")))
    assert (m["baseline"], m["candidate"], m["verdict"]) == (0.40, 0.20, "regression")
    assert m["change"] == -0.5


def test_acceptance_of_other_prompts_is_not_compared_and_says_why(tmp_path):
    base = speculating(tmp_path, "b", "0.3.35", 0.40, "s1")
    cand = speculating(tmp_path, "c", "0.3.36", 0.0, "s2")
    out = kvbench("compare", base, cand, "--format", "json")
    result = as_json(out)
    m = acceptance(result)
    assert m["verdict"] == "not compared" and "prompt salts ['s1'] and ['s2']" in m["note"]
    assert m["change"] is None and not result["regression_found"]
    assert "not compared" in kvbench("compare", base, cand).stdout  # the Markdown says so too
