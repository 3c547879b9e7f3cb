"""How much load can kvbench send from one process and from several? The multi-process load generator
(:mod:`kvbench.load.workers`, ``kvbench run --load-workers N``) against the mock server, every worker
count in one run.

``python -m kvbench.selfcheck.workers_bench --workers 1,2 --repeats 3`` starts
:mod:`kvbench.selfcheck.mock_server` in a process of its own pinned to one core and lets the load
generator (this process and the workers it spawns, which inherit its CPU affinity) use the other cores.
For each worker count it measures, with kvbench's own load generator, vLLM adapter and metrics, as
``kvbench run`` drives them:

(a) the tokens/s ceiling: an instant mock (the whole response in one write), ``--tokens`` output tokens
    per request, ``--concurrency`` streams;
(b) the requests/s ceiling: the instant mock, one output token per request, the same streams;
(c) the TTFT error: a timed mock (first token ``--ttft-ms`` after it read the request), concurrency
    ``--accuracy-concurrency``: reported TTFT minus programmed, p50 and p99.

Rates count from the common start of the workers to the last request's end (process start-up, 0.3-1 s a
worker, is outside the cell, as in ``kvbench run``). Figures are medians over ``--repeats`` runs.

``--split`` measures instead how a closed loop's requests are best split over the workers: dealt out up
front (each worker's streams run through its own share) or taken from one shared queue (a free stream takes
the cell's next request, in whichever worker it is): the timed mock, requests of ``--split-tokens`` output
tokens drawn at random per request (a spread of request times, as a real engine's scheduling gives), at
``--accuracy-concurrency``; per split the cell's wall time, its requests/s, and the requests in flight on
average (the requests' summed time in flight over the wall time: the concurrency the cell kept).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvbench.common.metrics import RequestTimes, cell_metrics
from kvbench.load import LoadPoint, LoadSettings, run, run_async
from kvbench.load.workers import run_workers
from kvbench.workloads.prompts import Prompt

from .client_bench import check_results, machine, make_prompts, mock_backend
from .common import Mock, median_finite

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])
console = Console(width=200)


def drive(url: str, prompts, concurrency: int, workers: int):
    t_call = time.perf_counter()
    load = run_async(run(mock_backend(url), prompts, LoadPoint("concurrent", concurrency),
                         LoadSettings(60.0, workers=workers)))
    return load, load.t_start - t_call


def ceiling_run(mock: Mock, workers: int, concurrency: int, n: int, tokens: int, start: int) -> dict:
    load, startup = drive(mock.url, make_prompts(n, tokens, start), concurrency, workers)
    good = [r for r in load.results if not r.error and r.chunk_times]
    wall = max(r.t_done for r in good) - load.t_start if good else float("nan")
    out_tokens = sum(sum(r.chunk_tokens) for r in good)
    return {"requests": len(load.results), "failed": check_results(load.results, tokens),
            "requests_per_s": len(good) / wall, "tokens_per_s": out_tokens / wall, "startup_s": startup,
            "loop_lag_ms": (load.loop_lag_s_max or 0) * 1000}


def accuracy_run(mock: Mock, workers: int, concurrency: int, n: int, tokens: int, ttft_s: float, start: int) -> dict:
    load, _ = drive(mock.url, make_prompts(n, tokens, start), concurrency, workers)
    mock.records()  # keep the mock's list short
    good = [r for r in load.results if not r.error and r.chunk_times]
    m = cell_metrics([RequestTimes.of(r) for r in good], [r.prompt_tokens_sent for r in good])
    return {"requests": len(load.results), "failed": check_results(load.results, tokens),
            "ttft_p50_err_ms": (m["ttft_s_p50"] - ttft_s) * 1000, "ttft_p99_err_ms": (m["ttft_s_p99"] - ttft_s) * 1000}


def split_run(mock: Mock, workers: int, concurrency: int, prompts: list, queue: bool) -> dict:
    """One closed-loop cell from ``workers`` processes, its requests dealt out (``queue`` False) or shared."""
    point, settings = LoadPoint("concurrent", concurrency), LoadSettings(60.0, workers=workers)
    if workers == 1:
        load = run_async(run(mock_backend(mock.url), prompts, point, settings))
    else:
        load = run_workers(mock_backend(mock.url), prompts, point, settings, queue=queue)
    mock.records()
    good = [r for r in load.results if not r.error and r.t_done]
    wall = max(r.t_done for r in good) - min(r.t_sent for r in good)
    return {"requests": len(load.results), "failed": len(load.results) - len(good), "wall_s": wall,
            "requests_per_s": len(good) / wall, "mean_in_flight": sum(r.t_done - r.t_sent for r in good) / wall}


def spread_prompts(n: int, tokens: tuple[int, int], seed: int, start: int) -> list:
    """``n`` prompts of a random number of output tokens each (uniform in ``tokens``), the same for a seed."""
    import random

    draw = random.Random(seed)
    return [Prompt(f"r{start + i}", (start + i, 1, 2, 3), "", draw.randint(*tokens)) for i in range(n)]


def split_table(mock: Mock, counts: list[int], concurrency: int, n: int, tokens: tuple[int, int],
                repeats: int) -> list[dict]:
    rows = []
    for w in counts:
        for queue in ((True,) if w == 1 else (False, True)):
            runs = [split_run(mock, w, concurrency, spread_prompts(n, tokens, seed, 10_000 * (seed + 1)), queue)
                    for seed in range(repeats)]
            row = median_of(runs)
            rows.append({"workers": w, "split": "one process" if w == 1 else ("shared queue" if queue else "dealt"),
                         **row})
            console.print(f"workers={w} {rows[-1]['split']}: done")
    return rows


def median_of(runs: list[dict]) -> dict:
    out = {k: median_finite(r[k] for r in runs) for k in runs[0] if k not in ("requests", "failed")}
    out["requests"] = sum(r["requests"] for r in runs)
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(flags.split(":", 1)[1].split())
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have) or "none of avx2/avx512"


@app.command()
def main(
    workers: str = typer.Option("1,2", help="worker counts, comma-separated (1 = the single-process client)"),
    repeats: int = typer.Option(3, help="runs of each measurement; the table shows medians"),
    concurrency: int = typer.Option(64, help="ceilings: concurrent streams"),
    tokens: int = typer.Option(256, help="tokens/s ceiling: output tokens per request"),
    requests: int = typer.Option(1024, help="tokens/s ceiling: requests per run"),
    rate_requests: int = typer.Option(8192, help="requests/s ceiling: requests per run"),
    ttft_ms: float = typer.Option(20.0, help="accuracy: programmed time to first token"),
    itl_ms: float = typer.Option(5.0, help="accuracy: programmed inter-token latency"),
    accuracy_tokens: int = typer.Option(32, help="accuracy: output tokens per request"),
    accuracy_concurrency: int = typer.Option(16, help="accuracy: concurrent streams"),
    accuracy_requests: int = typer.Option(128, help="accuracy: requests per run"),
    quick: bool = typer.Option(False, "--quick", help="a few requests per measurement (for tests)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write the results here"),
    pin: bool = typer.Option(True, help="the mock on a core of its own, the load generator on the others "
                                        "(--no-pin: every process on every core)"),
    split: bool = typer.Option(False, "--split", help="measure a closed loop's split over the workers instead: "
                                                      "requests dealt out up front against one shared queue"),
    split_tokens: str = typer.Option("8,128", help="--split: output tokens per request, drawn uniformly in MIN,MAX"),
):
    counts = [int(w) for w in workers.split(",") if w.strip()]
    if quick:
        repeats, requests, rate_requests, accuracy_requests = 1, 4 * concurrency, 4 * concurrency, 2 * accuracy_concurrency
    cpus = sorted(os.sched_getaffinity(0))
    mock_cpu = cpus[0] if len(cpus) >= 2 and pin else None
    client_cpus = set(cpus[1:]) if mock_cpu is not None else set(cpus)
    os.sched_setaffinity(0, client_cpus)  # the workers inherit it
    info = {"machine": machine(), "cpu_flags": cpu_flags(), "mock_cpu": mock_cpu, "client_cpus": sorted(client_cpus),
            "command": " ".join(["python -m kvbench.selfcheck.workers_bench", *sys.argv[1:]]), "repeats": repeats}
    console.print(f"machine: {info['machine']}; flags {info['cpu_flags']}; mock on CPU {mock_cpu}, load "
                  f"generator on CPUs {info['client_cpus']}")
    rows = []
    start = 1000
    if split:
        low, high = (int(t) for t in split_tokens.split(","))
        with Mock(ttft_ms, itl_ms, mock_cpu) as timed:
            info["split_rows"] = split_table(timed, counts, accuracy_concurrency, accuracy_requests, (low, high),
                                             repeats)
        table = Table(title=f"a closed loop's split: timed mock (TTFT {ttft_ms:g} ms, ITL {itl_ms:g} ms), {low}-{high} "
                            f"output tokens a request, concurrency {accuracy_concurrency}, {accuracy_requests} "
                            f"requests, medians of {repeats}")
        for col in ("workers", "split", "wall s", "requests/s", "in flight (mean)", "failed / requests"):
            table.add_column(col, justify="right")
        for row in info["split_rows"]:
            table.add_row(str(row["workers"]), row["split"], f"{row['wall_s']:.3f}", f"{row['requests_per_s']:.1f}",
                          f"{row['mean_in_flight']:.2f}", f"{row['failed']} / {row['requests']}")
        console.print(table)
        if json_out:
            json_out.write_text(json.dumps(info, indent=2, default=float))
        return
    with Mock(0, 0, mock_cpu, record_sends=False) as instant, Mock(ttft_ms, itl_ms, mock_cpu) as timed:
        ceiling_run(instant, 1, concurrency, concurrency, tokens, 0)  # warm-up
        for w in counts:
            tok = [ceiling_run(instant, w, concurrency, requests, tokens, 0) for _ in range(repeats)]
            req = [ceiling_run(instant, w, concurrency, rate_requests, 1, 0) for _ in range(repeats)]
            acc = []
            for _ in range(repeats):
                start += accuracy_requests
                acc.append(accuracy_run(timed, w, accuracy_concurrency, accuracy_requests, accuracy_tokens,
                                        ttft_ms / 1000, start))
            t, r, a = median_of(tok), median_of(req), median_of(acc)
            rows.append({"workers": w, "tokens_per_s": t["tokens_per_s"], "requests_per_s": r["requests_per_s"],
                         "ttft_p50_err_ms": a["ttft_p50_err_ms"], "ttft_p99_err_ms": a["ttft_p99_err_ms"],
                         "startup_s": t["startup_s"], "loop_lag_ms": max(t["loop_lag_ms"], r["loop_lag_ms"]),
                         "failed": t["failed"] + r["failed"] + a["failed"],
                         "requests": t["requests"] + r["requests"] + a["requests"]})
            console.print(f"workers={w}: done")
    table = Table(title=f"load generator ceilings (instant mock, concurrency {concurrency}; {tokens} tokens a request "
                        f"for tokens/s, 1 for requests/s) and TTFT error (mock TTFT {ttft_ms:g} ms, concurrency "
                        f"{accuracy_concurrency}), medians of {repeats}")
    for col in ("workers", "output tokens/s", "requests/s", "TTFT err p50 ms", "TTFT err p99 ms",
                "worker start-up s", "loop lag max ms", "failed / requests"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(str(row["workers"]), f"{row['tokens_per_s']:,.0f}", f"{row['requests_per_s']:,.0f}",
                      f"{row['ttft_p50_err_ms']:+.2f}", f"{row['ttft_p99_err_ms']:+.2f}", f"{row['startup_s']:.2f}",
                      f"{row['loop_lag_ms']:.1f}", f"{row['failed']} / {row['requests']}")
    console.print(table)
    console.print(f"machine after the run: {machine()}")
    info["rows"] = rows
    if json_out:
        json_out.write_text(json.dumps(info, indent=2, default=float))


if __name__ == "__main__":
    app()
