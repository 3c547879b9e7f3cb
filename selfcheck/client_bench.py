"""How accurate and how fast is kvbench's streaming client? Measured against a mock server.

``python -m kvbench.selfcheck.client_bench --repeats 5`` starts :mod:`kvbench.selfcheck.mock_server` in a process of its own,
pinned to one core, pins itself (the client) to another, and drives the mock with kvbench's own load
generator (:mod:`kvbench.load.concurrent` on :func:`kvbench.load.run_async`, as ``kvbench run``
drives it), its vLLM adapter and its metrics (:mod:`kvbench.common.metrics`):

(a) accuracy: the mock sends the first token ``--ttft-ms`` after it read the request and the next ones
    every ``--itl-ms``; the table shows reported TTFT and ITL percentiles minus the programmed values at
    each concurrency. The mock records when it really sent each token (perf_counter is CLOCK_MONOTONIC on
    Linux, so the two processes share one clock); "mock late" is how far its own first sends missed their
    deadlines, "delivery" the client's arrival stamp minus the mock's send time (the kernel plus the client).
(b) ceiling: an instant mock (all tokens at once, pre-serialised), ``--ceiling-tokens`` output tokens,
    ``--ceiling-concurrency`` streams: output tokens/s by kvbench's metrics, and the client's CPU time
    (``time.process_time``) per token. The mock's own CPU use is shown, to show it was not the limit.

Figures are medians over ``--repeats`` runs. ``--peers`` runs other benchmark clients against the same
mocks (see :mod:`kvbench.selfcheck.client_peers`); one that cannot be installed or run is shown as "not run" with why.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from kvbench.backends import REGISTRY
from kvbench.backends.types import LOCALHOST, ServerSpec
from kvbench.common.metrics import RequestTimes, cell_metrics, request_verdict
from kvbench.common.models import ModelFiles
from kvbench.kv.geometry import KVGeometry
from kvbench.load import LoadPoint, LoadSettings, run, run_async
from kvbench.workloads.prompts import Prompt

from .common import Mock, median_finite, pct

if TYPE_CHECKING:
    from kvbench.backends.base import Backend

# The engine whose adapter drives the mock: the mock speaks its OpenAI-compatible /v1/completions.
MOCKED_ENGINE = "vllm"

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])
console = Console(width=220)


# --- kvbench's client against the mock -------------------------------------------------------------

def mock_backend(url: str) -> Backend:
    """kvbench's real vLLM adapter, pointed at the mock (it streams nothing but /v1/completions)."""
    backend = REGISTRY[MOCKED_ENGINE]("mock", Path("/nonexistent"))
    geometry = KVGeometry.uniform(1, 1, 1)
    model = ModelFiles(name="mock", hf_dir=Path("/nonexistent"), gguf_path=None, sha256="", geometry=geometry)
    backend.spec = ServerSpec(model=model, max_context=4096, max_concurrency=64, kv_dtype="auto")
    backend.base_url = url
    return backend


def make_prompts(n: int, output_tokens: int, start: int = 0) -> list[Prompt]:
    """Prompt i starts with token id ``start + i``: the mock keys its records by it."""
    return [Prompt(f"r{start + i}", (start + i, 1, 2, 3), "", output_tokens) for i in range(n)]


def run_closed_loop(backend, prompts, concurrency: int) -> list:
    """kvbench's closed-loop load on the event loop the runner uses."""
    return run_async(run(backend, prompts, LoadPoint("concurrent", concurrency), LoadSettings(60.0))).results


def check_results(results, output_tokens: int) -> int:
    """How many requests failed or broke the token contract (as ``kvbench run`` judges them)."""
    return sum(request_verdict(r.error, r.prompt_tokens_sent, r.prompt_tokens_reported, output_tokens,
                               r.output_tokens_reported, sum(r.chunk_tokens)) != "ok" for r in results)


def accuracy_run(mock: Mock, concurrency: int, n_requests: int, output_tokens: int, ttft_s: float,
                 itl_s: float, start: int) -> dict:
    backend = mock_backend(mock.url)
    mock.records()  # clear
    prompts = make_prompts(n_requests, output_tokens, start)
    results = run_closed_loop(backend, prompts, concurrency)
    records = {r["key"]: r for r in mock.records()}
    failed = check_results(results, output_tokens)
    good = [r for r in results if not r.error and r.chunk_times]
    m = cell_metrics([RequestTimes.of(r) for r in good], [r.prompt_tokens_sent for r in good])
    mock_late, mock_itl_err, request_path, delivery = [], [], [], []
    for r in good:
        rec = records.get(int(r.request_id[1:]))
        if not rec or not rec["sends"]:
            continue
        sends = rec["sends"]
        mock_late.append(sends[0] - rec["t_first_due"])
        mock_itl_err.extend(np.diff(sends) - itl_s)
        request_path.append(rec["t_recv"] - r.t_sent)
        delivery.extend(t - s for t, s in zip(r.chunk_times, sends))
    ms = 1000.0
    return {
        "concurrency": concurrency, "requests": len(results), "failed": failed,
        "ttft_p50_err_ms": (m["ttft_s_p50"] - ttft_s) * ms if good else float("nan"),
        "ttft_p99_err_ms": (m["ttft_s_p99"] - ttft_s) * ms if good else float("nan"),
        "itl_p50_err_ms": (m["itl_s_p50"] - itl_s) * ms if m.get("itl_s_p50") is not None else float("nan"),
        "itl_p99_err_ms": (m["itl_s_p99"] - itl_s) * ms if m.get("itl_s_p99") is not None else float("nan"),
        "mock_late_p50_ms": pct(mock_late, 50) * ms, "mock_late_p99_ms": pct(mock_late, 99) * ms,
        "mock_itl_err_p99_ms": pct(mock_itl_err, 99) * ms,
        "request_path_p50_ms": pct(request_path, 50) * ms, "request_path_p99_ms": pct(request_path, 99) * ms,
        "delivery_p50_ms": pct(delivery, 50) * ms, "delivery_p99_ms": pct(delivery, 99) * ms,
    }


def minimal_accuracy_run(mock: Mock, concurrency: int, n_requests: int, output_tokens: int, ttft_s: float,
                         itl_s: float) -> dict:
    """(a) for the minimal raw client (kvbench.selfcheck.minimal_client): its TTFT (first chunk's arrival less
    its send) and ITL (the gaps between chunks) against the programmed ones, as :func:`accuracy_run` reports
    kvbench's."""
    from urllib.parse import urlsplit

    from kvbench.selfcheck import minimal_client

    timings: list = []
    url = urlsplit(mock.url)
    minimal_client.run(url.hostname, url.port, n_requests, concurrency, output_tokens, timings)
    mock.records()  # keeps the mock's list short
    ttft = [times[0] - sent for sent, times in timings if times]
    gaps = [b - a for _, times in timings for a, b in zip(times, times[1:])]
    ms = 1000.0
    return {"concurrency": concurrency, "requests": len(timings), "failed": n_requests - len(ttft),
            "ttft_p50_err_ms": (pct(ttft, 50) - ttft_s) * ms, "ttft_p99_err_ms": (pct(ttft, 99) - ttft_s) * ms,
            "itl_p50_err_ms": (pct(gaps, 50) - itl_s) * ms, "itl_p99_err_ms": (pct(gaps, 99) - itl_s) * ms}


def ceiling_run(mock: Mock, concurrency: int, n_requests: int, output_tokens: int, start: int) -> dict:
    backend = mock_backend(mock.url)
    prompts = make_prompts(n_requests, output_tokens, start)
    mock_cpu0, cpu0, wall0 = mock.cpu_seconds(), time.process_time(), time.perf_counter()
    results = run_closed_loop(backend, prompts, concurrency)
    wall, cpu, mock_cpu = time.perf_counter() - wall0, time.process_time() - cpu0, mock.cpu_seconds() - mock_cpu0
    mock.records()  # keep the mock's list short
    failed = check_results(results, output_tokens)
    good = [r for r in results if not r.error and r.chunk_times]
    m = cell_metrics([RequestTimes.of(r) for r in good], [r.prompt_tokens_sent for r in good])
    tokens = sum(sum(r.chunk_tokens) for r in good)
    return {"concurrency": concurrency, "requests": len(results), "failed": failed, "tokens": tokens,
            "tokens_per_s": m["output_tokens_per_s"] or float("nan"),
            "cpu_us_per_token": cpu / tokens * 1e6 if tokens else float("nan"),
            "client_cores": cpu / wall, "mock_cores": mock_cpu / wall}


def wakeup_floor(mock_cpu: int | None, gap_s: float, n: int) -> dict:
    """The machine's own floor: a process on the mock's core sends a timestamp over loopback TCP every
    ``gap_s`` (busy-waiting to the deadline), a blocking ``recv`` on the client's core stamps its arrival.
    No event loop, no HTTP, no JSON: what is left is the kernel and the (virtual) CPUs waking up."""
    import socket
    import struct

    srv = socket.socket()
    srv.bind((LOCALHOST, 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    for sock in (a, b):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the sender
        try:
            if mock_cpu is not None:
                os.sched_setaffinity(0, {mock_cpu})
            t = time.perf_counter() + 0.05
            for _ in range(n):
                t += gap_s
                while time.perf_counter() < t:
                    pass
                a.sendall(struct.pack("d", time.perf_counter()))
        finally:
            os._exit(0)
    a.close()
    delays = []
    buf = b""
    while len(delays) < n:
        data = b.recv(8 - len(buf))
        if not data:
            break
        buf += data
        if len(buf) == 8:
            delays.append(time.perf_counter() - struct.unpack("d", buf)[0])
            buf = b""
    b.close()
    os.waitpid(pid, 0)
    d = np.asarray(delays) * 1000
    return {"samples": len(delays), "p50_ms": pct(d, 50), "p99_ms": pct(d, 99), "max_ms": float(d.max()),
            "over_1ms": float((d > 1).mean())}


def median_of(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = median_finite(r[key] for r in runs)
        elif key in ("failed", "requests", "tokens"):
            out[key] = sum(r[key] for r in runs)
    out["runs"] = len(runs)
    return out


def pin_cpus() -> tuple[int | None, int | None]:
    """(mock CPU, client CPU): the first two CPUs this process may use; (None, None) on one core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return cpus[0], cpus[1]


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()
    return f"{os.cpu_count()} cores ({model}), load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"


def _f(value: float, digits: int = 2, signed: bool = True) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:,.{digits}f}"


def accuracy_table(rows: list[dict], ttft_ms: float, itl_ms: float, tokens: int) -> Table:
    t = Table(title=f"(a) accuracy: reported minus programmed (TTFT {ttft_ms:g} ms, ITL {itl_ms:g} ms, "
                    f"{tokens} tokens), ms, median of runs")
    for col in ("client", "conc", "requests", "failed", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                "mock late p50/p99", "request path p50", "delivery p50/p99"):
        t.add_column(col, justify="left" if col == "client" else "right")
    for r in rows:
        if r.get("not_run"):
            t.add_row(r["client"], str(r.get("concurrency", "")), "", "", "not run", r["not_run"][:60], "", "", "", "", "")
            continue
        t.add_row(r.get("client", "kvbench"), str(r["concurrency"]), str(r["requests"]), str(r["failed"]),
                  _f(r["ttft_p50_err_ms"]), _f(r["ttft_p99_err_ms"]), _f(r["itl_p50_err_ms"], 3),
                  _f(r["itl_p99_err_ms"], 3),
                  f"{_f(r.get('mock_late_p50_ms'), 3)} / {_f(r.get('mock_late_p99_ms'), 3)}",
                  _f(r.get("request_path_p50_ms"), 3, signed=False),
                  f"{_f(r.get('delivery_p50_ms'), 3, False)} / {_f(r.get('delivery_p99_ms'), 3, False)}")
    return t


def ceiling_table(rows: list[dict], tokens: int, concurrency: int) -> Table:
    t = Table(title=f"(b) ceiling: instant mock, {tokens} output tokens, concurrency {concurrency}, median of runs")
    for col in ("client", "requests", "failed", "output tokens/s", "client CPU us/token", "client cores",
                "mock cores", "x vllm bench serve"):
        t.add_column(col, justify="left" if col == "client" else "right")
    base = next((r["tokens_per_s"] for r in rows
                 if r.get("client", "").startswith("vllm bench serve") and not r.get("not_run")), None)
    for r in rows:
        if r.get("not_run"):
            t.add_row(r["client"], "", "", "not run", r["not_run"][:70], "", "", "")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        t.add_row(r.get("client", "kvbench"), str(r["requests"]), str(r["failed"]), _f(r["tokens_per_s"], 0, False),
                  _f(r["cpu_us_per_token"], 2, False), _f(r["client_cores"], 2, False),
                  _f(r["mock_cores"], 2, False), ratio)
    return t


@app.command()
def main(
    repeats: int = typer.Option(5, help="runs of each measurement; the tables show medians"),
    concurrency: str = typer.Option("1,16,64", help="accuracy: concurrencies, comma-separated"),
    ttft_ms: float = typer.Option(20.0, help="accuracy: programmed time to first token"),
    itl_ms: float = typer.Option(5.0, help="accuracy: programmed inter-token latency"),
    tokens: int = typer.Option(32, help="accuracy: output tokens per request"),
    rounds: int = typer.Option(8, help="accuracy: requests = max(32, rounds x concurrency)"),
    ceiling_tokens: int = typer.Option(256, help="ceiling: output tokens per request"),
    ceiling_concurrency: int = typer.Option(64, help="ceiling: concurrent streams"),
    ceiling_requests: int = typer.Option(2048, help="ceiling: requests per run"),
    peers: bool = typer.Option(False, "--peers", help="also run GuideLLM, AIPerf and vllm bench serve"),
    peer: list[str] = typer.Option([], help="run only these peers (guidellm, aiperf, vllm)"),
    peer_repeats: int = typer.Option(3, help="runs of each peer measurement (a peer run takes 10-30 s)"),
    minimal: bool = typer.Option(False, "--minimal", help="accuracy: also the minimal raw client "
                                 "(kvbench.selfcheck.minimal_client), its runs alternated with kvbench's"),
    quick: bool = typer.Option(False, "--quick", help="a few requests per measurement (for tests)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write the results here"),
    pin: bool = typer.Option(True, help="mock and client on separate cores"),
):
    concurrencies = [int(c) for c in concurrency.split(",") if c.strip()]
    if quick:
        repeats, rounds, ceiling_requests = 1, 2, max(4, ceiling_concurrency // 8)
    mock_cpu, client_cpu = pin_cpus() if pin else (None, None)
    if client_cpu is not None:
        os.sched_setaffinity(0, {client_cpu})
    console.print(f"machine: {machine()}; mock on CPU {mock_cpu}, client on CPU {client_cpu}")
    out: dict = {"machine": machine(), "repeats": repeats, "mock_cpu": mock_cpu, "client_cpu": client_cpu, "ttft_ms": ttft_ms, "itl_ms": itl_ms, "tokens": tokens,
                 "ceiling_tokens": ceiling_tokens, "ceiling_concurrency": ceiling_concurrency,
                 "command": " ".join(["python -m kvbench.selfcheck.client_bench", *sys.argv[1:]])}

    floor = wakeup_floor(mock_cpu, itl_ms / 1000, 100 if quick else 1000)
    out["wakeup_floor"] = floor
    accuracy: list[dict] = []
    start = 1000
    with Mock(ttft_ms, itl_ms, mock_cpu) as mock:
        accuracy_run(mock, 1, 2, tokens, ttft_ms / 1000, itl_ms / 1000, start)  # warm-up
        for c in concurrencies:
            n = 2 * c if quick else max(32, rounds * c)
            runs, raw = [], []
            for _ in range(repeats):
                start += n
                runs.append(accuracy_run(mock, c, n, tokens, ttft_ms / 1000, itl_ms / 1000, start))
                if minimal:  # alternated: what the machine does to one, it does to the other
                    raw.append(minimal_accuracy_run(mock, c, n, tokens, ttft_ms / 1000, itl_ms / 1000))
            accuracy.append({"client": "kvbench", **median_of(runs)})
            if minimal:
                accuracy.append({"client": "minimal raw client", **median_of(raw)})
    ceiling: list[dict] = []
    with Mock(0, 0, mock_cpu, record_sends=False) as mock:
        ceiling_run(mock, ceiling_concurrency, ceiling_concurrency, ceiling_tokens, 0)  # warm-up
        runs = [ceiling_run(mock, ceiling_concurrency, ceiling_requests, ceiling_tokens, 0) for _ in range(repeats)]
        ceiling.append({"client": "kvbench", **median_of(runs)})

    if peers or peer:
        from kvbench.selfcheck import client_peers

        names = peer or list(client_peers.PEERS)
        acc_c = 16 if 16 in concurrencies else concurrencies[-1]
        for name in names:
            console.print(f"peer {name}: installing / running")
            acc, ceil = client_peers.run_peer(name, repeats=min(repeats, peer_repeats), concurrency=acc_c, ttft_ms=ttft_ms,
                                              itl_ms=itl_ms, tokens=tokens, requests=2 * acc_c if quick else max(32, rounds * acc_c),
                                              ceiling_tokens=ceiling_tokens, ceiling_concurrency=ceiling_concurrency,
                                              ceiling_requests=ceiling_requests, mock_cpu=mock_cpu, log=console.print)
            accuracy.append(acc)
            ceiling.append(ceil)

    out["accuracy"], out["ceiling"] = accuracy, ceiling
    console.print(f"machine floor (a timestamp every {itl_ms:g} ms over loopback TCP, mock core to client core, "
                  f"blocking recv, no event loop): p50 {floor['p50_ms']:.3f} ms, p99 {floor['p99_ms']:.3f} ms, "
                  f"max {floor['max_ms']:.3f} ms, {floor['over_1ms']:.1%} over 1 ms ({floor['samples']} samples)")
    console.print(accuracy_table(accuracy, ttft_ms, itl_ms, tokens))
    console.print(ceiling_table(ceiling, ceiling_tokens, ceiling_concurrency))
    console.print(f"machine after the run: {machine()}")
    if json_out:
        json_out.write_text(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    app()
