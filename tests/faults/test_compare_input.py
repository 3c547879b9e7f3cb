"""The third fault matrix's `kvbench compare` and `report` input (docs/fault-matrix.md, "Compare's exit
codes"): bad input is exit 2, never 1 (1 means REGRESSION to a CI gate); different models are named;
the same model name over other files is said."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from tests.synth import make_run


def kvbench(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    base = make_run(root, "base", repeats=2, prompts=(1024,), concurrency=(1,), n_requests=4, seed=1)
    cand = make_run(root, "cand", backends=(("vllm", "0.32.0"),), repeats=2, prompts=(1024,), concurrency=(1,),
                    n_requests=4, seed=2)
    return base, cand


def copy_run(run: Path, to: Path) -> Path:
    to.mkdir()
    for f in run.iterdir():
        if f.is_file():
            (to / f.name).write_bytes(f.read_bytes())
    return to


def one_error_line(out) -> str:
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.output
    assert "Traceback" not in out.output
    return lines[0]


def test_the_good_pair_compares(runs):
    out = kvbench("compare", *runs, "--format", "json")
    assert out.exit_code in (0, 3, 4), out.output  # the fixture itself is sound


@pytest.mark.parametrize("field, value", [
    ("environment", "a string"), ("model", 5), ("model", {"name": 3}), ("interleaved", [1]), ("run_id", 7),
    ("invocations", "x"), ("engine_versions", [1, 2]), ("environment", {"cpu_flags": "avx2"}),
    ("backends", {"a": 1}), ("repeats", "three"),
])
def test_a_run_json_of_the_wrong_types_is_exit_2_for_compare_and_no_crash_for_report(runs, tmp_path, field, value):
    cand = copy_run(runs[1], tmp_path / "cand")
    info = json.loads((cand / "run.json").read_text())
    info[field] = value
    (cand / "run.json").write_text(json.dumps(info))
    out = kvbench("compare", runs[0], cand)
    assert out.exit_code == 2, out.output
    line = one_error_line(out)
    assert "run.json: a field of the wrong type" in line and field in line, line
    # report reads the intact cells, as for a truncated run.json, and says why run.json was set aside
    # (it used to crash with a traceback)
    out = kvbench("report", cand, "-o", tmp_path / "r.md", "--no-plots", "--raw")
    assert out.exit_code == 0 and "Traceback" not in out.output, out.output
    text = (tmp_path / "r.md").read_text()
    assert f"`cand` (unknown: {cand}/run.json: a field of the wrong type" in text and "| vllm-0.32.0 | 1024 |" in text


@pytest.mark.parametrize("text, said", [
    ("[tolerance]\nttft_s_p50 = nan\n", "finite number >= 0"),
    ("[tolerance]\nttft_s_p50 = inf\n", "finite number >= 0"),
    ("[tolerance]\nttft_s_p50 = -0.05\n", "finite number >= 0"),
    ("[tolerance]\nttft_s_p50 = \"5%\"\n", "finite number >= 0"),
    ("confidence = nan\n", "confidence must be between 0 and 1"),
    ("confidence = true\n", "confidence must be between 0 and 1"),
    ("tolerance = 3\n", "[tolerance] and [match] must be tables"),
    ("[match]\nfields = \"model\"\n", "must be a list of field names"),
    ("[match]\nfields = [1, 2]\n", "must be a list of field names"),
    ("a = " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper than 64 levels"),
])
def test_a_bad_tolerances_file_is_exit_2(runs, tmp_path, text, said):
    tolerances = tmp_path / "tol.toml"
    tolerances.write_text(text)
    out = kvbench("compare", *runs, "--tolerances", tolerances)
    assert out.exit_code == 2, out.output
    assert said in one_error_line(out)


def test_a_tolerances_fifo_or_device_is_refused_without_blocking(runs, tmp_path):
    fifo = tmp_path / "tol.fifo"
    import os
    os.mkfifo(fifo)
    zero = tmp_path / "zero.toml"
    zero.symlink_to("/dev/zero")
    for path, kind in ((fifo, "a FIFO"), (zero, "a character device")):
        out = kvbench("compare", *runs, "--tolerances", path)
        assert out.exit_code == 2 and f"is {kind}, not a regular file" in one_error_line(out)


def _set_model(run: Path, name: str, sha256: str) -> None:
    info = json.loads((run / "run.json").read_text())
    info["model"] = {**info["model"], "name": name, "sha256": sha256}
    (run / "run.json").write_text(json.dumps(info))
    lines = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines()]
    (run / "cells.jsonl").write_text("".join(json.dumps({**row, "model": name}) + "\n" for row in lines))
    (run / "cells.parquet").unlink(missing_ok=True)


def test_two_runs_of_different_models_are_refused_naming_both(runs, tmp_path):
    cand = copy_run(runs[1], tmp_path / "cand")
    _set_model(cand, "qwen2.5-0.5b", "cd" * 32)
    out = kvbench("compare", runs[0], cand)
    assert out.exit_code == 2, out.output
    line = one_error_line(out)
    assert "DIFFERENT MODELS: the baseline ran smollm2 (sha256 abababababab...)" in line
    assert "the candidate qwen2.5-0.5b (sha256 cdcdcdcdcdcd...)" in line


def test_the_same_model_name_over_other_files_is_said(runs, tmp_path):
    cand = copy_run(runs[1], tmp_path / "cand")
    _set_model(cand, "smollm2", "ef" * 32)
    out = kvbench("compare", runs[0], cand, "--format", "json")
    assert out.exit_code in (0, 1, 3, 4), out.output
    assert f"SAME MODEL NAME, OTHER FILES: smollm2 is sha256 {'ab' * 32} in the baseline and {'ef' * 32}" in out.output


def test_an_unforeseen_failure_inside_compare_is_exit_2_not_1(runs, monkeypatch):
    import kvbench.commands.compare as command

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for -: 'str' and 'float'")
    monkeypatch.setattr(command, "run_compare", broken)
    out = kvbench("compare", *runs)
    assert out.exit_code == 2
    assert "TypeError" in one_error_line(out)


@pytest.mark.parametrize("where", ["markdown", "write_html", "write_outputs"])
def test_a_failure_while_writing_the_comparison_is_exit_2_not_1(runs, monkeypatch, tmp_path, where):
    """Only loading and comparing were guarded: an exception in the Markdown, the HTML page or the output
    folder was a traceback and exit 1, which a CI gate reads as REGRESSION."""
    import kvbench.commands.compare as command

    def broken(*args, **kwargs):
        raise KeyError("a column the renderer expected")
    monkeypatch.setattr(command, where, broken)
    out = kvbench("compare", *runs, "--html", tmp_path / "c.html", "-o", tmp_path / "out")
    assert out.exit_code == 2, out.output
    line = [line for line in out.output.splitlines() if line.startswith("error: ")]
    assert len(line) == 1 and "the report could not be written (KeyError" in line[0] and "verdict: " in line[0]
    assert "Traceback" not in out.output
