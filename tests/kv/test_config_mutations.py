"""Issue 36 item 3: never silently wrong. Every real config of the corpus, mutated (lists for numbers,
numbers for lists, keys removed, zeros, negatives, huge values, strings, optional fields of the wrong type),
given to `kvbench plan` as a user would: exit 0 with an answer made of the file's own values (layers, KV heads,
the MLP width behind the weights, the vocabulary, the limit) or naming what is not (NOT VERIFIED, weights
unknown, no model limit), or exit 2 with one line; never a traceback, never a class default taken silently."""
import json
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.kv.model_config import MAX_LAYERS, ConfigError
from kvbench.planner import PlanError, PlanInput, plan, resolve_model

from tests.helpers import DATA

CORPUS = sorted((DATA / "configs").glob("*.json"))
KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "layer_types",
        "quantization_config", "torch_dtype", "rope_scaling", "kv_lora_rank", "moe_intermediate_size",
        "num_local_experts", "n_routed_experts", "attention_chunk_size", "tie_word_embeddings"]
VALUES = st.one_of(st.sampled_from([0, -1, 1, 10**6, 10**12, 2**63, "x", "float128", 1.5, True, None, {}, [],
                                    [1], [[1]], [1, 2]]),
                   st.integers(-10, 10**13), st.text(max_size=5))


def _body(raw: dict) -> dict:
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


@st.composite
def mutated(draw):
    path = draw(st.sampled_from(CORPUS))
    raw = json.loads(path.read_text())
    for _ in range(draw(st.integers(1, 3))):
        body = _body(raw)
        key = draw(st.sampled_from(KEYS))
        how = draw(st.sampled_from(["set", "delete", "per layer", "one of the list"]))
        if how == "delete":
            body.pop(key, None)
        elif how == "per layer" and isinstance(body.get(key), int):
            n = body.get("num_hidden_layers")
            body[key] = [body[key]] * (n if isinstance(n, int) and 0 < n < 200 else 3)
        elif how == "one of the list" and isinstance(body.get(key), list) and body[key]:
            body[key] = body[key][0]
        else:
            body[key] = draw(VALUES)
    return path.name, raw


def _answer(tmp_path, raw: dict):
    """The model and its plans under the plain formula and vLLM on a GPU, or the one-line refusal."""
    file = tmp_path / "config.json"
    file.write_text(json.dumps(raw))
    try:
        model = resolve_model(str(file))
        context = 8192 if (model.geometry.max_context or 0) >= 8192 else None
        plans = [plan(PlanInput(model=model, context=context)),
                 plan(PlanInput(model=model, context=context, engine="vllm", gpu="H100-80GB"))]
    except (PlanError, ConfigError) as exc:
        return str(exc)
    return model, plans


# the first is the common field; the others give the KV heads instead of it (DeciLM's block_configs per layer)
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num",
                "num_key_value_heads_per_layer", "multi_query", "new_decoder_architecture", "block_configs")
LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
              "max_context_length")


def _cli_plans(tmp_path, raw: dict) -> list[tuple[int, str]]:
    """kvbench plan on the file as a user runs it: the plain formula, then vLLM on a GPU (with its levers),
    each --json; (exit code, output)."""
    file = tmp_path / "config.json"
    file.write_text(json.dumps(raw))
    runner, out = CliRunner(), []
    for extra in ([], ["--engine", "vllm", "--gpu", "H100-80GB"]):
        result = runner.invoke(app, ["plan", str(file), "-n", "4096", "--allow-long-context", "--json", *extra],
                               env={"COLUMNS": "200"})
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            "".join(__import__("traceback").format_exception(result.exception))
        out.append((result.exit_code, result.output))
        if result.exit_code:
            break
    return out


def _check_values(name: str, original: dict, raw: dict, r: dict) -> None:
    """The answer is made of this file's values, or says which it is not: every field the plan rests on is
    the file's own, or named (NOT VERIFIED, weights unknown, no model limit), never a class default."""
    body, before = _body(raw), _body(original)
    nested = body is not raw
    layers = next((body[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in body), None)
    if isinstance(layers, int):
        assert r["decoder_layers"] == layers, (name, r["decoder_layers"])
    # MLA: the file's latent rank, or its model type's class constant named as assumed (NOT VERIFIED)
    mla = (isinstance(body.get("kv_lora_rank"), int) and body["kv_lora_rank"] > 0) \
        or "kv_lora_rank" in r["verdict"]["assumed_keys"]
    if not mla and "falcon" not in str(body.get("model_type")) and r["layers"]:
        given = body.get("num_key_value_heads")
        if isinstance(given, int) and not any(k in body for k in KV_HEAD_KEYS[1:]):
            assert r["kv_heads"] == given, (name, r["kv_heads"], given)
        elif not any(k in body for k in KV_HEAD_KEYS) and not nested:
            # no KV-head field: MHA as the model type reads it, said so, or a class's constant, named
            said = any("MHA" in n for n in r["notes"]) or "num_key_value_heads" in r["verdict"]["assumed_keys"]
            assert said, (name, r["notes"])
    if not nested and isinstance(before.get("intermediate_size"), int) and "intermediate_size" not in body \
            and r["weights_bytes"] is not None:
        assert not r["weights_source"].startswith("estimate"), (name, r["weights_source"])
    if not nested and not any(body.get(k) is not None for k in LIMIT_KEYS):
        assert r["max_context"] is None, (name, r["max_context"])  # not a class's default length
    if not nested and not any(body.get(k) is not None for k in ("vocab_size", "padded_vocab_size", "n_vocab")):
        assert r["weights_bytes"] is None or not r["weights_source"].startswith("estimate"), (name, r["weights_source"])


@settings(max_examples=200, database=None, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(mutated())
def test_every_mutated_config_is_answered_or_refused_in_one_line(tmp_path, case):
    """kvbench plan on every mutated config: exit 0 with an answer made of the file's values (or naming what
    is not), or exit 2 with one line; never a traceback."""
    name, raw = case
    original = json.loads((DATA / "configs" / name).read_text())
    started = time.perf_counter()
    for code, output in _cli_plans(tmp_path, raw):
        assert code in (0, 2), (name, code, output)
        if code == 2:
            lines = output.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in output, output
            break
        _check_values(name, original, raw, json.loads(output))
    assert time.perf_counter() - started < 10, f"{name}: took {time.perf_counter() - started:.1f} s"


@pytest.mark.parametrize("key", ["num_hidden_layers", "hidden_size", "num_attention_heads"])
def test_a_missing_required_field_is_named_not_taken_from_the_class(tmp_path, key):
    raw = json.loads((DATA / "configs" / "llama-3.1-70b.json").read_text())
    del raw[key]
    out = _answer(tmp_path, raw)
    assert isinstance(out, str) and key in out and "missing" in out


def test_a_missing_vocabulary_leaves_the_weights_unknown_not_guessed(tmp_path):
    """The KV does not read the vocabulary; the weights count would take LlamaConfig's 32,000: unknown, named."""
    raw = json.loads((DATA / "configs" / "llama-3.1-70b.json").read_text())
    del raw["vocab_size"]
    model, plans = _answer(tmp_path, raw)
    assert model.weights.bytes is None and "vocab_size" in model.weights.source
    assert plans[1]["verdict"]["word"] == "UNKNOWN"


def _cli(tmp_path, raw: dict, *args) -> tuple[int, str]:
    file = tmp_path / "config.json"
    file.write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["plan", str(file), *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_a_missing_mlp_width_leaves_the_weights_unknown_not_a_class_default(tmp_path):
    """Without intermediate_size, LlamaConfig's 11,008 made llama-3.1-70b 35.82 B parameters that "FITS" on
    one H100 in bf16: the weights are unknown, the key named, and no verdict is given."""
    raw = json.loads((DATA / "configs" / "llama-3.1-70b.json").read_text())
    del raw["intermediate_size"]
    code, out = _cli(tmp_path, raw, "-n", "8k", "--engine", "vllm", "--gpu", "H100-80GB", "--json")
    r = json.loads(out)
    assert code == 0 and r["weights_bytes"] is None and "intermediate_size" in r["weights_source"]
    assert r["fits"] is None and r["verdict"]["word"] == "UNKNOWN"
    code, text = _cli(tmp_path, raw, "-n", "8k", "--engine", "vllm", "--gpu", "H100-80GB")
    assert "FITS" not in text.replace("FIT UNKNOWN", "") and "intermediate_size" in text


def test_a_missing_limit_is_unknown_not_the_class_default(tmp_path):
    """Without max_position_embeddings the limit was LlamaConfig's 2,048, "the model's": now the model's limit is
    unknown, said so, and the length asked is planned as the limit."""
    raw = json.loads((DATA / "configs" / "llama-3.1-70b.json").read_text())
    del raw["max_position_embeddings"]
    code, out = _cli(tmp_path, raw, "-n", "8192", "--json")
    r = json.loads(out)
    assert code == 0 and r["max_context"] is None and r["max_model_len"] == 8192
    assert "2,048" not in r["max_model_len_source"] and "no limit" in r["max_model_len_source"]
    assert any(n.startswith("max_position_embeddings is not in the file") for n in r["notes"])
    code, out = _cli(tmp_path, raw)  # nothing asked and no limit known: one line, exit 2
    assert code == 2 and len(out.strip().splitlines()) == 1 and "max_position_embeddings" in out


@pytest.mark.parametrize("config, key, value", [("llama-3.1-70b.json", "num_key_value_heads", 64),
                                                ("qwen3-8b.json", "head_dim", 128),
                                                ("mistral-7b-instruct-v0.3.json", "num_key_value_heads", 8)])
def test_a_kv_field_the_class_fills_is_named_and_not_verified(tmp_path, config, key, value):
    """Without num_key_value_heads a 70B became MHA (8x the KV) with no note; Qwen3Config's head_dim 128 and
    MistralConfig's 8 KV heads are their defaults: each is named on the first line, --strict exits 3."""
    raw = json.loads((DATA / "configs" / config).read_text())
    del raw[key]
    code, out = _cli(tmp_path, raw, "-n", "4096", "--json")
    r = json.loads(out)
    assert code == 0 and r["verified"] is False and r["verdict"]["assumed_keys"] == [key]
    assert any(n.startswith(f"{key} is not in the file: ") and f"gives {value}" in n for n in r["notes"])
    code, text = _cli(tmp_path, raw, "-n", "4096")
    assert text.startswith(f"Asked (NOT VERIFIED: {key} not in the config (") and f"gives {value})" in text
    assert _cli(tmp_path, raw, "-n", "4096", "--strict")[0] == 3


def test_a_nested_text_config_leaves_out_its_class_defaults_and_says_so(tmp_path):
    # gemma-3-4b-it's text_config omits num_attention_heads (Gemma3TextConfig's 8): transformers writes a
    # nested config without the values equal to its class's defaults
    raw = json.loads((DATA / "configs" / "gemma-3-4b-it.json").read_text())
    model, _ = _answer(tmp_path, raw)
    assert any(n.startswith("num_attention_heads 8 from the Gemma3TextConfig class default") for n in
               model.geometry.notes)


def test_per_layer_widths_are_counted_per_layer(tmp_path):
    """A model type transformers does not know, with one intermediate size and KV-head count per layer: the
    weights count each layer at its own width (hand-worked: Llama 3.1 8B, the last 16 layers without an MLP
    and with 4 KV heads instead of 8)."""
    raw = json.loads((DATA / "configs" / "llama-3.1-8b.json").read_text())
    whole, _ = _answer(tmp_path, raw)
    raw.update(model_type="my_llama", intermediate_size=[14336] * 16 + [0] * 16,
               num_key_value_heads=[8] * 16 + [4] * 16)
    model, _ = _answer(tmp_path, raw)
    mlp = 3 * 4096 * 14336  # gate, up, down
    kv_proj = 2 * 4096 * 4 * 128  # k and v of the 4 KV heads a layer lost
    assert whole.weights.parameters - model.weights.parameters == 16 * (mlp + kv_proj)
    assert [layer.kv_heads for layer in model.geometry.layers] == [8] * 16 + [4] * 16


def test_per_layer_head_dims_and_windows_are_read_per_layer_for_any_model_type(tmp_path):
    """head_dim and sliding_window listed once per layer (null: full attention), on a model type transformers
    does not know: each layer at its own width and window (hand-worked on Llama 3.1 8B's 32 layers)."""
    raw = json.loads((DATA / "configs" / "llama-3.1-8b.json").read_text())
    raw.update(model_type="my_llama", head_dim=[128] * 16 + [64] * 16, sliding_window=[None, 4096] * 16)
    model, plans = _answer(tmp_path, raw)
    layers = model.geometry.layers
    assert [layer.head_dim_k for layer in layers] == [128] * 16 + [64] * 16
    assert [(layer.kind, layer.span) for layer in layers[:2]] == [("full", None), ("sliding", 4096)]
    # 8,192 tokens: 8 KV heads x 2 x 2 B per head width, 16 full layers and 16 windowed at 4,096
    full = sum(8 * 2 * 2 * hd for hd, kind in zip([128] * 16 + [64] * 16, ["full", "sliding"] * 16) if kind == "full")
    windowed = sum(8 * 2 * 2 * hd for hd, kind in zip([128] * 16 + [64] * 16, ["full", "sliding"] * 16)
                   if kind == "sliding")
    assert plans[0]["kv_bytes"] == 8192 * full + 4096 * windowed


def test_a_jamba_layout_of_a_model_type_transformers_does_not_know_is_read_as_jambas(tmp_path):
    """attn_layer_period / attn_layer_offset without transformers' class: layer i is attention where
    i % period == offset (JambaConfig.layers_block_type), the rest Mamba."""
    raw = json.loads((DATA / "configs" / "ai21-jamba-1.5-mini.json").read_text())
    builtin, _ = _answer(tmp_path, raw)
    raw["model_type"] = "my_jamba"
    model, _ = _answer(tmp_path, raw)
    assert [i for i, layer in enumerate(model.geometry.layers) if layer.stores] == [4, 12, 20, 28]
    assert model.geometry.layers == builtin.geometry.layers


@pytest.mark.parametrize("change, words", [
    ({"attn_type_list": [0, 2] * 40}, "attn_type_list must hold one 0"),
    ({"block_configs": [{"attention": {"no_op": False, "n_heads_in_group": None}}] * 80},
     "block_configs[0].attention.n_heads_in_group"),
    ({"attn_layer_period": 8, "attn_layer_offset": 9}, "attn_layer_offset 9 must be"),
    ({"sliding_window_pattern_per_layer": [1, 0] * 40}, "looks per-layer and kvbench does not read it")])
def test_a_layout_key_that_cannot_be_read_is_refused_by_name(tmp_path, change, words):
    raw = json.loads((DATA / "configs" / "minimax-text-01-reproduced.json").read_text())
    if "attn_type_list" not in change:
        raw.pop("attn_type_list")
    raw.update(change)
    code, out = _cli(tmp_path, raw, "-n", "4096")
    assert code == 2 and len(out.strip().splitlines()) == 1 and words in out, out


@pytest.mark.parametrize("layers", [10**6, 10**12])
def test_huge_layer_counts_answer_at_once(tmp_path, layers):
    raw = json.loads((DATA / "configs" / "llama-3.1-8b.json").read_text())
    raw["num_hidden_layers"] = layers
    started = time.perf_counter()
    out = _answer(tmp_path, raw)
    assert time.perf_counter() - started < 1
    assert isinstance(out, str) and f"{MAX_LAYERS:,}" in out


def test_a_thousand_layers_plan_in_linear_time(tmp_path):
    raw = json.loads((DATA / "configs" / "llama-3.1-8b.json").read_text())
    raw["num_hidden_layers"] = 1000
    model, plans = _answer(tmp_path, raw)
    assert plans[0]["layers"] == 1000 and plans[1]["levers"] is not None


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                                 "vocab_size"])
def test_a_zero_count_is_refused_not_planned_as_fitting_everything(tmp_path, key):
    # zeros used to give "FITS ... 1,048,576 requests at once"
    raw = json.loads((DATA / "configs" / "qwen2.5-7b.json").read_text())
    raw[key] = 0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "config.json"), "-n", "8k", "--gpu", "H100-80GB"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and ">= 1" in lines[0] and "FITS" not in result.output


@pytest.mark.parametrize("key, value, words", [("quantization_config", [1], "quantization_config is a list"),
                                               ("torch_dtype", "float128", "torch_dtype 'float128'"),
                                               ("num_key_value_heads", "8", "num_key_value_heads must be a whole")])
def test_wrong_typed_fields_are_one_line_and_exit_2(tmp_path, key, value, words):
    raw = json.loads((DATA / "configs" / "qwen2.5-7b.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "config.json"), "-n", "8k"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.output


def test_the_mutations_draw_from_the_whole_corpus():
    assert len(CORPUS) >= 30  # tests/data/configs: the real public configs of corpus.toml


def test_a_field_the_class_cannot_take_is_one_line_on_stderr(tmp_path):
    """Hypothesis found it: FalconConfig computes head_dim, and a file's ``head_dim: 0`` made transformers log
    the whole config (46 lines, at its ERROR level) before it raised. As a user runs it, in a process of its
    own: exit 2 and the one line naming the field."""
    raw = json.loads((DATA / "configs" / "falcon-40b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "head_dim": 0}))
    proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "plan", str(tmp_path / "config.json"), "-n", "4k"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and "head_dim" in line, proc.stderr
