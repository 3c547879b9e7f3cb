"""Validation by measurement: the KV model's engine rules against what the real engines allocate."""
import pytest

from kvbench.validate import check_hf, check_llamacpp, check_vllm

from .conftest import engine_env

pytestmark = pytest.mark.engine


def assert_all_ok(checks):
    bad = [c.row() for c in checks if not c.ok]
    assert not bad, bad


def test_llamacpp_kv_buffer_f16_q8_0_q4_0_at_several_sizes(smollm2, tmp_path):
    checks = check_llamacpp(engine_env("llamacpp"), smollm2, tmp_path)
    assert {c.case.split(",")[0] for c in checks} == {"f16", "q8_0", "q4_0"}
    assert len({c.case for c in checks}) == 6
    assert all(c.engine_reported is not None for c in checks)
    assert_all_ok(checks)


def test_vllm_bytes_per_block_exact_for_two_dtypes(smollm2, tmp_path):
    checks = check_vllm(engine_env("vllm"), smollm2, tmp_path)
    assert [c.case.split(",")[0] for c in checks] == ["bf16", "fp32"]
    assert [c.predicted for c in checks] == [128 * 23_040, 128 * 46_080]
    assert_all_ok(checks)  # tolerance 0: equal to the byte


def test_transformers_cache_bytes_embedded_and_sliding_window(smollm2):
    checks = check_hf(engine_env("hf"), smollm2)
    assert len(checks) == 4
    short, long = [c for c in checks if "hybrid" in c.case]
    # below the window every layer holds all 12 tokens; above it the sliding layers cap at window - 1
    assert "[12, 12, 12, 12, 12, 12]" in short.note
    assert "[15, 15, 15, 15, 15, 205]" in long.note
    assert_all_ok(checks)
