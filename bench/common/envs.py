"""Isolated environments: one per engine *and version*, so two versions of one engine live side by side.

An environment is a folder under ``$KVBENCH_HOME/envs/<engine>-<version>`` (a venv, or a prefix with a
built binary). Each adapter supplies its install recipe as a list of steps; the recipe's hash is stored
in a stamp file, so setup is idempotent: a second call with the same recipe installs nothing, and a
changed recipe (another version, another package list) gets a fresh folder.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

STAMP = ".kvbench-installed.json"


def kvbench_home() -> Path:
    """Where environments, built engines and prepared models are cached (shared by all clones)."""
    return Path(os.environ.get("KVBENCH_HOME", Path.home() / ".cache" / "kvbench"))


@dataclass(frozen=True)
class InstallStep:
    """One command of a recipe. ``{env}`` and ``{python}`` in argv are replaced at run time."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Recipe:
    engine: str
    version: str
    steps: tuple[InstallStep, ...]
    venv: bool = True  # False: the steps build into a plain prefix (llama.cpp's binary)
    extra_key: tuple[str, ...] = field(default=())  # e.g. CPU model for -march=native builds

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.version}"

    def digest(self) -> str:
        payload = json.dumps([self.engine, self.version, [list(s.argv) for s in self.steps],
                              [list(s.env) for s in self.steps], self.venv, list(self.extra_key)])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


class EnvInstallError(RuntimeError):
    def __init__(self, recipe: Recipe, log_tail: str):
        super().__init__(f"installing {recipe.name} failed")
        self.log_tail = log_tail


def env_dir(recipe: Recipe) -> Path:
    return kvbench_home() / "envs" / recipe.name


def env_python(path: Path) -> Path:
    return path / "bin" / "python"


def is_installed(recipe: Recipe) -> bool:
    stamp = env_dir(recipe) / STAMP
    if not stamp.exists():
        return False
    try:
        return json.loads(stamp.read_text()).get("digest") == recipe.digest()
    except (OSError, json.JSONDecodeError):
        return False


def ensure_env(recipe: Recipe, log=print) -> Path:
    """Install ``recipe`` unless the same recipe is already installed; return the environment's folder."""
    path = env_dir(recipe)
    if is_installed(recipe):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / f".{recipe.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two kvbench processes must not install into one folder at once
        if not is_installed(recipe):
            _install(recipe, path, log)
    return path


def _install(recipe: Recipe, path: Path, log) -> None:
    if path.exists():
        shutil.rmtree(path)  # half-installed or another recipe: start clean
    path.mkdir(parents=True)
    log_file = path / "install.log"
    log(f"installing {recipe.name} into {path} (log: {log_file}); this happens once")
    steps = [InstallStep((sys.executable, "-m", "venv", "{env}")),
             InstallStep(("{python}", "-m", "pip", "install", "-q", "--upgrade", "pip"))] if recipe.venv else []
    with log_file.open("w") as out:
        for step in [*steps, *recipe.steps]:
            argv = [a.replace("{env}", str(path)).replace("{python}", str(env_python(path))) for a in step.argv]
            if _run(argv, out, dict(step.env)) != 0:
                out.flush()
                raise EnvInstallError(recipe, tail(log_file))
    (path / STAMP).write_text(json.dumps({"digest": recipe.digest(), "engine": recipe.engine,
                                          "version": recipe.version}))


# Installer processes running now, each the leader of its own process group: installs run side by side
# (`kvbench setup`), so an interrupt reaches them through stop_installs(), not through the terminal.
_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()
_STOPPED = threading.Event()  # set by stop_installs(): no installer starts until allow_installs()


def _run(argv: list[str], out, extra_env: dict[str, str]) -> int:
    out.write(f"$ {' '.join(argv)}\n")
    out.flush()
    env = {**os.environ, **extra_env}
    with _RUNNING_LOCK:  # one lock with stop_installs(): an installer starts before the stop (and is stopped) or not at all
        if _STOPPED.is_set():
            out.write("not started: the installs were stopped\n")
            return -signal.SIGTERM
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _RUNNING.add(proc)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:  # interrupted while waiting: the installer's whole tree (pip's builds, ninja's compilers)
            _stop_group(proc)
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)


def stop_installs(timeout_s: float = 5.0) -> None:
    """Stop every installer still running, with its process group: SIGTERM, then SIGKILL after ``timeout_s``."""
    with _RUNNING_LOCK:
        _STOPPED.set()
        running = list(_RUNNING)
    for proc in running:
        _stop_group(proc, timeout_s)


def allow_installs() -> None:
    """Undo stop_installs(): installers may start again (a new `kvbench setup` in the same process)."""
    _STOPPED.clear()


def _stop_group(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; its group's stragglers are not waited for
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def pip_install(*requirements: str) -> InstallStep:
    return InstallStep(("{python}", "-m", "pip", "install", "-q", *requirements))
