import pytest

from kvbench.config import BackendConfig, ConfigError


def test_parse_engine_version_and_options():
    cfg = BackendConfig.parse("vllm@0.33.0:enforce_eager=false,block_size=16,extra_args=x")
    assert (cfg.engine, cfg.version, cfg.label) == ("vllm", "0.33.0", "vllm-0.33.0")
    assert cfg.options == {"enforce_eager": False, "block_size": 16, "extra_args": "x"}


def test_default_version_comes_from_the_adapter():
    from kvbench.backends.llamacpp import LlamaCppBackend
    assert BackendConfig.parse("llamacpp").version == LlamaCppBackend.default_version


def test_unknown_engine_lists_allowed():
    with pytest.raises(ConfigError, match="allowed: hf, llamacpp, ollama, openai, tgi, vllm"):
        BackendConfig.parse("sglang")


def test_option_without_value():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        BackendConfig.parse("hf:threads")
