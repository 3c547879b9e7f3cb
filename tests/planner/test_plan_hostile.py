"""Issue item 7: hostile and contradictory values to every `kvbench plan` flag and engine option, through the
CLI in this process: each plan is answered (exit 0) or refused in exactly one line (exit 2), never a
traceback."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.commands.plan_options import ARGUMENTS, plan_flags
from kvbench.planner import engine_rules, engines
from tests.helpers import kvbench_here

# negative, zero, huge, nan, inf, text, empty, unicode, contradictory
HOSTILE = ["-1", "0", "-0", "1.5", "95", "1e400", "9" * 400, "2147483648", "nan", "inf", "-inf", "abc", "", " ", "١٢",
           "∞", "\u200b", "1,000", "1.2.3", "0GiB", "1e3", "true", "vLLM", "cpu", "H100-80GB", "fp8"]
# values sound for some flag or option, so that the plans reach the engines' rules and the levers
SOUND = {"context": ["1", "512", "8k", "128K", "131072", "1073741824"], "batch": ["1", "2", "64", "1048576"],
         "tp": ["1", "2", "8", "1024"], "pp": ["1", "2", "4"], "dp": ["1", "2", "8"], "node_gpus": ["1", "8", "1024"],
         "kv_dtype": ["auto", "fp8", "q8_0", "bf16", "fp8_e5m2", "quanto-int4"],
         "gpu": ["H100-80GB", "A10", "48GiB", "0.001GiB", "1000000GiB"], "memory": ["1G", "64GiB", "1", "1024TiB"],
         "block_size": ["0", "1", "16", "65536"], "device": ["gpu", "cpu"], "engine_version": ["0.8.5", "0.10.0", "99"],
         "weights_dtype": ["auto", "fp8", "int4"], "weights_bytes": ["1", "16GB", "1024TiB"],
         "overhead_gib": ["0", "1.5", "-1", "1048576"], "overhead_from": [".", "/nonexistent"],
         "margin": ["0", "0.1", "0.99", "1", "-0.1"], "shared_prefix": ["1", "16", "4096"],
         "option": ["0.5", "0.9", "1", "on", "off", "auto", "8", "4096", "flashinfer", "fa3"]}
SOUND["max_model_len"] = SOUND["context"]
SOUND["engine"] = [*engines(), "vLLM"]
SOUND_MODELS = st.sampled_from(["llama-3.1-8b", "deepseek-v2", "gemma-3-1b", "smollm2"])
MODELS = st.one_of(SOUND_MODELS, st.sampled_from(["", "nope", "../x.json", "a/b/c", "x.gguf", "\u200b", "-n"]))
# every flag but the model's (its own list) and the two that exit 3 or run a config's code
FLAGS = [f for f in plan_flags() if f.param not in (*ARGUMENTS, "strict", "trust_remote_code")]
KEYS = sorted({k for e in engines() for k in engine_rules(e).rule_options})


def values(param: str, hostile: bool):
    sound = st.sampled_from(SOUND.get(param, ["1"]))
    return st.one_of(sound, st.sampled_from(HOSTILE), st.text(max_size=6)) if hostile else sound


def flag_name(flag) -> str:
    return flag.names[0] if flag.names else f"--{flag.param.replace('_', '-')}"


@st.composite
def plan_args(draw, hostile: bool) -> list[str]:
    """A plan's arguments: with ``hostile``, values no flag takes among them; without, values sound for some
    flag, which contradict each other (a wall and a GPU, a pipeline deeper than the model)."""
    args = [draw(MODELS if hostile else SOUND_MODELS)]
    if draw(st.booleans()):
        args += ["--gpu", "H100-80GB"]
    if draw(st.booleans()):
        args += ["--engine", draw(st.sampled_from(engines()))]
    for flag in draw(st.lists(st.sampled_from(FLAGS), max_size=5)):
        if flag.kind is bool:
            args.append(flag_name(flag))
        elif flag.param != "engine_option":
            args.append(f"{flag_name(flag)}={draw(values(flag.param, hostile))}")  # =: a value starting with - is the flag's
    for _ in range(draw(st.integers(0, 2))):
        prefix = draw(st.sampled_from(["", *(f"{e}:" for e in engines()), "vLLM:", "nope:"]))
        args.append(f"--engine-option={prefix}{draw(st.sampled_from(KEYS))}={draw(values('option', hostile))}")
    return args


def answered_or_refused_in_one_line(args: list[str]) -> None:
    r = kvbench_here("plan", *args)  # an exception escaping the command is raised here
    assert "Traceback" not in r.stdout + r.stderr, args
    if r.returncode == 0:
        assert r.stdout.strip(), args
    else:
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_args(hostile=True))
def test_hostile_values_are_answered_or_refused_in_one_line(args):
    answered_or_refused_in_one_line(args)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_args(hostile=False))
def test_contradictory_values_are_answered_or_refused_in_one_line(args):
    answered_or_refused_in_one_line(args)
