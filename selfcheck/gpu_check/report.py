"""The verdict over every check and ``gpu_check.md``: a header, then each check's table in the order a reader
wants them ((a), (b), (d), (e), (f), (g), then the engines of (c))."""
from __future__ import annotations

import kvbench.selfcheck.gpu_check.bandwidth as bandwidth
import kvbench.selfcheck.gpu_check.engine_runs as engine_runs
import kvbench.selfcheck.gpu_check.kv as kv
import kvbench.selfcheck.gpu_check.kv_quant as kv_quant
import kvbench.selfcheck.gpu_check.llama_build as llama_build
import kvbench.selfcheck.gpu_check.overhead as overhead
import kvbench.selfcheck.gpu_check.sampler as sampler
from kvbench.kv.units import fmt_gib


def verdict(result: dict) -> tuple[bool, list[str]]:
    """(every check ran and agreed, the problems)."""
    problems = [*result.get("skipped", []), *sampler.problems(result), *kv.problems(result),
                *kv_quant.problems(result), *bandwidth.problems(result), *engine_runs.problems(result)]
    return not problems, problems


def render_markdown(result: dict) -> str:
    env = result.get("environment", {})
    gpus = ", ".join(f"{g['name']} ({fmt_gib(g['memory_bytes'])})" for g in env.get("gpus", [])) or "-"
    lines = [f"# kvbench GPU check {result.get('id', '')}", "",
             f"Command: `{result.get('command', '')}`", "",
             f"Started {result.get('started_at', '-')}, {result.get('seconds', 0):.0f} s. GPUs: {gpus}; "
             f"driver {env.get('driver', '-')}; NVML memory API {env.get('memory_api', '-')}; "
             f"torch {env.get('torch', '-')} (CUDA {env.get('cuda', '-')}), transformers "
             f"{env.get('transformers', '-')} from `{env.get('torch_python', '-')}`.", ""]
    ok, problems = verdict(result)
    lines += ["**All checks agreed.**" if ok else "**Problems:** " + "; ".join(problems), ""]
    for check in (sampler, kv, overhead, llama_build, kv_quant, bandwidth, engine_runs):
        lines += check.markdown(result)
    return "\n".join(lines) + "\n"
