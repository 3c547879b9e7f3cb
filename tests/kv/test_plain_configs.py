"""Issue 36 item 5: a plain config (a model type whose file states every field its class would fill) is read
without importing transformers, and the reading is the one transformers' own class gives: the same geometry,
notes, weights and widths, for every such config of the corpus and the catalog."""
import json
import subprocess
import sys

import pytest

from kvbench.kv import model_config
from kvbench.planner import CATALOG_DIR, resolve_model

from tests.helpers import DATA

CONFIGS = [*sorted((DATA / "configs").glob("*.json")), *sorted(CATALOG_DIR.glob("*.json"))]
PLAIN = [p for p in CONFIGS if model_config.plain_config(json.loads(p.read_text())) is not None]


def _read(path, monkeypatch, plain: bool):
    monkeypatch.setattr(model_config, "READ_PLAIN", plain)
    m = resolve_model(str(path))
    return m.geometry, m.weights, m.widths, m.unread_keys, m.weights_at("fp8").bytes


def test_the_plain_reader_covers_every_catalog_model():
    """Issue 36 item 5: every catalog model is read without importing transformers (its derived layer_types,
    RoPE lengths and multimodal wrapper as its class derives them, checked equal below)."""
    assert {p.stem for p in PLAIN if p.parent == CATALOG_DIR} == {p.stem for p in CATALOG_DIR.glob("*.json")}


@pytest.mark.parametrize("path", PLAIN, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_plain_config_reads_as_transformers_class_reads_it(path, monkeypatch):
    plain = _read(path, monkeypatch, True)
    assert isinstance(model_config.hf_config(json.loads(path.read_text()), "x")[0], model_config.PlainConfig)
    assert plain == _read(path, monkeypatch, False)


@pytest.mark.parametrize("change", [{"rope_scaling": {"rope_type": "longrope", "factor": 4.0,
                                                      "original_max_position_embeddings": 32768}},
                                    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
                                    {"use_sliding_window": True}, {"layer_types": ["full_attention"] * 28}])
def test_what_a_class_derives_goes_through_the_class(change):
    raw = json.loads((CATALOG_DIR / "qwen2.5-7b.json").read_text())
    assert model_config.plain_config(raw) is not None
    assert model_config.plain_config({**raw, **change}) is None
    raw.pop("num_key_value_heads")  # a class default would fill it
    assert model_config.plain_config(raw) is None


def test_plan_of_a_catalog_model_imports_no_transformers():
    code = ("import sys; from kvbench.cli import app\n"
            "try:\n    app(['plan', 'llama-3.1-8b', '-n', '8k', '--engine', 'vllm', '--gpu', 'H100-80GB'])\n"
            "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "print('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
