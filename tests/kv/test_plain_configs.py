"""Issue 36 item 5: a plain config (a model type whose file states every field its class would fill) is read
without importing transformers, and the reading is the one transformers' own class gives: the same geometry,
notes, weights and widths, for every such config of the corpus and the catalog."""
import json
import subprocess
import sys

import pytest

from kvbench.kv import config_hf, model_config
from kvbench.planner import CATALOG_DIR, resolve_model

from tests.helpers import DATA

CONFIGS = [*sorted((DATA / "configs").glob("*.json")), *sorted(CATALOG_DIR.glob("*.json"))]
PLAIN = [p for p in CONFIGS if model_config.plain_config(json.loads(p.read_text())) is not None]


def _read(path, monkeypatch, plain: bool):
    monkeypatch.setattr(config_hf, "READ_PLAIN", plain)  # read where hf_config reads it
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
                                    {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                                         "sliding_attention": {"rope_type": "default"}}},
                                    {"use_sliding_window": True}, {"layer_types": ["full_attention"] * 28}])
def test_what_a_class_derives_goes_through_the_class(change):
    raw = json.loads((CATALOG_DIR / "qwen2.5-7b.json").read_text())
    assert model_config.plain_config(raw) is not None
    assert model_config.plain_config({**raw, **change}) is None
    raw.pop("num_key_value_heads")  # a class default would fill it
    assert model_config.plain_config(raw) is None


def test_transformers_5s_flat_rope_parameters_read_plainly_as_the_class_reads_them(tmp_path, monkeypatch):
    """transformers 5 writes rope_parameters (rope_theta inside) where older files had rope_scaling: a single
    dict is read plainly, its yarn length as the class derives it (Qwen2.5's factor 4 on 32,768: 131,072)."""
    raw = json.loads((CATALOG_DIR / "qwen2.5-7b.json").read_text())
    raw.update(max_position_embeddings=32768, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                               "rope_theta": 1000000.0})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert model_config.plain_config(raw) is not None
    plain = _read(path, monkeypatch, True)
    assert plain == _read(path, monkeypatch, False) and plain[0].max_context == 131072


def test_plan_of_a_catalog_model_imports_no_transformers():
    code = ("import sys; from kvbench.cli import app\n"
            "try:\n    app(['plan', 'llama-3.1-8b', '-n', '8k', '--engine', 'vllm', '--gpu', 'H100-80GB'])\n"
            "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "print('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_a_gguf_header_reads_as_ggufs_reader_reads_it():
    """The embedded model's GGUF read in one pass without gguf's reader (numpy, seconds for its 49K-token
    vocabulary): the same keys as GGUFReader's fields, the same tensor values and bytes (gguf's block sizes)."""
    from kvbench.common.models import embedded_gguf

    path = embedded_gguf("smollm2")
    reader = model_config.gguf_reader(path)
    fields = {name: f.contents() for name, f in reader.fields.items()
              if not name.startswith("tokenizer.ggml.") or name == "tokenizer.ggml.model"}
    assert model_config.gguf_keys(path) == fields
    assert model_config.gguf_tensors(path) == [(int(t.n_elements), int(t.n_bytes)) for t in reader.tensors]


def test_plan_of_the_embedded_model_imports_no_numpy_gguf_or_transformers():
    code = ("import sys; from kvbench.cli import app\n"
            "try:\n    app(['plan', 'smollm2', '-n', '4k', '--engine', 'llamacpp', '--gpu', 'L4'])\n"
            "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "print(sorted(m for m in ('numpy', 'gguf', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert done.stdout.strip().splitlines()[-1] == "[]"
