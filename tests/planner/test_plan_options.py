"""Issue items 6 and 7: `kvbench plan`'s options are declared once (bench/commands/plan_options.py) and every
input is checked: each engine option in the range its engine takes (declared beside its ``rule_options``),
counts and sizes bounded, the engine's name in any case, --kv-dtype and per-engine options applied to each
engine of --compare-engines."""
import json

import pytest

from kvbench.commands import plan_options
from kvbench.kv.rules import Choice, KVRuleError, Number, OptionRange, Switch, Whole
from kvbench.planner import engine_rules, engines
from tests.helpers import kvbench_here

MODEL = ("llama-3.1-8b", "--gpu", "H100-80GB")


def plan(*args):
    return kvbench_here("plan", *MODEL, *args)


def refused(*args) -> str:
    """The one line a refused plan prints (exit 2, nothing on stdout)."""
    r = plan(*args)
    assert r.returncode == 2, (args, r.stdout[:300], r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not r.stdout, r.stderr
    return lines[0]


def planned(*args) -> dict:
    r = plan(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --- the option ranges ---------------------------------------------------------------------------------

def test_an_option_range_reads_text_and_typed_values_and_refuses_the_rest_in_one_line():
    fraction = Number(0, 1)
    assert fraction.read("f", "0.5") == 0.5 and fraction.read("f", 1) == 1.0
    for bad in ("0", 0, "95", "1.5", "abc", "", "nan", "inf", "-0.1", True, "1e999"):
        with pytest.raises(KVRuleError, match=r"^f takes a number in \(0, 1\], not "):
            fraction.read("f", bad)
    with pytest.raises(KVRuleError, match=r"in \(0, 1\)"):
        Number(0, 1, high_open=True).read("f", "1")
    whole = Whole()
    assert whole.read("n", "8") == 8 and whole.read("n", 8) == 8
    for bad in ("0", "1.5", 2.0, "x", "", True, "9" * 5000, str(2**31)):
        with pytest.raises(KVRuleError, match="^n takes a whole number from 1 to 2,147,483,647"):
            whole.read("n", bad)
    assert Whole(0, unit="MiB").read("m", "0") == 0
    assert Switch().read("s", "off") is False and Switch().read("s", True) is True and Switch().read("s", "ON")
    with pytest.raises(KVRuleError, match="^s takes on or off"):
        Switch().read("s", "maybe")
    fa = Choice(("on", "off", "auto"), (("true", "on"),))
    assert fa.read("fa", "AUTO") == "auto" and fa.read("fa", True) == "on"
    with pytest.raises(KVRuleError, match="^fa takes one of on, off, auto, not 'sometimes'"):
        fa.read("fa", "sometimes")


def test_every_engine_option_declares_the_range_it_takes():
    for engine in engines():
        for key, allowed in engine_rules(engine).rule_options.items():
            assert isinstance(allowed, OptionRange), (engine, key)
            assert allowed.describe()


# --- engine options through the CLI ----------------------------------------------------------------------

@pytest.mark.parametrize("engine, option, message", [
    ("vllm", "gpu_memory_utilization=95", "gpu_memory_utilization takes a number in (0, 1], not '95'"),
    ("vllm", "gpu_memory_utilization=1.5", "in (0, 1], not '1.5'"),
    ("vllm", "gpu_memory_utilization=0", "in (0, 1], not '0'"),  # was silently the default
    ("vllm", "gpu_memory_utilization=abc", "in (0, 1], not 'abc'"),  # was a traceback
    ("vllm", "gpu_memory_utilization=nan", "in (0, 1], not 'nan'"),
    ("vllm", "max_num_seqs=0", "max_num_seqs takes a whole number from 1"),
    ("vllm", "max_num_batched_tokens=1.5", "max_num_batched_tokens takes a whole number from 1"),
    ("vllm", "enforce_eager=sometimes", "enforce_eager takes on or off"),
    ("sglang", "mem_fraction_static=2", "mem_fraction_static takes a number in (0, 1), not '2'"),
    ("sglang", "mem_fraction_static=1", "in (0, 1), not '1'"),
    ("sglang", "swa_full_tokens_ratio=0", "swa_full_tokens_ratio takes a number in (0, 1]"),
    ("sglang", "attention_backend=fast", "attention_backend takes one of triton, torch_native"),
    ("tgi", "cuda_memory_fraction=1.5", "cuda_memory_fraction takes a number in (0, 1]"),
    ("tgi", "max_batch_prefill_tokens=-4", "max_batch_prefill_tokens takes a whole number from 1"),
    ("llamacpp", "n_ubatch=0", "n_ubatch takes a whole number from 1"),
    ("llamacpp", "flash_attn=sometimes", "flash_attn takes one of on, off, auto"),
    ("llamacpp", "cache_ram_mib=-1", "cache_ram_mib takes a whole number of MiB from 0"),
    ("ollama", "unified=perhaps", "unified takes on or off"),
    ("hf", "decoded_tokens=-1", "decoded_tokens takes a whole number from 0"),
])
def test_an_engine_option_outside_the_engines_range_is_refused_in_one_line(engine, option, message):
    line = refused("--engine", engine, "-n", "8192", "--engine-option", option)
    assert line.startswith("error: --engine-option ") and message in line


def test_an_engine_option_in_range_is_read_as_the_engine_reads_it():
    default, given = planned("--engine", "vllm"), planned("--engine", "vllm", "--engine-option",
                                                          "gpu_memory_utilization=0.5")
    assert given["usable_bytes"] < default["usable_bytes"]
    # a switch given as a word reads as one (unified=off was a true string to llama.cpp's rules)
    on = planned("--engine", "llamacpp", "-n", "1000", "--batch", "4", "--engine-option", "unified=on")
    off = planned("--engine", "llamacpp", "-n", "1000", "--batch", "4", "--engine-option", "unified=off")
    plain = planned("--engine", "llamacpp", "-n", "1000", "--batch", "4")
    assert off["deployment_kv_bytes_per_gpu"] == plain["deployment_kv_bytes_per_gpu"]
    assert on["deployment_kv_bytes_per_gpu"] != plain["deployment_kv_bytes_per_gpu"]


# --- counts and sizes bounded ------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--batch", "10000000"], "--batch takes at most 1,048,576 requests at once, not 10,000,000"),
    (["--tp", "5000"], "--tp takes at most 1,024 GPUs"),
    (["--pp", "5000"], "--pp takes at most 1,024 stages"),
    (["--dp", "5000"], "--dp takes at most 1,024 GPUs"),
    (["--node-gpus", "5000"], "--node-gpus takes at most 1,024 GPUs"),
    (["-n", "2000000000"], "--context takes at most 1,073,741,824 tokens"),
    (["-n", "9" * 400], "--context takes at most 1,073,741,824 tokens"),  # past a float: was a traceback
    (["--max-model-len", "2000M"], "--max-model-len takes at most 1,073,741,824 tokens"),
    (["--shared-prefix", "2000M"], "--shared-prefix takes at most 1,073,741,824 tokens"),
    (["--engine", "vllm", "--block-size", "100000"], "--block-size takes at most 65,536 tokens"),
    (["--weights-bytes", "9" * 400], "--weights-bytes takes at most 1 PiB"),
    (["--overhead-gib", "1e300"], "--overhead-gib takes at most 1,048,576 GiB"),
    (["--overhead-gib", "nan"], "--overhead-gib takes a finite number"),
    (["--gpu", "1.2.3GiB"], "--gpu '1.2.3GiB' is not a GPU or a size such as 48GiB"),
    (["--engine", "vllm", "--engine-version", "9" * 5000], "--engine-version takes a version such as 0.10.1"),
    (["--engine-version", "abc"], "--engine-version takes a version such as 0.10.1, not 'abc'"),
    (["--overhead-from", "9" * 400], "--overhead-from '9999"),  # a name too long: was a traceback
])
def test_counts_and_sizes_are_bounded_and_the_line_says_the_maximum(args, message):
    assert message in refused(*args)


def test_a_memory_wall_is_bounded_too():
    r = kvbench_here("plan", "llama-3.1-8b", "--memory", "9" * 400)
    assert r.returncode == 2 and "--memory takes at most 1 PiB" in r.stderr and len(r.stderr.splitlines()) == 1


def test_the_largest_counts_still_plan():
    r = planned("--batch", "1048576", "-n", "1000", "--node-gpus", "1024")
    assert r["batch"] == 1048576 and r["fits"] is False


# --- the engine's name in any case -------------------------------------------------------------------------

def test_the_engine_is_taken_in_any_case_and_named_as_the_planner_knows_it():
    upper = planned("--engine", "vLLM", "-n", "8192")
    assert upper["engine"] == "vllm" and upper == planned("--engine", "vllm", "-n", "8192")
    assert "no KV rules for engine 'vlm'" in refused("--engine", "vlm")


# --- --compare-engines: --kv-dtype and options per engine ---------------------------------------------------

def compared(*args) -> dict:
    out = planned("--compare-engines", *args)
    return out | {"by_engine": {p["engine"]: p for p in out["engines"]}}


def test_compare_engines_applies_kv_dtype_to_each_engine_that_takes_it_and_says_which_do_not():
    q8 = compared("--kv-dtype", "q8_0")
    takes = [e for e in engines() if plan_options.takes_kv_dtype(e, "q8_0")]
    assert sorted(q8["by_engine"]) == sorted(takes) and {"llamacpp", "ollama"} <= set(takes)
    assert all(p["kv_dtype"] == "q8_0" for p in q8["engines"])
    assert sorted(q8["engines_without_kv_dtype"]) == sorted(set(engines()) - set(takes))
    auto = compared()
    assert auto["by_engine"]["llamacpp"]["tokens"] < q8["by_engine"]["llamacpp"]["tokens"]  # 8.5 bits, not 16
    text = plan("--compare-engines", "--kv-dtype", "q8_0")
    assert text.returncode == 0 and "Not in the table: " in text.stdout and "(no KV dtype 'q8_0')" in text.stdout
    assert "no engine takes it" in refused("--compare-engines", "--kv-dtype", "q3_x")


def test_compare_engines_takes_each_engines_options_addressed_to_it():
    auto = compared()["by_engine"]
    given = compared("--engine-option", "vllm:gpu_memory_utilization=0.5",
                     "--engine-option", "sglang:mem_fraction_static=0.5")["by_engine"]
    assert given["vllm"]["budget"] < auto["vllm"]["budget"] and given["sglang"]["budget"] < auto["sglang"]["budget"]
    assert given["tgi"] == auto["tgi"] and given["llamacpp"] == auto["llamacpp"]
    # an unaddressed key that one engine takes goes to it
    assert compared("--engine-option", "gpu_memory_utilization=0.5")["by_engine"]["vllm"] == given["vllm"]


@pytest.mark.parametrize("args, message", [
    (["--compare-engines", "--engine-option", "unified=on"],
     "llamacpp, ollama all take unified; with --compare-engines address one: --engine-option llamacpp:unified=on"),
    (["--compare-engines", "--engine-option", "vllm:mem_fraction_static=0.5"],
     "unknown --engine-option 'mem_fraction_static' for vllm"),
    (["--compare-engines", "--engine-option", "vllm:gpu_memory_utilization=2"],
     "--engine-option vllm:gpu_memory_utilization takes a number in (0, 1], not '2'"),
    (["--compare-engines", "--engine-option", "vlm:gpu_memory_utilization=0.5"],
     "no KV rules for engine 'vlm'; did you mean 'vllm'?"),
    (["--compare-engines", "--engine-option", "gpu_memory_util=0.5"], "unknown --engine-option 'gpu_memory_util' for any engine"),
    (["--engine", "vllm", "--engine-option", "sglang:mem_fraction_static=0.5"],
     "addressed to sglang, but the plan is of --engine vllm"),
    (["--engine-option", "oops"], "must be KEY=VALUE"),
])
def test_engine_options_that_cannot_be_placed_are_refused_in_one_line(args, message):
    assert message in refused(*args)


def test_an_addressed_option_for_the_engine_planned_is_taken():
    assert planned("--engine", "vllm", "--engine-option", "vllm:gpu_memory_utilization=0.5") == \
        planned("--engine", "vllm", "--engine-option", "gpu_memory_utilization=0.5")


# --- declared once -------------------------------------------------------------------------------------------

def test_the_commands_parameters_are_the_declared_options_in_order():
    from kvbench.cli import load_command

    params = [p.name for p in load_command("plan").params if p.name != "help"]
    assert params == [flag.param for flag in plan_options.plan_flags()]
