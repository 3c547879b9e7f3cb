"""`kvbench validate` for an engine it cannot check: one line and exit 2 before anything is installed, never
exit 0 with an empty table (which a CI reads as a pass)."""
import pytest
from typer.testing import CliRunner

from kvbench.backends import DEFAULT_ENGINES, REGISTRY
from kvbench.cli import app


@pytest.mark.parametrize("engine", ["openai", "tgi", "ollama", "sglang"])
def test_validate_of_an_engine_with_nothing_to_check_is_exit_2_and_installs_nothing(engine, tmp_path, monkeypatch):
    installed = []
    monkeypatch.setattr("kvbench.commands.validate.ensure_env", lambda *a, **k: installed.append(a))
    result = CliRunner().invoke(app, ["validate", "-b", engine, "--into", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: kvbench validate: {engine} "), result.output
    assert installed == [] and not (tmp_path / "out").exists()


def test_the_engines_that_run_here_have_cases_to_validate():
    assert [e for e in DEFAULT_ENGINES if REGISTRY[e].validation_refusal()] == []
