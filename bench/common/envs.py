"""Isolated environments: one per engine *and version*, so two versions of one engine live side by side.

An environment is ``$KVBENCH_HOME/envs/<engine>-<version>`` (a venv, or a prefix with a built binary): a
link to the folder it was installed into, ``envs/.builds/<engine>-<version>-<recipe digest>``, made only once
that install is complete. Each adapter supplies its install recipe as a list of steps; the recipe's hash is
stored in a stamp file, so setup is idempotent: a second call with the same recipe installs nothing, and a
changed recipe (another version, another package list) gets a fresh folder.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import re
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

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
    def __init__(self, recipe: Recipe, log_tail: str, log_path: Path | None = None):
        super().__init__(f"installing {recipe.name} failed" + (f" (log: {log_path})" if log_path else ""))
        self.log_tail = log_tail
        self.log_path = log_path


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


class HomeError(RuntimeError):
    """KVBENCH_HOME cannot hold what kvbench keeps there (a file, not writable): one line naming it."""


def home_problem() -> str | None:
    """Why KVBENCH_HOME cannot be written (a file in its place, a read-only filesystem, no permission), in one
    line naming it; None where it can (it is created if missing)."""
    home = kvbench_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=home, prefix=".kvbench-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = "a file, not a folder" if home.exists() and not home.is_dir() else (exc.strerror or str(exc)).lower()
        return f"KVBENCH_HOME {home} cannot be written: {why}"
    return None


#: what to do about a home_problem(): kvbench keeps engine environments and model copies there
HOME_ADVICE = "set KVBENCH_HOME to a writable folder (kvbench keeps engine environments and model copies there)"


@contextmanager
def held(lock_path: Path, what: str, log=print):
    """An exclusive lock on ``lock_path`` (flock: the OS releases it however its holder ends) for the block;
    where another process holds it, say so and wait for it. HomeError where the lock file cannot be made."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = lock_path.open("w")
    except OSError:
        raise HomeError(f"{home_problem() or f'{lock_path}: cannot be created'}: {HOME_ADVICE}") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another kvbench {what}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_env(recipe: Recipe, log=print) -> Path:
    """Install ``recipe`` unless the same recipe is already installed; return the environment's folder.

    The install goes into a folder of its own under ``envs/.builds/`` (named by the recipe's digest, never
    renamed: a venv's scripts and a build's rpaths hold its path), and ``envs/<engine>-<version>`` is switched
    to it (a symlink, replaced atomically) only when it is complete: a setup killed mid-install leaves no half
    environment under the name. One lock per environment: a second kvbench waits for the first."""
    path = env_dir(recipe)
    if is_installed(recipe):
        return path
    with held(path.parent / f".{recipe.name}.lock", f"installing {recipe.name}", log):
        if not is_installed(recipe):
            _install(recipe, path, log)
    return path


BUILDS = ".builds"  # under envs/: each install's own folder, the environment's name a link to the complete one
INSTALLER = ".kvbench-installer.json"  # in a build: the process group installing it now (pgid, start time)


def _install(recipe: Recipe, path: Path, log) -> None:
    builds = path.parent / BUILDS
    build = builds / f"{recipe.name}-{recipe.digest()}"
    _clear_unfinished(builds, recipe.name, keep=path)
    try:
        build.mkdir(parents=True)
    except OSError:
        raise HomeError(f"{home_problem() or f'{build}: cannot be created'}: {HOME_ADVICE}") from None
    log_file = build / "install.log"
    log(f"installing {recipe.name} into {path} (log: {log_file}); this happens once")
    steps = [InstallStep((sys.executable, "-m", "venv", "{env}")),
             InstallStep(("{python}", "-m", "pip", "install", "-q", "--upgrade", "pip"))] if recipe.venv else []
    with log_file.open("w") as out:
        for step in [*steps, *recipe.steps]:
            argv = [a.replace("{env}", str(build)).replace("{python}", str(env_python(build))) for a in step.argv]
            if _run(argv, out, dict(step.env), build / INSTALLER) != 0:
                out.flush()
                raise EnvInstallError(recipe, tail(log_file), log_file)
    (build / INSTALLER).unlink(missing_ok=True)
    (build / STAMP).write_text(json.dumps({"digest": recipe.digest(), "engine": recipe.engine,
                                           "version": recipe.version}))
    earlier = path.resolve() if path.is_symlink() else None
    link = path.with_name(f".{path.name}.link-{os.getpid()}")
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.relpath(build, path.parent))
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # an environment installed in place by an earlier kvbench
    os.replace(link, path)  # the name now points at the complete environment, never at a half one
    if earlier is not None and earlier != build.resolve() and earlier.parent == builds.resolve():
        shutil.rmtree(earlier, ignore_errors=True)  # the environment of the recipe this one replaced


def _clear_unfinished(builds: Path, name: str, keep: Path) -> None:
    """Remove the unfinished installs of environment ``name`` (a setup killed mid-install left them), after
    ending the installer processes still working in them: an orphaned pip writing into a folder being removed
    is what made the next setup fail "Directory not empty". The build ``keep`` points at stays."""
    if not builds.is_dir():
        return
    kept = keep.resolve() if keep.is_symlink() else None
    pattern = re.compile(re.escape(name) + r"-[0-9a-f]{16}")
    for build in builds.iterdir():
        if not pattern.fullmatch(build.name) or build.resolve() == kept:
            continue
        _end_installer(build / INSTALLER)
        shutil.rmtree(build, ignore_errors=True)
        if build.exists():  # a straggler wrote into it while it went: once more, the group now gone
            shutil.rmtree(build)


def _end_installer(record: Path) -> None:
    """SIGKILL the process group a killed setup's installer left running (recorded in ``record``), and wait
    for it. The group is the installer's when a process of it started no earlier than the installer (an id
    reused since is not it); it is then killed at once (killpg), not a process at a time: an orphaned writer
    forking a child every few milliseconds had children, forked after the processes were listed, write into
    the fresh build that took the removed one's place (seen once under load)."""
    try:
        data = json.loads(record.read_text())
        pgid, started = int(data["pgid"]), float(data["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.create_time() >= started - 1.0:
                members.append(proc)
        except (psutil.Error, OSError):
            continue
    if members:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:  # gone since
            pass
    psutil.wait_procs(members, timeout=5.0)


# Installer processes running now, each the leader of its own process group: installs run side by side
# (`kvbench setup`), so an interrupt reaches them through stop_installs(), not through the terminal.
_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()
_STOPPED = threading.Event()  # set by stop_installs(): no installer starts until allow_installs()


def _run(argv: list[str], out, extra_env: dict[str, str], record: Path | None = None) -> int:
    out.write(f"$ {' '.join(argv)}\n")
    out.flush()
    env = {**os.environ, **extra_env}
    with _RUNNING_LOCK:  # one lock with stop_installs(): an installer starts before the stop (and is stopped) or not at all
        if _STOPPED.is_set():
            out.write("not started: the installs were stopped\n")
            return -signal.SIGTERM
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _RUNNING.add(proc)
    watcher = _watch_group(proc.pid)
    try:
        if record is not None:  # should the watcher die too, the next setup ends this group from here
            try:
                started = psutil.Process(proc.pid).create_time()
            except psutil.Error:
                started = 0.0
            record.write_text(json.dumps({"pgid": proc.pid, "started": started}))
        return proc.wait()
    finally:
        if proc.poll() is None:  # interrupted while waiting: the installer's whole tree (pip's builds, ninja's compilers)
            _stop_group(proc)
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
        if watcher is not None:  # done: what is left of the group (a straggler of the step) goes with it
            watcher.stdin.close()
            watcher.wait()


# Ends an installer's process group when its stdin closes: when the install is done, or when kvbench dies,
# however it dies (a SIGKILLed process runs nothing, but the OS closes its end of the pipe). Standard library only.
_WATCH_GROUP = """
import os, signal, sys
sys.stdin.buffer.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except OSError:
    pass
"""


def _watch_group(pgid: int) -> subprocess.Popen | None:
    """A watcher of the installer's group, in a session of its own (a Ctrl-C in the terminal is kvbench's to
    handle), holding the read end of a pipe only this process writes to. None where it cannot start."""
    try:
        return subprocess.Popen([sys.executable, "-c", _WATCH_GROUP, str(pgid)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None


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
