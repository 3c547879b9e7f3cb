"""Which llama.cpp configuration serves on this CPU, and how fast: each server given (a build, with or
without extra flags such as --no-repack) on each GGUF, started as kvbench starts it (-t 1 on 2 cores, -tb all
cores), asked for one prompt and a decode several times, interleaved so that machine noise falls on every
configuration alike. Prints one table (and --json) of: served or how it died, the weight buffers it chose
(AMX, CPU_REPACK, CPU), prompt and decode tokens/s (median over the rounds, llama-server's own timings).

    python -m kvbench.selfcheck.llamacpp_cpu_builds \\
        --server native=~/.cache/kvbench/envs/llamacpp-0.3.36/bin/llama-server \\
        --server 'native --no-repack=~/.cache/kvbench/envs/llamacpp-0.3.36/bin/llama-server --no-repack' \\
        --gguf model.Q4_1.gguf --gguf model.q8_0.gguf

It measures what docs/engines.md's "one build per CPU" section reports; figures compare within one run only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from kvbench.backends.process import ServerProcess, free_port
from kvbench.backends.types import EngineStartError
from kvbench.common.hardware import cpu_flags, cpu_model

BUFFER = re.compile(r"load_tensors:\s+(?P<buft>\S+) model buffer size =\s*(?P<mib>[\d.]+) MiB")


def start(argv: list[str], log: Path, timeout_s: float = 120) -> tuple[ServerProcess | None, str, str]:
    """(server, base url, "" or why it did not start)."""
    port = free_port("127.0.0.1")
    server = ServerProcess([*argv, "--host", "127.0.0.1", "--port", str(port)], {}, log)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_http(url + "/health", timeout_s)
    except EngineStartError as exc:
        server.stop()
        return None, url, str(exc)
    return server, url, ""


def one_round(url: str, prompt_tokens: int, output_tokens: int, seed: int) -> dict:
    # token ids from the vocabulary's middle: no special tokens; a new seed per round defeats the slot cache
    ids = [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(prompt_tokens)]
    body = {"prompt": ids, "n_predict": output_tokens, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}
    timings = httpx.post(url + "/completion", json=body, timeout=600).json()["timings"]
    return {"prompt_per_s": timings["prompt_per_second"], "decode_per_s": timings["predicted_per_second"]}


def measure(servers: dict[str, list[str]], ggufs: list[Path], rounds: int, prompt_tokens: int, output_tokens: int,
            threads: int, batch_threads: int, log_dir: Path) -> list[dict]:
    rows = []
    for gguf in ggufs:
        live = {}
        for name, argv in servers.items():
            log = log_dir / f"{name.replace(' ', '_')}-{gguf.stem}.log"
            full = [argv[0], "-m", str(gguf), "-c", str(prompt_tokens + output_tokens + 64), "-np", "1",
                    "-t", str(threads), "-tb", str(batch_threads), "-lv", "4", *argv[1:]]
            server, url, error = start(full, log)
            text = log.read_text(errors="replace") if log.exists() else ""
            buffers = {m["buft"]: float(m["mib"]) for m in BUFFER.finditer(text)}
            row = {"gguf": gguf.name, "server": name, "served": server is not None, "error": error,
                   "weight_buffers_mib": buffers, "rounds": []}
            rows.append(row)
            if server is not None:
                try:  # the first request: a crash on the first computation shows here
                    one_round(url, 32, 4, seed=0)
                    live[name] = (server, url, row)
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    row["served"] = False
                    row["error"] = f"first request failed ({type(exc).__name__}); {server.exit_description() or 'alive'}"
                    server.stop()
        try:
            for r in range(rounds):  # interleaved: every configuration once per round
                for name, (server, url, row) in live.items():
                    row["rounds"].append(one_round(url, prompt_tokens, output_tokens, seed=r + 1))
        finally:
            for server, _, _ in live.values():
                server.stop()
    for row in rows:
        for key in ("prompt_per_s", "decode_per_s"):
            values = [x[key] for x in row["rounds"]]
            row[key] = round(statistics.median(values), 1) if values else None
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| GGUF | server | serves | weight buffers (MiB) | prompt tok/s | decode tok/s |", "|---|---|---|---|---:|---:|"]
    for r in rows:
        buffers = ", ".join(f"{k} {v:.0f}" for k, v in r["weight_buffers_mib"].items()) or "-"
        lines.append(f"| {r['gguf']} | {r['server']} | {'yes' if r['served'] else 'no: ' + r['error'][:90]} | "
                     f"{buffers} | {r['prompt_per_s'] or '-'} | {r['decode_per_s'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, metavar="NAME=PATH [ARGS]",
                    help="a llama-server binary and its extra arguments, named")
    ap.add_argument("--gguf", action="append", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=64)
    cores = os.cpu_count() or 1
    ap.add_argument("--threads", type=int, default=1 if cores <= 2 else cores // 2, help="-t, as kvbench sets it")
    ap.add_argument("--batch-threads", type=int, default=cores, help="-tb, as kvbench sets it")
    ap.add_argument("--json", type=Path, help="also write the rows and the machine here")
    args = ap.parse_args(argv)
    servers = {}
    for spec in args.server:
        name, sep, command = spec.partition("=")
        if not sep or not command.strip():
            ap.error(f"--server {spec!r}: NAME=PATH [ARGS]")
        words = shlex.split(command)
        words[0] = os.path.expanduser(words[0])
        servers[name] = words
    with tempfile.TemporaryDirectory(prefix="kvbench-llamacpp-builds-") as tmp:
        started = time.time()
        rows = measure(servers, args.gguf, args.rounds, args.prompt_tokens, args.output_tokens, args.threads,
                       args.batch_threads, Path(tmp))
    machine = {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "seconds": round(time.time() - started)}
    print(f"{machine['cpu']} ({', '.join(machine['flags'])}), {machine['cores']} cores; "
          f"{args.prompt_tokens}-token prompt, {args.output_tokens} decoded, median of {args.rounds} interleaved rounds")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    return 0 if all(r["served"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
