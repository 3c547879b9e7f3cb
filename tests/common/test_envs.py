"""Engine environments: idempotent, keyed by engine, version and recipe."""
import pytest

from kvbench.common.envs import EnvInstallError, InstallStep, Recipe, ensure_env, env_dir, is_installed


def recipe(version: str, marker: str) -> Recipe:
    # A prefix-only recipe (like llama.cpp's): one step that records each time it runs.
    return Recipe("dummy", version, (InstallStep(("bash", "-c", f"echo {marker} >> {{env}}/runs.log")),), venv=False)


def test_second_setup_installs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    r = recipe("1.0", "a")
    path = ensure_env(r)
    assert ensure_env(r) == path
    assert (path / "runs.log").read_text().splitlines() == ["a"]
    assert is_installed(r)


def test_two_versions_side_by_side_and_changed_recipe_reinstalls(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    one, two = ensure_env(recipe("1.0", "a")), ensure_env(recipe("2.0", "a"))
    assert one != two and one.name == "dummy-1.0" and two.name == "dummy-2.0"
    assert is_installed(recipe("1.0", "a")) and is_installed(recipe("2.0", "a"))
    changed = recipe("1.0", "b")
    assert not is_installed(changed)
    assert (ensure_env(changed) / "runs.log").read_text().splitlines() == ["b"]


def test_failed_install_keeps_the_log_and_is_not_stamped(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    bad = Recipe("dummy", "9", (InstallStep(("bash", "-c", "echo no such package >&2; exit 3")),), venv=False)
    with pytest.raises(EnvInstallError) as err:
        ensure_env(bad)
    assert "no such package" in err.value.log_tail
    assert not is_installed(bad) and (env_dir(bad) / "install.log").exists()
