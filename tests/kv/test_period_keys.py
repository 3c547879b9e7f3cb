"""A period of layers (one whole number: every n-th layer is of a kind) read as the model's code reads it, and
one kvbench does not know refused as a period, not as a per-layer list. Phi-3-small's dense_attention_every_n_layers
(a real config.json, tests/data/configs/phi-3-small-8k-instruct.json) was refused as "looks per-layer": its
modeling code makes every n-th layer dense attention and the others block-sparse attention, and both write every
token's K and V to the layer's cache, so every layer caches KV at full length."""
import json

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.kv.model_config import ConfigError, geometry_from_hf_dict, parse_hf_dict, refuse_unread, unread_keys
from kvbench.planner import resolve_model

from tests.helpers import DATA

PHI3_SMALL = DATA / "configs" / "phi-3-small-8k-instruct.json"
KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head_dim x bf16 bytes: 131,072


def _raw(**change) -> dict:
    raw = json.loads(PHI3_SMALL.read_text())
    raw.pop("dense_attention_every_n_layers")
    return {**raw, **change}


def _plan(tmp_path, raw: dict, *args) -> tuple[int, str]:
    file = tmp_path / "config.json"
    file.write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["plan", str(file), "-n", "4096", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_phi3_small_is_planned_with_every_layer_caching_at_full_length():
    model = resolve_model(str(PHI3_SMALL))
    g = model.geometry
    assert (g.num_layers, g.count("full"), g.num_kv_heads, g.head_dim_k) == (32, 32, 8, 128), g.describe()
    assert model.unread_keys == () and model.verified
    result = CliRunner().invoke(app, ["plan", str(PHI3_SMALL), "-n", "4096", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["kv_bytes"] == 4096 * KV_PER_TOKEN and out["unread_keys"] == [] and out["verified"] is True


@pytest.mark.parametrize("every", [0, 1, 2, 4, 64])
def test_the_period_changes_which_layers_are_dense_not_which_cache(every):
    """(i + 1) % n == 0 picks the dense layers; 0 (its code's `if n and ...`) none. The block-sparse layers
    cache all the same: the geometry is the same for every period."""
    g = geometry_from_hf_dict(_raw(dense_attention_every_n_layers=every), "phi3small")
    assert g.num_layers == 32 and g.count("full") == 32


@pytest.mark.parametrize("every", [-1, 2.5, "2", [2] * 32, True])
def test_a_period_that_is_not_a_whole_number_is_refused_in_one_line(tmp_path, every):
    with pytest.raises(ConfigError, match="dense_attention_every_n_layers"):
        geometry_from_hf_dict(_raw(dense_attention_every_n_layers=every), "phi3small")
    code, out = _plan(tmp_path, _raw(dense_attention_every_n_layers=every))
    assert code == 2 and len(out.strip().splitlines()) == 1 and "dense_attention_every_n_layers" in out, out


@pytest.mark.parametrize("key", ["global_attn_every_n_layers", "full_attention_layer_period", "swa_interval",
                                 "attn_every_n"])
def test_an_unknown_period_is_refused_as_a_period(tmp_path, key):
    raw = _raw(**{key: 4})
    _, text, _ = parse_hf_dict(raw, "x")
    assert unread_keys(raw, text) == [key]
    code, out = _plan(tmp_path, raw)
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"{key} is a period of layers" in out and "does not know" in out and "looks per-layer" not in out


def test_a_list_named_like_a_period_still_looks_per_layer(tmp_path):
    code, out = _plan(tmp_path, _raw(global_attn_every_n_layers=[0, 1] * 16))
    assert code == 2 and "global_attn_every_n_layers looks per-layer and kvbench does not read it" in out, out


def test_periods_and_per_layer_keys_are_named_in_one_line():
    raw = _raw(swa_period=6, global_attn_layers=[3, 7])
    _, text, _ = parse_hf_dict(raw, "x")
    keys = unread_keys(raw, text)
    assert keys == ["global_attn_layers", "swa_period"]
    with pytest.raises(ConfigError) as refused:
        refuse_unread(keys, "x")
    line = str(refused.value)
    assert "\n" not in line and "global_attn_layers looks per-layer" in line and "swa_period is a period" in line
