"""Every refusal comes before anything is created: one line on stderr, exit 2, no engine environment, no run
folder. Each case runs the real command in a fresh $KVBENCH_HOME and results folder and looks at both."""
import os
import subprocess
import sys
from pathlib import Path

import pytest



def kvbench(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "KVBENCH_HOME": str(home), "COLUMNS": "300"})


def nothing_created(tmp_path: Path) -> list[str]:
    """What the command left in the results folder or the environment cache (should be nothing)."""
    left = []
    for folder in (tmp_path / "results", tmp_path / "home"):
        if folder.exists():
            left += [str(p.relative_to(tmp_path)) for p in folder.rglob("*")]
    return left


CASES = {
    # an attach-only backend without a url: no "installing ... this happens once", no folder of failed cells
    "attach-only backend without a url": (["run", "-b", "openai", "--workload", "smoke"],
                                          "give it a url (-b openai:url=http://host:port)"),
    "a model file that is not there": (["run", "-b", "llamacpp", "--model", "/nonexistent/model.gguf",
                                        "--workload", "smoke"], "no such file or folder: /nonexistent/model.gguf"),
    "a model name that is nothing": (["run", "-b", "llamacpp", "--model", "nosuchmodel", "--workload", "smoke"],
                                     "neither a known name"),
    "a workload path that is not there": (["run", "--workload", "missing.toml"], "no such file: missing.toml"),
    "a workload in a folder that is not there": (["run", "--workload", "sub/missing"], "no such file: sub/missing"),
    # a share of a run on several machines (docs/deployments.md, "More than one machine")
    "a load share without its owner": (["run", "-b", "openai:url=http://127.0.0.1:9", "--workload", "smoke",
                                        "--load-share", "1/2", "--prompt-salt", "s"], "give --load-owner HOST:PORT too"),
    "a load share that is no share": (["run", "-b", "openai:url=http://127.0.0.1:9", "--workload", "smoke",
                                       "--load-share", "2/2", "--load-owner", "127.0.0.1:7070"], "0 <= I < N"),
    "load shares that would each start their own engine": (
        ["run", "-b", "llamacpp", "--workload", "smoke", "--load-share", "0/2", "--load-owner", "127.0.0.1:7070",
         "--prompt-salt", "s"], "attach to them (url=), not start llamacpp"),
    "load shares that would draw their own salts": (
        ["run", "-b", "openai:url=http://127.0.0.1:9", "--workload", "smoke", "--load-share", "0/2", "--load-owner",
         "127.0.0.1:7070"], "give every share the same --prompt-salt"),
    "load shares with load workers": (
        ["run", "-b", "openai:url=http://127.0.0.1:9", "--workload", "smoke", "--load-workers", "2", "--load-share",
         "0/2", "--load-owner", "127.0.0.1:7070", "--prompt-salt", "s"], "one load process per share"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_refused_creates_nothing_and_says_so_in_one_line(tmp_path, case):
    args, message = CASES[case]
    out = kvbench(tmp_path, *args, "--results-dir", str(tmp_path / "results"))
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr
    assert "installing" not in out.stdout + out.stderr
    assert nothing_created(tmp_path) == []


def test_the_refused_workload_path_is_not_called_an_unknown_name(tmp_path):
    out = kvbench(tmp_path, "run", "--workload", "missing.toml", "--results-dir", str(tmp_path / "results"))
    assert "unknown workload" not in out.stderr and "give a path to a .toml file" not in out.stderr


def test_plan_of_a_missing_file_says_no_such_file(tmp_path):
    out = kvbench(tmp_path, "plan", "/missing/config.json")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == ["error: no such file or folder: /missing/config.json"], out.stderr
    # a name that is no path still gets the list of what it could have been
    name = kvbench(tmp_path, "plan", "no-such-model")
    assert name.returncode == 2 and "catalog model" in name.stderr


def test_setup_of_an_attach_only_backend_installs_no_environment(tmp_path):
    out = kvbench(tmp_path, "setup", "-b", "openai", "--model", "/nonexistent/model.gguf")
    assert "nothing to install (it attaches to a running server)" in out.stdout
    assert "installing" not in out.stdout and not (tmp_path / "home" / "envs").exists()


def test_a_load_owner_that_cannot_serve_is_refused_before_the_run_folder(tmp_path):
    """Share 0 serves the owner at --load-owner: a port already taken is one line, exit 2, nothing created."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = kvbench(tmp_path, "run", "-b", "openai:url=http://127.0.0.1:9", "--workload", "smoke", "--load-share",
                      "0/2", "--load-owner", f"127.0.0.1:{port}", "--prompt-salt", "s", "--results-dir",
                      str(tmp_path / "results"))
    lines = [line for line in out.stderr.splitlines() + out.stdout.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stdout + out.stderr
    assert f"--load-owner 127.0.0.1:{port}: share 0 cannot serve there: address already in use" in lines[0]
    assert nothing_created(tmp_path) == []
