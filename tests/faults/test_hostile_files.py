"""The third fault matrix's hostile or odd files (docs/fault-matrix.md, "Hostile files"): every file kvbench
reads as input (a model's config.json, a GGUF's header, a workload, a tolerances file, run.json and the
JSONL records) through kvbench.kv.bounded: a FIFO or a /dev/zero link is refused without blocking, size and
nesting are capped, a truncated or random GGUF is one line; each is exit 2 with one line, no traceback."""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.common.models import embedded_gguf
from kvbench.kv import bounded
from kvbench.kv.model_config import ConfigError, geometry_from_gguf, geometry_from_hf
from kvbench.store.errors import ResultsReadError
from kvbench.store.readers import load_cells, load_run_info
from tests.helpers import REPO
from tests.synth import make_run

TINY = 'name = "tiny"\nseed = 3\nprompt_tokens = [64]\noutput_tokens = 8\nconcurrency = [1]\n'


def hostile(folder: Path, name: str, kind: str) -> Path:
    """``folder/name`` as a FIFO (no writer: a plain open would block for ever), a symbolic link to
    /dev/zero (endless), or a folder."""
    path = folder / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


KINDS = {"fifo": "a FIFO", "dev_zero": "a character device", "folder": "a folder"}


def cli(*args, timeout=60):
    """kvbench in a fresh process (a blocking open would hang the test, not only the command)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_exit_2(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0] and "numpy" not in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- the reader itself ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_the_reader_refuses_what_is_no_regular_file_at_once(tmp_path, kind):
    path = hostile(tmp_path, "x.json", kind)
    t0 = time.monotonic()
    with pytest.raises(bounded.InputError, match=f"is {KINDS[kind]}, not a regular file"):
        bounded.read_json(path, what="config")
    assert time.monotonic() - t0 < 1.0


def test_the_reader_caps_size_and_depth(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b'{"a": "' + b"x" * (2 * bounded.MiB) + b'"}')
    with pytest.raises(bounded.InputError, match=r"big.json is 2.0 MiB, over the 1 MiB kvbench reads"):
        bounded.read_json(big, max_bytes=bounded.MiB, what="config")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(bounded.InputError, match="nests deeper than 64 levels"):
        bounded.read_json(deep)
    just = tmp_path / "just.json"
    just.write_text("[" * 64 + "]" * 64)
    assert bounded.depth(bounded.read_json(just)) == 64  # the bound itself is allowed
    over = tmp_path / "over.json"
    over.write_text("[" * 65 + "]" * 65)
    with pytest.raises(bounded.InputError, match="nests deeper than 64"):
        bounded.read_json(over)
    toml = tmp_path / "deep.toml"
    toml.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(bounded.InputError, match="nests deeper than 64"):
        bounded.read_toml(toml)


def test_a_symlink_to_a_regular_file_is_read(tmp_path):
    """The hub cache's config.json is a link into its blobs: a link is followed; what it reaches is checked."""
    real = tmp_path / "blob"
    real.write_text('{"a": 1}')
    (tmp_path / "config.json").symlink_to(real)
    assert bounded.read_json(tmp_path / "config.json") == {"a": 1}


# --- config.json ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])  # a folder named config.json: "no such file" in it
def test_a_config_json_that_is_no_regular_file_is_refused(tmp_path, kind):
    folder = tmp_path / "model"
    folder.mkdir()
    hostile(folder, "config.json", kind)
    with pytest.raises(ConfigError, match=f"config {folder}/config.json is {KINDS[kind]}, not a regular file"):
        geometry_from_hf(folder / "config.json")
    proc = cli("plan", folder / "config.json", timeout=60)
    one_line_exit_2(proc, f"is {KINDS[kind]}, not a regular file")


def test_a_config_json_nested_100000_deep_is_one_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_line_exit_2(cli("plan", config), "nests deeper than 64 levels")


# --- GGUF headers -----------------------------------------------------------------------------------------

def _damaged_ggufs(folder: Path) -> dict[str, Path]:
    data = embedded_gguf("smollm2").read_bytes()
    blobs = {"truncated_100": data[:100], "truncated_1MiB": data[:1 << 20],
             "random": random.Random(1).randbytes(4096),
             "magic_then_random": b"GGUF" + struct.pack("<I", 3) + random.Random(2).randbytes(4096),
             "empty": b""}
    out = {}
    for name, blob in blobs.items():
        out[name] = folder / f"{name}.gguf"
        out[name].write_bytes(blob)
    return out


def test_truncated_or_random_gguf_files_are_one_line(tmp_path):
    for name, path in _damaged_ggufs(tmp_path).items():
        with pytest.raises(ConfigError) as info:
            geometry_from_gguf(path)
        message = str(info.value)
        assert message.startswith(f"GGUF file {path}") and "\n" not in message, message
        assert ("not a GGUF file" in message or "damaged or cut short" in message), (name, message)
    data = embedded_gguf("smollm2").read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[:len(data) // 2])  # every key and tensor description whole: the data cut
    with pytest.raises(ConfigError, match=r"cut short: its tensor data reaches byte 98,360,128 \(the file has "):
        geometry_from_gguf(half)


@pytest.mark.parametrize("name", ["truncated_100", "random", "magic_then_random"])
def test_plan_and_run_refuse_a_damaged_gguf_in_one_line(tmp_path, name):
    path = _damaged_ggufs(tmp_path)[name]
    one_line_exit_2(cli("plan", path), f"GGUF file {path}")
    proc = cli("run", "-b", "openai", "--url", "http://127.0.0.1:9", "--model", path, "--workload", "smoke",
               "--results-dir", tmp_path / "results", "--run-id", "r")
    one_line_exit_2(proc, f"GGUF file {path}")
    assert not (tmp_path / "results" / "r").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_gguf_model_that_is_no_regular_file_is_refused_by_run(tmp_path, kind):
    path = hostile(tmp_path, "model.gguf", kind)
    proc = cli("run", "-b", "openai", "--url", "http://127.0.0.1:9", "--model", path, "--workload", "smoke",
               "--results-dir", tmp_path / "results", "--run-id", "r")
    one_line_exit_2(proc, f"is {KINDS[kind]}, not a regular file")


# --- workloads, run.json, the records --------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_a_workload_that_is_no_regular_file_is_refused(tmp_path, kind):
    path = hostile(tmp_path, "w.toml", kind)
    result = CliRunner().invoke(app, ["run", "-b", "openai", "--url", "http://127.0.0.1:9", "--workload", str(path),
                                      "--results-dir", str(tmp_path / "results"), "--run-id", "r"])
    assert result.exit_code == 2, result.output
    assert f"is {KINDS[kind]}, not a regular file" in result.output
    assert not (tmp_path / "results").exists()


def test_a_workload_too_large_or_too_deep_is_refused(tmp_path):
    big = tmp_path / "big.toml"
    big.write_text(TINY + "# " + "x" * (5 * bounded.MiB) + "\n")
    deep = tmp_path / "deep.toml"
    deep.write_text(TINY + "extra = " + "[" * 3000 + "]" * 3000 + "\n")
    for path, said in ((big, "over the 4 MiB kvbench reads"), (deep, "nests deeper than 64 levels")):
        result = CliRunner().invoke(app, ["run", "-b", "openai", "--url", "http://127.0.0.1:9", "--workload",
                                          str(path), "--results-dir", str(tmp_path / "results"), "--run-id", "r"])
        assert result.exit_code == 2 and said in result.output, result.output


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_run_json_or_record_that_is_no_regular_file_is_refused(tmp_path, kind):
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    (run / "run.json").unlink()
    hostile(run, "run.json", kind)
    with pytest.raises(ResultsReadError, match=f"^{run}/run.json is {KINDS[kind]}, not a regular file"):
        load_run_info(run)
    (run / "cells.jsonl").unlink()
    hostile(run, "cells.jsonl", kind)
    with pytest.raises(ResultsReadError, match=f"is {KINDS[kind]}, not a regular file"):
        load_cells(run)
    other = make_run(tmp_path, "b", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    proc = cli("compare", other, run)
    one_line_exit_2(proc, "not a regular file")


def test_a_run_json_nested_too_deep_is_a_read_error(tmp_path):
    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    (run / "run.json").write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ResultsReadError, match="nests deeper than 64 levels"):
        load_run_info(run)


# --- a model folder's other files: tokenizer.json, safetensors headers, the index, hf_quant_config ------------

def model_folder(where: Path) -> Path:
    """An HF model folder of the embedded model's config and tokenizer (no weights)."""
    from kvbench.common import models

    hf = models.hf_copy_dir(embedded_gguf("smollm2"))
    if not (hf / "tokenizer.json").exists():
        pytest.skip("the embedded model's HF copy is made by `make test` (kvbench setup)")
    where.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (where / name).write_bytes((hf / name).read_bytes())
    return where


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_tokenizer_json_that_is_no_regular_file_is_refused_before_the_run_folder(tmp_path, kind):
    """`kvbench run --model DIR` hung for ever (a FIFO) or filled memory (/dev/zero), with run.json left
    "running": now one line, exit 2, before the run folder exists."""
    folder = model_folder(tmp_path / "model")
    (folder / "tokenizer.json").unlink()
    hostile(folder, "tokenizer.json", kind)
    proc = cli("run", "-b", "openai:url=http://127.0.0.1:9", "--model", folder, "--workload", "smoke",
               "--results-dir", tmp_path / "results", "--run-id", "r")
    one_line_exit_2(proc, f"tokenizer {folder}/tokenizer.json is {KINDS[kind]}, not a regular file")
    assert not (tmp_path / "results").exists()


def test_a_tokenizer_that_turns_hostile_inside_the_run_fails_it_never_left_running(tmp_path, monkeypatch):
    """The same file replaced by a FIFO once the run has begun (or a GGUF's HF copy whose tokenizer is one):
    the prompt builder reads it within bounds inside the run's try, and run.json says "failed" with why."""
    import io

    from rich.console import Console

    from kvbench.common.models import ModelError
    from kvbench.run import runner
    from kvbench.run.backend_config import BackendConfig
    from kvbench.workloads import load

    folder = model_folder(tmp_path / "model")
    resolve = runner.resolve_model

    def then_a_fifo(options, console):
        model = resolve(options, console)
        (folder / "tokenizer.json").unlink()
        os.mkfifo(folder / "tokenizer.json")
        return model

    monkeypatch.setattr(runner, "resolve_model", then_a_fifo)
    options = runner.RunOptions(model=str(folder), workload=load("smoke"), results_dir=tmp_path / "results",
                                run_id="r", backends=[BackendConfig.parse("openai:url=http://127.0.0.1:9")])
    with pytest.raises(ModelError, match=f"tokenizer {folder}/tokenizer.json is a FIFO, not a regular file"):
        runner.Runner(options, Console(file=io.StringIO())).run()
    info = load_run_info(tmp_path / "results" / "r")
    assert info["status"] == "failed" and "is a FIFO" in info["error"]
    assert info["invocations"][-1]["status"] == "failed"


def test_a_tokenizer_json_that_is_not_one_is_one_line(tmp_path):
    from kvbench.workloads.prompts import PromptBuilder

    (tmp_path / "tokenizer.json").write_text('{"model": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(bounded.InputError, match="not a tokenizer.json the tokenizers library reads"):
        PromptBuilder(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_validate_s_families_refuse_a_tokenizer_that_is_no_regular_file(tmp_path, kind, monkeypatch):
    from kvbench.run import validate

    monkeypatch.setattr(validate, "env_python", lambda env: pytest.fail("nothing may be built"))
    hostile(tmp_path, "tokenizer.json", kind)
    built, errors = validate.prepare(validate.families()[:2], tmp_path)
    assert built == [] and len(errors) == 2
    assert all(f"is {KINDS[kind]}, not a regular file" in e for e in errors.values()), errors


def _safetensors(path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


@pytest.mark.parametrize("case, says", [
    ("claims 2**62", "its header claims 4,611,686,018,427,387,904 bytes"),
    ("short", "too short for a header"),
    ("deep", "nests deeper than 64 levels"),
    ("not json", "not valid JSON"),
    ("offsets", "has no data_offsets of two integers within the file"),
    ("fifo", "is a FIFO, not a regular file"),
])
def test_a_hostile_safetensors_header_is_said_not_read(tmp_path, case, says):
    """The header's length was taken on trust (a 2**62 claim read the whole file into memory), its JSON
    parsed unbounded: now each is an unknown figure with the reason, never a traceback."""
    from kvbench.kv import weights

    f = tmp_path / "model.safetensors"
    if case == "claims 2**62":
        _safetensors(f, b"{}", length=2**62)
    elif case == "short":
        f.write_bytes(b"\x01\x02")
    elif case == "deep":
        _safetensors(f, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    elif case == "not json":
        _safetensors(f, b"\xff" * 16)
    elif case == "offsets":
        _safetensors(f, b'{"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 99999999]}}', data=b"\0" * 4)
    else:
        os.mkfifo(f)
    started = time.perf_counter()
    with pytest.raises(bounded.InputError, match=says):
        weights.safetensors_bytes(tmp_path)
    found = weights.of_folder(tmp_path, None)
    assert found.bytes is None and found.source.startswith("unknown: ") and says.split(" (")[0] in found.source
    assert time.perf_counter() - started < 5
    good = tmp_path / "good"
    good.mkdir()
    _safetensors(good / "a.safetensors", b'{"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}',
                 data=b"\0" * 4)
    assert weights.safetensors_bytes(good) == 4


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep"])
def test_an_index_or_hf_quant_config_that_is_not_readable_is_left_out_without_blocking(tmp_path, kind):
    from kvbench.kv import weights

    for name in ("model.safetensors.index.json", "hf_quant_config.json"):
        if kind == "deep":
            (tmp_path / name).write_text('{"metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
        else:
            hostile(tmp_path, name, kind)
    assert weights.index_total_size(tmp_path) is None
    found = weights.for_model(tmp_path / "config.json", None, None)  # no config: the exact figure or unknown
    assert found.bytes is None and found.source.startswith("unknown")


# --- the records a resume or a report reads ---------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_requests_jsonl_that_is_no_regular_file_refuses_the_resume(tmp_path, kind):
    from kvbench.store.writer import RunWriter

    run = make_run(tmp_path, "a", repeats=1, prompts=(1024,), concurrency=(1,), n_requests=2)
    (run / "requests.jsonl").unlink()
    hostile(run, "requests.jsonl", kind)
    writer = RunWriter(run, mode="resume")
    with pytest.raises(ResultsReadError, match=f"requests.jsonl is {KINDS[kind]}, not a regular file"):
        writer.discard_unfinished_requests()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep"])
def test_a_logprobs_file_that_is_not_readable_is_one_warning(tmp_path, kind):
    from kvbench.store.readers import load_logprobs

    (tmp_path / "logprobs").mkdir()
    if kind == "deep":
        (tmp_path / "logprobs" / "c.json").write_text('{"cell_id": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        hostile(tmp_path / "logprobs", "c.json", kind)
    (tmp_path / "logprobs" / "good.json").write_text(json.dumps(
        {"cell_id": "good", "requests": [{"request_id": "q", "tokens": [1], "top": [[[1, -0.5]]]}]}))
    with pytest.warns(UserWarning, match="c.json: unreadable"):
        out = load_logprobs(tmp_path)
    assert list(out) == ["good"] and out["good"]["q"]["top"] == [{1: -0.5}]


# --- a config of many layers: the work grows with the layers, never with their square ---------------------

def _rule_calls(tmp_path, layers: int, monkeypatch) -> int:
    """Calls of the engines' per-layer KV rules (tokens_kept, layer_bytes_per_token, on every rules class)
    while a config of ``layers`` uniform layers is planned under the plain formula and vLLM on a GPU."""
    from kvbench.backends import REGISTRY, kv_rules
    from kvbench.kv.rules import KVRules
    from kvbench.planner import PlanInput, plan, resolve_model
    from tests.helpers import DATA

    for engine in REGISTRY:  # every engine's rules class loaded, so that each is counted
        kv_rules(engine)
    calls = [0]

    def counting(method):
        def counted(*args, **kwargs):
            calls[0] += 1
            return method(*args, **kwargs)
        return counted

    classes, todo = [], [KVRules]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    with monkeypatch.context() as patch:
        for cls in classes:
            for name in ("tokens_kept", "layer_bytes_per_token"):
                if name in cls.__dict__:
                    patch.setattr(cls, name, counting(cls.__dict__[name]))
        raw = json.loads((DATA / "configs" / "llama-3.1-8b.json").read_text())
        raw["num_hidden_layers"] = layers
        (tmp_path / f"{layers}.json").write_text(json.dumps(raw))
        model = resolve_model(str(tmp_path / f"{layers}.json"))
        plans = [plan(PlanInput(model=model, context=8192)),
                 plan(PlanInput(model=model, context=8192, engine="vllm", gpu="H100-80GB"))]
        assert plans[0]["layers"] == layers and plans[1]["levers"] is not None
    return calls[0]


def test_twice_the_layers_cost_the_rules_twice_the_calls_not_four_times(tmp_path, monkeypatch):
    """1,000 layers took 15 s and 2,000 54 s (quadratic: the rules asked of every layer, and each read the
    whole geometry). Counted, not timed: 2,000 uniform layers cost the engines' per-layer rules at most
    2.2 times the calls 1,000 do (linear; quadratic would be 4 times). The answer's total asks each distinct
    layer once; the bytes per token a layer still asks of every layer (~445 calls a layer over both plans)."""
    n, twice = _rule_calls(tmp_path, 1000, monkeypatch), _rule_calls(tmp_path, 2000, monkeypatch)
    assert n > 0 and twice <= 2.2 * n, (n, twice)
