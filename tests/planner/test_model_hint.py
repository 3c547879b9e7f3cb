"""Issue 36 item 4: "did you mean" only within a model's family, generation and size."""
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.planner import catalog_names, similar_model


@pytest.mark.parametrize("word, near", [
    ("meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b"),  # a hub id of a catalog model
    ("lama-3.1-70b", "llama-3.1-70b"),  # a typo
    ("qwen2.5-7", "qwen2.5-7b"),
    ("meta-llama/Llama-3.3-70B-Instruct", None),  # another generation
    ("llama-3.1-7b", None),  # another size
    ("meta-llama/Llama-3.1-405B", None),
    ("deepseek-v4", None),
])
def test_similar_model_keeps_family_generation_and_size(word, near):
    assert similar_model(word, catalog_names()) == near


def test_an_uncached_hub_id_offline_gets_no_other_models_name(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["plan", "meta-llama/Llama-3.1-70B-Instruct", "-n", "8k"])
    assert result.exit_code == 2
    assert "did you mean 'llama-3.1-70b'?" in result.output and "llama-3-8b-instruct-fp8?" not in result.output
