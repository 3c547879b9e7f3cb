"""Bad input at the edge (issue 22): every refusal is one line on stderr and exit 2, with no traceback and no
run folder; damaged numbers in a stored run are a clear error naming file, line and field; a cell of 10^6
requests has its first prompt at once and holds none of the others."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.load import LoadPoint
from kvbench.run.backend_config import BackendConfig, ConfigError
from kvbench.run.cells import CellPrompts, cells_for
from kvbench.store.errors import ResultsReadError
from kvbench.store.readers import load, load_cells
from kvbench.workloads import Workload, WorkloadError
from kvbench.workloads import load as load_workload
from kvbench.workloads.prompts import PromptBuilder
from tests.helpers import REPO

PUBLISHED = REPO / "results" / "published" / "20261130-194844-cpu-default"
# an attach-only backend aimed at a closed port: were a refusal to let a run through, it would fail its
# cells at once instead of starting an engine
ATTACH = ["-b", "openai", "--url", "http://127.0.0.1:9"]
TINY = 'name = "tiny"\nseed = 3\nprompt_tokens = [64]\noutput_tokens = 8\nconcurrency = [1]\n'


def refused(result, *needles):
    """Exit 2, one line on stderr saying ``needles``, no exception escaping the command."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def no_run_goes_on(monkeypatch):
    """Were a refusal to let a run through, it stops here instead of starting an engine."""
    import kvbench.run.runner

    def runner(*args, **kwargs):
        raise AssertionError("the input was not refused: a Runner was made")

    monkeypatch.setattr(kvbench.run.runner, "Runner", runner)


def kvbench_run(tmp_path, *args):
    results = tmp_path / "results"
    result = CliRunner().invoke(app, ["run", "--results-dir", str(results), "--run-id", "r", *args])
    assert not results.exists(), "a refused run created its folder"
    return result


# --- kvbench run and kvbench plan: the arguments ----------------------------------------------------

LONG_ID = "a/" + "b" * 198


@pytest.mark.parametrize("model, says", [
    ("x/..", "neither an existing path nor a hub id"),
    ("org/name..--x", "Cannot have -- or .."),
    (LONG_ID, "maximum length is 96"),
    ("m" * 300, "cannot be a path (file name too long)"),
], ids=["dotdot", "double-dash", "200-char-id", "300-char-name"])
def test_a_model_that_is_neither_a_path_nor_a_hub_id_is_refused_by_run_and_plan(tmp_path, model, says):
    line = refused(kvbench_run(tmp_path, "--model", model, *ATTACH), says)
    assert len(line) < 400  # a 200-character name is cut short, not repeated whole
    refused(CliRunner().invoke(app, ["plan", model]), says)


REFUSED_ARGS = [
    (["--request-timeout", "0"], "--request-timeout takes a number of seconds above 0, not 0.0"),
    (["--request-timeout", "-5"], "not -5.0"),
    (["--request-timeout", "nan"], "not nan"),
    (["--request-timeout", "inf"], "not inf"),
    (["--start-timeout", "nan"], "--start-timeout takes a number of seconds above 0"),
    (["--max-context", "0"], "--max-context takes a number of tokens of 1 or more, not 0"),
    (["--max-context", "-8"], "not -8"),
    (["--max-context", "abc"], "Invalid value for '--max-context'"),  # click's own: one line here too
    (["--repeats", "0"], "Invalid value for '--repeats'"),
    (["--url", "http://127.0.0.1:"], "has no port after the ':'"),
    (["--url", "http://127.0.0.1:0"], "has port 0"),
    (["--url", "http://127.0.0.1:70000"], "a port is 1-65535"),
    (["--url", "ftp://127.0.0.1:21"], "must look like http://host:port"),
    (["--prometheus", "http://user:secret@prom:"], "--prometheus 'http://***@prom:' has no port"),
    (["-b", "llamacpp:threads=0"], "option 'threads' for llamacpp takes an integer 1 or more, not 0"),
    (["-b", "vllm:gpu_memory_utilization=nan"], "takes a finite number, not nan"),
    (["-b", "vllm:gpu_memory_utilization=1.5"], "takes a number up to 1, not 1.5"),
    (["-b", "vllm@../../x"], "the version of vllm '../../x' is not a plain name"),
]


@pytest.mark.parametrize("args, says", REFUSED_ARGS, ids=[" ".join(args) for args, _ in REFUSED_ARGS])
def test_numbers_urls_and_option_values_are_refused_before_the_run_folder(tmp_path, args, says):
    backend = [] if "-b" in args else ATTACH if "--url" not in args else ["-b", "openai"]
    args = [f"{a},url=http://127.0.0.1:9" if "=" in a else a for a in args]  # attach: nothing to start
    line = refused(kvbench_run(tmp_path, *backend, *args), says)
    assert "secret" not in line


def test_plan_refuses_numbers_that_are_not_finite():
    refused(CliRunner().invoke(app, ["plan", "llama-3-8b", "--gpu", "H100-80GB", "--margin", "nan"]),
            "--margin takes a finite number, not nan")
    refused(CliRunner().invoke(app, ["plan", "llama-3-8b", "--gpu", "H100-80GB", "--overhead-gib", "inf"]),
            "--overhead-gib takes a finite number")


# --- workloads -------------------------------------------------------------------------------------------

OPEN_LOOP = 'load_profile = "poisson"\nrequests = 4\n'


@pytest.mark.parametrize("extra, says", [
    ("duration_s = inf\n", "duration_s: Input should be a finite number"),
    (OPEN_LOOP + "request_rates = [nan]\n", "request rate nan must be a finite number of requests/s above 0"),
    (OPEN_LOOP + "request_rates = [inf]\n", "request rate inf"),
    (OPEN_LOOP + "request_rates = [true]\n", "request_rates = [true]: true and false are not numbers"),
    ("slo_ttft_s = nan\n", "slo_ttft_s: Input should be a finite number"),
    ("rounds = true\n", "rounds = true: true and false are not numbers"),
], ids=["duration-inf", "rate-nan", "rate-inf", "rate-true", "slo-nan", "rounds-true"])
def test_a_workload_with_a_number_that_is_none_is_refused(tmp_path, extra, says):
    body = TINY.replace("concurrency = [1]\n", "concurrency = [1]\n" if "poisson" not in extra else "")
    (tmp_path / "w.toml").write_text(body + extra)
    with pytest.raises(WorkloadError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_workload(str(tmp_path / "w.toml"))
    refused(kvbench_run(tmp_path, "--workload", str(tmp_path / "w.toml"), *ATTACH), says)


HUGE = [
    ("repeats = 1000000000000\n", "repeats = 1,000,000,000,000: at most 1,000"),
    ("warmup_requests = 1000000000000\n", "warmup_requests = 1,000,000,000,000: at most 10,000"),
    ("rounds = 1000000000000\n", "load: a cell of 1,000,000,000,000 requests"),
    ("requests = 1000000000000\n", "load: a cell of 1,000,000,000,000 requests"),
    ("requests = 4\n", "load: 1,000,000,000,000 requests in flight at once"),  # concurrency = [10**12]
    (OPEN_LOOP.replace("requests = 4\n", "") + "request_rates = [1e300]\nduration_s = 1e300\n",
     "request_rates x duration_s is beyond any count of requests"),
    ("repeats = 1000\n", "x 1,000 repeats = 101,000 cells per engine start: at most 100,000"),
]


@pytest.mark.parametrize("extra, says", HUGE, ids=["repeats", "warmup", "rounds", "requests", "concurrency",
                                                   "rate-x-duration", "cells"])
def test_a_workload_asking_for_counts_beyond_memory_is_refused_at_once(tmp_path, extra, says):
    """10**12 repeats ended in a MemoryError traceback in RunPlan.cells(): every count is bounded."""
    body = TINY
    if "poisson" in extra:
        body = body.replace("concurrency = [1]\n", "")
    elif "in flight" in says:
        body = body.replace("concurrency = [1]", "concurrency = [1000000000000]")
    elif "cells" in says:
        body = body.replace("concurrency = [1]", f"concurrency = {list(range(1, 102))}")
    (tmp_path / "w.toml").write_text(body + extra)
    started = time.perf_counter()
    with pytest.raises(WorkloadError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_workload(str(tmp_path / "w.toml"))
    refused(kvbench_run(tmp_path, "--workload", str(tmp_path / "w.toml"), *ATTACH), says)
    assert time.perf_counter() - started < 10


def test_repeats_beyond_the_bound_are_refused(tmp_path):
    refused(kvbench_run(tmp_path, "--workload", "smoke", "--repeats", "1000000000000", *ATTACH),
            "--repeats 1,000,000,000,000: at most 1,000")
    (tmp_path / "w.toml").write_text(TINY.replace("concurrency = [1]", f"concurrency = {list(range(1, 102))}"))
    refused(kvbench_run(tmp_path, "--workload", str(tmp_path / "w.toml"), "--repeats", "1000", *ATTACH),
            "= 101,000 cells per engine start: at most 100,000")


def test_a_true_prompt_length_is_refused(tmp_path):
    (tmp_path / "w.toml").write_text(TINY.replace("[64]", "[true]"))
    refused(kvbench_run(tmp_path, "--workload", str(tmp_path / "w.toml"), *ATTACH),
            "prompt_tokens = [true]: true and false are not numbers")


def test_a_workload_with_no_length_that_fits_is_refused_before_the_run_folder(tmp_path):
    (tmp_path / "w.toml").write_text(TINY)
    refused(kvbench_run(tmp_path, "--workload", str(tmp_path / "w.toml"), "--max-context", "32", *ATTACH),
            "no prompt length of tiny fits the context limit 32")


def test_a_workload_longer_than_the_embedded_models_context_is_refused_before_the_run_folder(tmp_path, smollm2):
    # the GGUF's limit, read from the HF copy an earlier run made (the hash is cached for the run itself)
    (tmp_path / "w.toml").write_text(TINY.replace("[64]", "[100000]"))
    refused(kvbench_run(tmp_path, "--workload", str(tmp_path / "w.toml"), *ATTACH),
            f"no prompt length of tiny fits the context limit {smollm2.geometry.max_context}")


def test_valid_input_still_passes_the_checks():
    assert BackendConfig.parse("vllm:gpu_memory_utilization=1,tp=2").options == {"gpu_memory_utilization": 1.0,
                                                                                  "tp": 2}
    assert BackendConfig.parse("hf:batch_wait_ms=0").options == {"batch_wait_ms": 0}
    with pytest.raises(ConfigError, match="option 'batch_wait_ms' for hf takes an integer 0 or more, not -1"):
        BackendConfig.parse("hf:batch_wait_ms=-1")
    assert BackendConfig.parse("openai:url=https://h.example/v1").url == "https://h.example/v1"
    with pytest.raises(ConfigError, match="has no port"):
        BackendConfig.parse("openai:url=http://h:")
    w = Workload(name="w", seed=1, prompt_tokens=[64, "max"], output_tokens=8, load_profile="poisson",
                 request_rates=[0.5, 2], requests=4, duration_s=10)
    assert w.load.request_rates == [0.5, 2.0] and w.load.duration_s == 10.0


def test_a_refusal_through_the_real_command_has_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "--model", "org/name..--x", *ATTACH,
                           "--results-dir", str(tmp_path / "results")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "300", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()


# --- numbers in stored records ------------------------------------------------------------------------------

def damaged_copy(tmp_path, field: str, value: str) -> Path:
    """A copy of a published run (its records only) whose first cell row has ``field`` set to ``value``."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run.json", "cells.jsonl", "requests.jsonl"):
        shutil.copy(PUBLISHED / name, run / name)
    lines = (run / "cells.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    assert field in row
    lines[0] = lines[0].replace(f'"{field}":{json.dumps(row[field])}', f'"{field}":{value}', 1)
    assert value in lines[0]
    (run / "cells.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize("field, value, says", [
    ("prompt_tokens", "NaN", "prompt_tokens is NaN"),
    ("ttft_s_p50", "NaN", "ttft_s_p50 is NaN"),
    ("wall_s", "Infinity", "wall_s is Infinity"),
    ("n_requests", "99999999999999999999999", "n_requests is 99999999999999999999999, beyond a 64-bit integer"),
], ids=["nan-int-field", "nan-float-field", "infinity", "above-int64"])
def test_a_damaged_number_in_a_record_is_a_clear_error_for_report_and_compare(tmp_path, field, value, says):
    run = damaged_copy(tmp_path, field, value)
    with pytest.raises(ResultsReadError, match=f"cells.jsonl line 1: damaged row: {says}"):
        load_cells(run)
    with pytest.raises(ResultsReadError, match="damaged row"):
        load(run)
    out = tmp_path / "out"
    refused(CliRunner().invoke(app, ["report", str(run), "-o", str(out)]), "line 1: damaged row", says)
    assert not out.exists()
    refused(CliRunner().invoke(app, ["compare", str(PUBLISHED), str(run)]), "damaged row", says)


# --- a cell of a million requests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def builder(smollm2):
    b = PromptBuilder(smollm2.hf_dir / "tokenizer.json")
    b.word_ids  # the one-off vocabulary scan, outside what is measured
    return b


def test_a_million_request_cell_has_its_first_prompt_at_once_and_holds_none(builder):
    w = Workload(name="million", seed=1, prompt_tokens=[64], output_tokens=8, concurrency=[4], requests=10**6)
    cell = cells_for(w, [64], [LoadPoint("concurrent", 4)], 0, None)[0]
    source = CellPrompts(builder, w)
    rss = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    prompts = source.for_cell(cell, w.load.requests_per_cell(cell.load))
    first = prompts[0]
    assert time.perf_counter() - t0 < 3  # building all 10^6 first took over a minute here
    assert len(prompts) == 10**6 and first.prompt_tokens == 64
    for i, prompt in enumerate(prompts):  # streamed as a load takes them
        if i == 20_000:
            break
    # 20,000 prompts kept would be ~60 MiB (10^5 took 304 MiB when all were built up front)
    assert psutil.Process().memory_info().rss - rss < 20 * 2**20
    # token-exact and the same whenever built: the last one alone, then again, then through iteration
    assert prompts[-1] == prompts[10**6 - 1] and prompts[-1].request_id.endswith("-999999")
    assert prompts[5] == list(prompts[:6])[5] == next(p for i, p in enumerate(prompts) if i == 5)
    assert prompts[1] != prompts[2]
    with pytest.raises(IndexError):
        prompts[10**6]
    assert len(prompts[10:20]) == 10


def test_a_nan_inside_a_requests_list_field_is_a_damaged_row(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(PUBLISHED / "run.json", run / "run.json")
    lines = (PUBLISHED / "requests.jsonl").read_text().splitlines()
    row = json.loads(lines[2])
    lines[2] = lines[2].replace(f'"chunk_times":[{row["chunk_times"][0]!r}', '"chunk_times":[NaN', 1)
    assert '"chunk_times":[NaN' in lines[2]
    (run / "requests.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ResultsReadError, match=r"requests.jsonl line 3: damaged row: chunk_times is NaN"):
        load(run, what="requests")
