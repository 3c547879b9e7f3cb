"""Validation by measurement: the engines' KV rules against what the real engines allocate, for the embedded
model (each engine's own cases) and for the validation families (small random-weight models, one per
attention family). The whole family x engine table is `kvbench validate --families`; here its fast part:
every family in transformers and llama.cpp, and the hybrid-window family in vLLM."""
import pytest

from kvbench.backends.hf.adapter import HFBackend
from kvbench.backends.llamacpp.adapter import LlamaCppBackend
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.common.models import ModelFiles
from kvbench.run.validate import families, family_markdown, measure_families, verdict

from tests.helpers import engine_env

pytestmark = pytest.mark.engine


def assert_all_ok(checks):
    bad = [c.row() for c in checks if not c.ok]
    assert not bad, bad


def test_llamacpp_kv_buffer_f16_q8_0_q4_0_at_several_sizes(smollm2, tmp_path):
    checks = LlamaCppBackend.kv_checks(engine_env("llamacpp"), smollm2, tmp_path)
    assert {c.case.split(",")[0] for c in checks} == {"f16", "q8_0", "q4_0"}
    assert len({c.case for c in checks}) == 6
    assert all(c.engine_reported is not None for c in checks)
    assert_all_ok(checks)


def test_vllm_bytes_per_block_exact_for_two_dtypes(smollm2, tmp_path):
    checks = VLLMBackend.kv_checks(engine_env("vllm"), smollm2, tmp_path)
    assert [c.case.split(",")[0] for c in checks] == ["bf16", "fp32"]
    assert [c.predicted for c in checks] == [128 * 23_040, 128 * 46_080]
    assert_all_ok(checks)  # tolerance 0: equal to the byte


def test_transformers_cache_bytes_of_the_embedded_model(smollm2, tmp_path):
    checks = HFBackend.kv_checks(engine_env("hf"), smollm2, tmp_path)
    assert [c.case.split()[1] for c in checks] == ["bf16,", "fp32,", "quanto-int4,"]  # the last: QuantizedCache
    assert_all_ok(checks)


def by(rows, engine):
    return {r["family"]: r for r in rows if r["engine"] == engine}


def test_every_family_in_transformers_and_llamacpp(smollm2, tmp_path):
    """Built here from the families' configs, converted by llama.cpp's own converter, measured: transformers'
    cache tensors to the byte, llama.cpp's logged buffer to its 0.01 MiB."""
    envs = {"hf": engine_env("hf"), "llamacpp": engine_env("llamacpp")}
    chosen = families()
    rows = measure_families(envs, chosen, smollm2.hf_dir, tmp_path / "logs")
    assert len(rows) == 2 * len(chosen) >= 12
    for engine in envs:
        results = by(rows, engine)
        bad = {name: r["note"] for name, r in results.items() if not r["ok"]}
        assert not bad, (engine, bad)
    hf = by(rows, "hf")
    # windows crossed: the 100-token prompts leave window - 1 = 63 tokens on a sliding layer, all 103 on a full one
    assert "63" in hf["hybrid_gemma3"]["note"] and "103" in hf["hybrid_gemma3"]["note"]
    # Falcon's new_decoder_architecture: transformers holds its 2 KV heads broadcast to all 4 query heads
    assert hf["gqa_falcon_new"]["measured"] == 2 * hf["gqa_llama"]["measured"]
    llama = by(rows, "llamacpp")
    assert "layers x" in llama["hybrid_gemma2"]["note"]
    table = family_markdown(rows)
    assert table.count("| equal") == len(rows)


def test_a_hybrid_window_family_in_vllm(smollm2, tmp_path):
    """vLLM 0.32's hybrid KV manager on a CPU: a block spans a group of layers (here 1 of 6), so bytes per
    block are one layer's page, not six (the uniform layout would have given 6x)."""
    rows = measure_families({"vllm": engine_env("vllm")}, families(["hybrid_gemma3"]), smollm2.hf_dir,
                            tmp_path / "logs")
    (row,) = rows
    assert row["ok"], row
    assert row["predicted"] == 128 * 2 * (64 + 64) * 2  # one page: 128 tokens x 2 KV heads x (K 64 + V 64) x 2 B


def test_a_model_an_engine_cannot_load_is_a_row_saying_why(smollm2, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    model = ModelFiles("broken", smollm2.hf_dir, bad, "", smollm2.geometry)
    (check,) = LlamaCppBackend.measure_kv(engine_env("llamacpp"), [model], tmp_path)
    assert check.observed is None and not check.ok and check.predicted > 0
    assert check.note.startswith("cannot load here: server exited") and "load" in check.note
    assert verdict(check.row()) == "not measured"
