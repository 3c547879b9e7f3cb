"""`kvbench plan` imports only what its answer needs (issue 54 item 4: at most 0.3 s on a loaded machine;
tests/benchmarks/bench_plan_startup.py times it). What is checked is which modules a plan loads, not a time:
pydantic (typer 0.29 validates each option through a pydantic TypeAdapter: bench/cli.py plain_value takes text
as it is instead), psutil (kvbench.common.envs, for engine environments), hashlib, the bandwidth probe's thread
pool, and the results packages; with --json, rich too (no table printed)."""
import subprocess
import sys

import pytest

from tests.helpers import REPO

PLAN = ["plan", "llama-3.1-8b", "--gpu", "H100-80GB"]
NEVER = ("pydantic", "psutil", "httpx", "pandas", "numpy", "matplotlib", "pyarrow", "transformers", "torch",
         "kvbench.common.envs", "kvbench.common.bandwidth", "concurrent.futures", "hashlib")


def loaded_by(args: list[str]) -> set[str]:
    """The modules loaded in a fresh interpreter that ran ``kvbench ARGS`` (exit 0) and printed its answer."""
    code = ("import sys; from kvbench.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "print('MODULES', *sorted(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    answer, _, modules = done.stdout.rpartition("MODULES ")
    assert "H100" in answer  # the plan was answered
    return set(modules.split())


@pytest.mark.parametrize("args", [PLAN, [*PLAN, "--json"]], ids=["text", "json"])
def test_a_plan_imports_no_validation_library_process_tools_or_results_package(args):
    loaded = loaded_by(args)
    assert "kvbench.planner.deploy" in loaded and "typer" in loaded  # the check can see what it looks for
    never = NEVER if "--json" not in args else (*NEVER, "rich")
    assert sorted(m for m in never if m in loaded) == []


def test_plain_values_are_coerced_as_typer_coerces_them():
    """Every option that bench/cli.py takes as it is (str, list[str], bool) gives what typer's own coercion
    gives, for values the command line gives and for others (which go to typer's)."""
    from typer._click import Context
    from typer._coercion import build_runtime_param

    from kvbench.cli import PlainParam, load_command

    samples = {str: ["plain", "", "ünïcode ☃", "--x=1", 5],
               bool: [True, False],
               list[str]: [(), ("a", "b=1"), ["c"], ("ü",)]}
    checked = 0
    for verb in ("plan", "setup", "validate", "backends", "default-bench"):
        command = load_command(verb)
        ctx = Context(command)
        for param in command.get_params(ctx):
            runtime = param.get_runtime_param()
            if not isinstance(runtime, PlainParam):
                continue
            typers = build_runtime_param(param.type_descriptor)
            for value in [None, *samples[param.type_descriptor.annotation]]:
                ours = runtime.coerce(value, param=param, ctx=ctx)
                assert ours == typers.coerce(value, param=param, ctx=ctx), (verb, param.name, value)
                assert type(ours) is type(typers.coerce(value, param=param, ctx=ctx)), (verb, param.name, value)
                checked += 1
    assert checked > 100
