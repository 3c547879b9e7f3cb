import os
from pathlib import Path

import pytest

from kvbench.backends import REGISTRY, gguf_converter
from kvbench.common import models
from kvbench.common.envs import ensure_env, is_installed


def pytest_configure(config):
    # Tests never reach a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded model, prepared by `make test` (kvbench setup) before pytest runs."""
    return models.resolve("smollm2", gguf_converter())


def engine_env(engine: str) -> Path:
    """The engine's environment; `make test` installs it first, so a missing one is an error, not a skip."""
    cls = REGISTRY[engine]
    recipe = cls.recipe(cls.default_version)
    if not is_installed(recipe):
        pytest.fail(f"{recipe.name} is not installed: run `make engines` (make test does) first")
    return ensure_env(recipe)
