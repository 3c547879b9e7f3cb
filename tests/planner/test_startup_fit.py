"""The startup rules' fitted constants are the corpus's fit, and the leave-one-source-out accuracy never grows
(issue 50: a number fitted on one deployment is a guess about the next; users' hardware is the test)."""
from __future__ import annotations

import tomllib

import pytest

from kvbench.selfcheck import startup_fit as sf
from kvbench.selfcheck import startup_logs as sl

SLACK = 0.005  # GiB / points: rounding of the written figures


@pytest.fixture(scope="module")
def entries():
    return sl.corpus()


@pytest.fixture(scope="module")
def fits(entries):
    return sf.fit(sf.measurements(entries))


def test_each_engines_fitted_file_is_the_corpus_fit(fits):
    """fitted.toml is what `python -m kvbench.selfcheck.startup_fit --write` makes of the corpus: a constant no one
    edits by hand, with its sources and range."""
    modules = sf.engines_with_constants()
    for (engine, key), f in fits.items():
        record = modules[engine].FIT_RECORDS[key]
        assert record["sources"] == list(f.sources) and record["deployments"] == f.deployments, key
        if f.value is not None:
            assert record["value"] == f.value and (record["low"], record["high"]) == (f.low, f.high), key
            assert f.low <= f.value <= f.high
        assert modules[engine].FITTED[key] == record["value"]
    declared = {(e, fc.key) for e, m in modules.items() for fc in m.FITS}
    assert declared == set(fits), "every FITTED constant says how a log measures it (FITS)"


def test_a_constant_is_read_back_from_the_log_that_measures_it(entries):
    """The secant finds the value a log implies whatever the constant is set to."""
    entry = next(e for e in entries if e["file"] == "vllm-llmd-planner-0.19.0-llama3.1-8b-h100.toml")
    module = sf.engines_with_constants()["vllm"]
    fc = next(f for f in module.FITS if f.key == "non_torch_v018_tp1")
    for start in (0.05, 0.25, 3.0):
        with sf.patched({("vllm", fc.key): start}):
            assert sf.implied(entry, "vllm", fc, start) == pytest.approx(entry["logged"]["non_torch_gib"])
    assert module.FITTED[fc.key] == module.FIT_RECORDS[fc.key]["value"]  # patched() put it back
    other = next(f for f in module.FITS if f.key == "non_torch_v064")
    assert sf.implied(entry, "vllm", other, module.FITTED[other.key]) is None  # a 0.19 log says nothing of 0.6.4


def test_a_log_only_its_own_source_measures_a_constant_of_has_no_left_out_figure(entries):
    """Left out, a log whose plan reads a constant that no other source measures (vLLM 0.6.4's non-torch memory,
    measured by one issue's logs alone) is not planned with that source's own fit: it counts as not planned."""
    held = sf.loso_figures(entries)
    own = "vllm-10517-llama3.1-8b-3090-20k.toml"
    assert held[own] == {"only_its_own_source": ["non_torch_v064"]}
    rows = [r for r in sf.all_rows() if r.log == own]
    pool = next(r for r in rows if r.check == "KV pool")
    assert pool.planned is not None and pool.loso is None and pool.ok_loso is None and "non_torch_v064" in pool.note
    acc = sf.accuracy(sf.all_rows())["rule vllm v0 dense"]
    assert acc["pools"] == 0 and acc["pools_own_source_only"] == 3
    other = next(e for e in entries if e["file"] == "vllm-tokenkaki-0.19.1-qwen3-8b-a100-40gb.toml")
    assert "only_its_own_source" not in held[other["file"]]  # measured by other sources too


def test_leave_one_source_out_accuracy_does_not_grow():
    """Per engine, per class and per rule class: the mean and the worst error of the KV budget planned without
    each log's own source stay at or under bench/planner/startup_accuracy.toml, and no fewer verdicts are right."""
    shipped = tomllib.loads(sf.ACCURACY_FILE.read_text())
    now = sf.accuracy(sf.all_rows())
    assert set(shipped) <= set(now)
    for name, was in shipped.items():
        got = now[name]
        if was.get("mae_gib") is not None:
            assert got["mae_gib"] <= was["mae_gib"] + SLACK and got["worst_gib"] <= was["worst_gib"] + SLACK, name
        assert got["verdicts_right"] >= was["verdicts_right"] and got["within_tolerance"] >= was["within_tolerance"]
        assert got.get("buffers_within", 0) >= was.get("buffers_within", 0), name
    assert {"engine vllm", "engine sglang", "class moe", "class mla", "class tp>1", "class consumer",
            "class quantised", "class hybrid"} <= set(now)


def test_the_plan_states_its_classes_error():
    from typer.testing import CliRunner

    from kvbench.cli import app
    from tests.helpers import plan_lines
    r = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "H100-80GB",
                                 "--max-model-len", "8192"])
    line = plan_lines(r.output)["limit"]
    assert "public startup logs of class 'vllm v1 dense'" in line and "at worst" in line
