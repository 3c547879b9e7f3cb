"""The fourth fault matrix, B (from the third, still failing then): a model config whose RoPE factor is 1e300,
1e400 (JSON's infinity), NaN or not a number: one clear line and exit 2 from the KV model's config checks
(bench/kv/config_checks.py), not a traceback or a context of 4 x 10^303 tokens."""
from __future__ import annotations

import json

import pytest

from tests.helpers import DATA, kvbench_here


@pytest.mark.parametrize("factor, said", [
    ("1e300", "rope_scaling.factor 1e+300 is not a RoPE scaling of any model"),
    ("1e400", "rope_scaling.factor inf is not a RoPE scaling of any model"),
    ("NaN", "rope_scaling.factor nan is not a RoPE scaling of any model"),
    ("-2", "rope_scaling.factor -2 is not a RoPE scaling of any model"),
    ('"40"', "rope_scaling.factor must be a number, not '40'"),
], ids=["1e300", "1e400", "nan", "negative", "string"])
def test_a_rope_factor_no_model_has_is_one_line_and_exit_2(tmp_path, factor, said):
    config = json.loads((DATA / "configs" / "deepseek-v2-lite.json").read_text())
    config["rope_scaling"]["factor"] = 12345.5
    text = json.dumps(config).replace("12345.5", factor)
    (tmp_path / "config.json").write_text(text)
    done = kvbench_here("plan", tmp_path)
    assert done.returncode == 2, done.stdout
    lines = (done.stderr or done.stdout).strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in done.stdout, lines


def test_a_rope_factor_within_bounds_still_plans(tmp_path):
    config = json.loads((DATA / "configs" / "deepseek-v2-lite.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kvbench_here("plan", tmp_path).returncode == 0
