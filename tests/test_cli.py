"""The kvbench command as a user runs it."""
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

TINY = """name = "tiny"
seed = 3
prompt_tokens = [64]
output_tokens = 8
concurrency = [1]
"""


def kvbench(*args, timeout=600):
    # a wide terminal, so that rich does not wrap the error messages the tests look for
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "300"})


def test_bad_arguments_name_the_allowed_values(tmp_path):
    bad_backend = kvbench("run", "-b", "trtllm")
    assert bad_backend.returncode == 2 and "allowed: hf, llamacpp, ollama, openai, sglang, tgi, vllm" in bad_backend.stderr
    two_urls = kvbench("run", "-b", "vllm", "-b", "hf", "--url", "http://127.0.0.1:9")
    assert two_urls.returncode == 2 and "exactly one --backend" in two_urls.stderr
    bad_workload = kvbench("run", "--workload", "nope")
    assert bad_workload.returncode == 2 and "long_context_ladder" in bad_workload.stderr
    not_a_run = kvbench("report", str(tmp_path))
    assert not_a_run.returncode == 2 and "not a kvbench run folder" in not_a_run.stderr


# --- a CLI that explains itself -----------------------------------------------------------------------

def test_help_shows_the_backend_syntax_as_written():
    for verb in ("run", "setup"):
        done = kvbench(verb, "--help")
        assert done.returncode == 0 and "ENGINE[@VERSION][:KEY=VALUE,...]" in done.stdout, done.stdout


def test_top_level_help_lists_every_verb_with_its_summary():
    from kvbench.cli import COMMANDS, docstring
    done = kvbench("--help")
    assert done.returncode == 0
    for verb in COMMANDS:
        assert verb in done.stdout
    assert docstring("backends").split()[0] in done.stdout  # summaries read from the sources


def test_importing_the_cli_imports_no_heavy_package():
    # nor do the verbs that need none (run, report and compare read results: theirs are imported when they run)
    code = ("import sys, kvbench.cli; from kvbench.commands import backends, default_bench, plan, setup, validate; "
            "heavy = [m for m in ('pandas', 'matplotlib', 'transformers', 'torch') if m in sys.modules]; print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_refused_run_imports_no_results_package():
    """`kvbench run` refuses bad input before it imports what writes and reads results (pandas, pyarrow),
    plots them, or makes a load's schedule (numpy): a refusal took 0.9 s of CPU with them all, 0.5 s with
    numpy, 0.35 s without."""
    refusals = [["-b", "nosuch"], ["--workload", "nosuch"], ["--repeats", "0"], ["--model", "/nonexistent"],
                ["--prometheus", "ftp://x"], ["--prompt-salt", ""], ["--load-share", "1/2"]]
    heavy = ("numpy", "pandas", "pyarrow", "matplotlib", "scipy", "transformers", "torch")
    code = ("import sys; from kvbench.cli import app\n"
            f"for args in {refusals!r}:\n"
            "    try:\n        app(['run', *args])\n"
            "    except SystemExit as exc:\n        assert exc.code == 2, (args, exc.code)\n"
            f"print([m for m in {heavy!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_backends_lists_every_engine_version_and_option():
    import json

    from kvbench.backends import REGISTRY
    done = kvbench("backends")
    assert done.returncode == 0
    for name, cls in REGISTRY.items():
        assert f"{name} (default version {cls.default_version})" in done.stdout
        for option in cls.option_specs:
            assert option.name in done.stdout
    listed = json.loads(kvbench("backends", "--json").stdout)
    assert listed["engines"]["llamacpp"]["options"]["threads"]["type"] == "int"
    assert listed["engines"]["tgi"]["options"]["mode"] == {"type": "auto|launcher|docker", "default": "auto",
                                                          "shown_default": "auto", "help": "how TGI starts"}
    assert set(listed["common_options"]) == {"url", "api_key_env", "ca_bundle"}


def test_each_adapter_declares_exactly_the_options_it_reads():
    import inspect
    import re

    from kvbench.backends import REGISTRY
    for name, cls in REGISTRY.items():
        source = inspect.getsource(inspect.getmodule(cls))
        read = set(re.findall(r"self\.options(?:\.get\(|\[)\"(\w+)\"", source))
        if "extra_args(self.options)" in source:
            read.add("extra_args")
        if cls.capabilities.speculation.methods:  # its drafter's module reads the speculation options
            drafter = inspect.getsource(inspect.getmodule(type(cls.capabilities.speculation)))
            read |= set(re.findall(r"options(?:\.get\(|\[)\"(\w+)\"", drafter))
        assert read == {o.name for o in cls.option_specs}, name


def test_backend_options_are_checked_with_a_suggestion():
    from kvbench.run.backend_config import BackendConfig, ConfigError
    with pytest.raises(ConfigError) as exc:
        BackendConfig.parse("llamacpp:thread=2")
    assert str(exc.value) == ("unknown option 'thread' for llamacpp; did you mean 'threads'? allowed: api_key_env, "
                              "batch_threads, ca_bundle, draft_model, engine_mode, extra_args, gguf, speculative, speculative_tokens, "
                              "split_mode, tensor_split, threads, url")
    with pytest.raises(ConfigError, match="option 'threads' for llamacpp takes an integer, not 'two'"):
        BackendConfig.parse("llamacpp:threads=two")
    with pytest.raises(ConfigError, match="option 'enforce_eager' for vllm takes true or false, not 1"):
        BackendConfig.parse("vllm:enforce_eager=1")
    with pytest.raises(ConfigError, match="takes one of auto, launcher, docker, not 'dock'; did you mean 'docker'"):
        BackendConfig.parse("tgi:mode=dock")
    typed = BackendConfig.parse("openai:url=http://127.0.0.1:9,served_model=7,ignore_eos=true")
    assert typed.options == {"served_model": "7", "ignore_eos": True} and typed.url == "http://127.0.0.1:9"
    assert BackendConfig.parse("vllm:block_size=16,extra_args=--seed 1").options == {"block_size": 16,
                                                                                      "extra_args": "--seed 1"}
    done = kvbench("run", "-b", "llamacpp:thread=2")
    assert done.returncode == 2 and "did you mean 'threads'?" in done.stderr


def test_typos_get_a_suggestion():
    engine = kvbench("run", "-b", "vlm")
    assert engine.returncode == 2 and "did you mean 'vllm'?" in engine.stderr
    workload = kvbench("run", "--workload", "smok")
    assert workload.returncode == 2 and "did you mean 'smoke'?" in workload.stderr
    model = kvbench("plan", "llama3-8b", "--context", "1024")
    assert model.returncode == 2 and "did you mean 'llama-3-8b'?" in model.stderr
    verb = kvbench("rnu")
    assert verb.returncode == 2 and "did you mean 'run'?" in verb.stderr
    nothing_close = kvbench("run", "-b", "zzzz")
    assert nothing_close.returncode == 2 and "did you mean" not in nothing_close.stderr


def test_b_means_backend_everywhere():
    plan_b = kvbench("plan", "llama-3-8b", "--context", "1024", "-b", "2")
    assert plan_b.returncode == 2 and "No such option: -b" in plan_b.stderr
    plan = kvbench("plan", "llama-3-8b", "--context", "1024", "--batch", "2", "--json")
    assert plan.returncode == 0 and '"batch": 2' in plan.stdout
    for verb in ("run", "setup", "validate"):
        assert "-b, --backend" in kvbench(verb, "--help").stdout


def test_plan_engine_options_are_checked_against_the_engines_kv_rules():
    typo = kvbench("plan", "llama-3-8b", "--context", "1024", "--engine", "vllm", "--engine-option", "hybrid_kv=off")
    assert typo.returncode == 2 and "unknown --engine-option 'hybrid_kv' for vllm; did you mean 'hybrid_kv_cache'?" \
        in typo.stderr
    no_engine = kvbench("plan", "llama-3-8b", "--context", "1024", "--engine-option", "unified=true")
    assert no_engine.returncode == 2 and "needs --engine" in no_engine.stderr
    ok = kvbench("plan", "llama-3-8b", "--context", "1024", "--engine", "llamacpp", "--engine-option", "unified=true")
    assert ok.returncode == 0, ok.stderr


def test_each_kv_rules_class_declares_the_options_it_reads():
    import inspect
    import re

    from kvbench.planner import engine_rules, engines
    for engine in engines():
        rules = engine_rules(engine)
        read = set()
        for cls in type(rules).__mro__:
            if cls.__module__.startswith("kvbench.backends") and cls.__name__ != "KVRules":
                # only the methods these rules run: a method a subclass overrides reads nothing for it (Ollama's
                # draft_kv, which has no drafter, overrides llama.cpp's)
                used = [f for name, f in vars(cls).items() if inspect.isfunction(f) and getattr(type(rules), name) is f]
                read |= {o for f in used for o in re.findall(r"q\.options\.get\(\"(\w+)\"", inspect.getsource(f))}
                # the startup rule its rules import as gpumem (backends/<engine>/gpumem.py or shared/) reads the same options
                gpumem = getattr(sys.modules[cls.__module__], "gpumem", None)
                if gpumem is not None:
                    read |= set(re.findall(r"options\.get\(\"(\w+)\"", inspect.getsource(gpumem)))
        assert read == set(getattr(rules, "rule_options", ())), engine


def test_the_listing_read_from_the_sources_matches_the_commands():
    from kvbench.cli import COMMANDS, docstring, load_command
    for verb in COMMANDS:
        assert docstring(verb) == (load_command(verb).help or "").strip(), verb
