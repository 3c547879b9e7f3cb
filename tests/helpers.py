"""What test modules share: the repository's paths, the engines' environments, kvbench run in this process."""
import subprocess
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


def kvbench_here(*args) -> subprocess.CompletedProcess:
    """``kvbench ARGS`` run in this process (typer's CliRunner) as tests/test_cli.py's ``kvbench`` runs it in a
    process of its own: the exit code, stdout and stderr. For refusals, which end before any engine is
    contacted: a process of its own spent 0.4-0.9 s of CPU starting and importing, about 60 times in the
    developer's loop. An exception that escapes the command is raised here, as a traceback would be printed."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["kvbench", *map(str, args)], result.exit_code, result.stdout, result.stderr)
