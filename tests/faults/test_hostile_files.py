"""The third fault matrix's hostile or odd files (docs/fault-matrix.md, "Hostile files"): every file kvbench
reads as input (a model's config.json, a GGUF's header, a workload, a tolerances file, run.json and the
JSONL records) through kvbench.kv.bounded: a FIFO or a /dev/zero link is refused without blocking, size and
nesting are capped, a truncated or random GGUF is one line; each is exit 2 with one line, no traceback."""
from __future__ import annotations

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
