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


VERDICT_WORDS = ("FITS", "DOES NOT FIT", "FIT UNKNOWN", "NO VERDICT")


def plan_lines(output: str) -> dict:
    """`kvbench plan`'s first screen, by what each line says: ``asked`` (the KV of the batch asked),
    ``limit`` (what the server's limit implies, without its label ``At ...: ``), ``verdict`` (FITS / DOES NOT
    FIT ... at the limit) and ``at_asked`` (the asked length as the limit, where the default was longer)."""
    lines = output.splitlines()
    limit = lines[1].split(": ", 1)[1]
    verdict = next(t for line in lines[1:4] for t in [line.strip().split(": ", 1)[1] if line.startswith("At ")
                                                      else line.strip()] if t.startswith(VERDICT_WORDS))
    at_asked = next((line for line in lines[1:5] if line.startswith("With ")), None)
    return {"asked": lines[0], "limit": limit, "verdict": verdict, "at_asked": at_asked}
