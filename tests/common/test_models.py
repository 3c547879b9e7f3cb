"""Models by name or by local path."""
import pytest

from kvbench.common import models


def test_gguf_path_is_the_same_model_as_the_embedded_name(smollm2):
    by_path = models.resolve(str(smollm2.gguf_path), convert=None)  # already converted: no hf env needed
    assert by_path.hf_dir == smollm2.hf_dir and by_path.sha256 == smollm2.sha256
    assert by_path.geometry == smollm2.geometry


def test_hf_folder_is_used_as_is(smollm2):
    folder = models.resolve(str(smollm2.hf_dir), convert=None)
    assert folder.hf_dir == smollm2.hf_dir and folder.gguf_path is None
    assert folder.geometry.num_layers == 30 and len(folder.sha256) == 64


def test_bad_model_arguments(tmp_path):
    with pytest.raises(models.ModelError, match="smollm2"):
        models.resolve("no-such-model", None)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(models.ModelError, match="gguf"):
        models.resolve(str(tmp_path / "weights.bin"), None)
    with pytest.raises(models.ModelError, match="config.json"):
        models.resolve(str(tmp_path), None)
