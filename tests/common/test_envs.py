"""Engine environments: idempotent, keyed by engine, version and recipe; installed side by side."""
import io
import os
import signal
import threading
import time

import psutil
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
    assert not is_installed(bad) and err.value.log_path.exists() and str(err.value.log_path) in str(err.value)
    assert not env_dir(bad).exists()  # no half environment under the name


def _sleeper(name: str, seconds: float, marker: str) -> Recipe:
    """A prefix-only recipe whose one step records when it started and sleeps (``marker`` names its process)."""
    return Recipe(name, "1", (InstallStep(("bash", "-c", f"date +%s.%N > {{env}}/started; exec -a {marker} sleep {seconds}")),),
                  venv=False)


def test_setup_installs_side_by_side_and_reports_in_order(tmp_path, monkeypatch):
    from rich.console import Console

    from kvbench.commands.setup import _install_side_by_side

    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    recipes = [_sleeper("slow", 1.5, "kvbench-test-slow"), _sleeper("quick", 0.1, "kvbench-test-quick")]
    console = Console(file=io.StringIO(), width=200)
    assert _install_side_by_side(console, recipes) is False
    started = [float((env_dir(r) / "started").read_text()) for r in recipes]
    assert abs(started[0] - started[1]) < 1.0, "the second install waited for the first"
    out = console.file.getvalue()
    assert out.index("ready slow-1") < out.index("ready quick-1")
    assert all(is_installed(r) for r in recipes)


def test_an_interrupted_setup_leaves_no_installer_running(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which setup turns into one) stops every installer running side by side, with the
    processes they started: none is left installing after kvbench."""
    from rich.console import Console

    from kvbench.commands.setup import _install_side_by_side

    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    marker = f"kvbench-test-{os.getpid()}"
    recipes = [_sleeper("a", 60, marker), _sleeper("b", 60, marker)]
    # as in `kvbench setup`, Ctrl-C raises KeyboardInterrupt here (a pytest-xdist worker ignores SIGINT)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))  # as Ctrl-C: a real signal
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            _install_side_by_side(Console(file=io.StringIO()), recipes)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
    assert time.monotonic() - started < 30  # the installers sleep 60 s: they were stopped, not waited for
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and _running(marker):
        time.sleep(0.05)
    assert not _running(marker)
    assert not any(is_installed(r) for r in recipes)


def _running(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found
