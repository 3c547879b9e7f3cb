"""What test modules share: the repository's paths and the engines' environments."""
from pathlib import Path

import pytest

from kvbench.backends import REGISTRY
from kvbench.common.envs import ensure_env, is_installed

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
FAKES_DATA = REPO / "tests" / "fakes" / "data"


def engine_env(engine: str) -> Path:
    """The engine's environment; `make test` installs it first, so a missing one is an error, not a skip."""
    cls = REGISTRY[engine]
    recipe = cls.recipe(cls.default_version)
    if not is_installed(recipe):
        pytest.fail(f"{recipe.name} is not installed: run `make engines` (make test does) first")
    return ensure_env(recipe)
