"""How fast long prompts are ready: ``python -m kvbench.selfcheck.prompt_bench``.

Launches ``kvbench run`` against the local mock server (``kvbench.selfcheck.mock_server``, instant answers) with a
workload of ``--requests`` prompts of ``--prompt-tokens`` tokens each (default 100 x 32K) all sent at
once, and prints the time from launching the command to the mock reading the first request, plus the
in-process figure for building the same prompts. The mock's read time and the launch time are both
``time.perf_counter()`` (CLOCK_MONOTONIC on Linux), so they compare across the two processes.

The model is the embedded SmolLM2 tokenizer in a folder whose config allows a 40K context (no weights
are needed: the mock generates nothing). Every figure comes from the run; nothing is assumed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

from kvbench.selfcheck.common import Mock


def model_folder(root: Path, context: int) -> Path:
    """The embedded model's tokenizer and config, the context raised to ``context`` tokens."""
    from kvbench.backends import gguf_converter
    from kvbench.common import models

    source = models.resolve("smollm2", gguf_converter()).hf_dir
    folder = root / "smollm2-long"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = context
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def one_launch(folder: Path, workload: Path, mock: Mock, results: Path) -> dict:
    mock.records()  # clear
    # the mock serves the name "mock" for any model: the run is told so (--allow-model-mismatch)
    argv = [sys.executable, "-m", "kvbench.cli", "run", "-b", f"openai:url={mock.url},served_model=mock",
            "--model", str(folder), "--allow-model-mismatch", "--workload", str(workload), "--results-dir",
            str(results)]
    t_launch = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    t_exit = time.perf_counter()
    if done.returncode != 0:
        raise RuntimeError(f"kvbench run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    reads = sorted(r["t_recv"] for r in mock.records())
    return {"first_request_s": reads[0] - t_launch, "last_request_s": reads[-1] - t_launch,
            "requests": len(reads), "exit_s": t_exit - t_launch}


def in_process(folder: Path, n_requests: int, n_tokens: int) -> dict:
    from kvbench.load import LoadPoint
    from kvbench.run.cells import CellPrompts, cells_for
    from kvbench.workloads import Workload
    from kvbench.workloads.prompts import PromptBuilder

    from kvbench.workloads import prompts as prompt_words

    def words_s() -> float:  # the words of a tokenizer this process has not read yet
        prompt_words._WORDS_BY_TOKENIZER.clear()
        t0 = time.perf_counter()
        PromptBuilder(folder / "tokenizer.json").word_ids  # noqa: B018
        return time.perf_counter() - t0

    # a home of no kept words: the vocabulary scan and joining check, then the words that scan kept
    with tempfile.TemporaryDirectory() as home, patch.dict(os.environ, {"KVBENCH_HOME": home}):
        scan_s, kept_s = words_s(), words_s()
    builder = PromptBuilder(folder / "tokenizer.json")
    t1 = time.perf_counter()
    w = Workload(name="prompt_bench", seed=1, prompt_tokens=[n_tokens], output_tokens=1, concurrency=[n_requests])
    cell = cells_for(w, [n_tokens], [LoadPoint("concurrent", n_requests)], 0, None)[0]
    prompts = list(CellPrompts(builder, w).for_cell(cell, n_requests))  # each built when asked: ask for all
    t2 = time.perf_counter()
    assert all(p.prompt_tokens == n_tokens for p in prompts)
    return {"tokenizer_scan_s": scan_s, "kept_words_s": kept_s, "build_s": t2 - t1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = model_folder(root, args.prompt_tokens + 8192)
        workload = root / "prompt_bench.toml"
        workload.write_text(f'name = "prompt_bench"\nseed = 1\nprompt_tokens = [{args.prompt_tokens}]\n'
                            f'output_tokens = 1\nconcurrency = [{args.requests}]\nwarmup_requests = 0\n')
        with Mock(ttft_ms=0, itl_ms=0, cpu=None) as mock:
            launches = [one_launch(folder, workload, mock, root / "runs") for _ in range(args.repeats)]
        builds = [in_process(folder, args.requests, args.prompt_tokens) for _ in range(args.repeats)]
    print(f"{args.requests} prompts of {args.prompt_tokens:,} tokens, {os.cpu_count()} cores, "
          f"medians of {args.repeats} launches:")
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(f"  launch of `kvbench run` -> first request read by the mock: {med(launches, 'first_request_s'):.2f} s "
          f"(all {launches[0]['requests']} read by {med(launches, 'last_request_s'):.2f} s)")
    print(f"  in process: tokenizer scan {med(builds, 'tokenizer_scan_s'):.2f} s (the first run of a tokenizer), "
          f"its kept words read {med(builds, 'kept_words_s'):.2f} s (every later run), "
          f"building the prompts {med(builds, 'build_s'):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
