"""The GPU checks: ``python -m kvbench.selfcheck.gpu_check [--out results/gpu/<id>] [--model DIR ...]``.

Runs offline, in under 10 minutes (``--budget-s``, default 540), on a machine with an NVIDIA GPU:

a. the NVML sampler against a real allocation of known size (a CUDA torch process allocates
   ``--alloc-gib`` GiB; the device and process deltas NVML reports, read at that moment and by the 20 Hz
   sampler, against the bytes allocated);
b. transformers on CUDA (the embedded SmolLM2 model and each ``--model`` HF folder): the KV cache of one
   ``generate`` call measured three ways (the cache tensors' bytes, the CUDA allocator's delta, NVML's
   device delta) at several prompt lengths and batches, against kvbench.kv.geometry's prediction;
c. every engine whose environment is installed here, through ``kvbench run`` with the GPU default benchmark's
   workload, each time-boxed;
d. the runtime overhead per model (CUDA context, allocator slack, activations: memory besides weights and KV)
   against ``kvbench plan``'s 1.5 GiB assumption, from (b)'s probes;
e. with ``--llama-source``, llama.cpp's CUDA llama-server built from a source archive, if the time allows;
f. KV quantisation on CUDA: transformers' QuantizedCache (optimum-quanto int4 and int2, the hf backend's
   quanto-int4/int2) beside its bf16 cache on the same prompts, for the embedded model (real weights: the
   output change means something) and a random-weight 8B GQA model (head_dim 128): the bytes the cache
   object held against the hf KV rules, the allocator's delta, and the greedy match and top-20 KL
   (kvbench.common.divergence). ``--kv-quant-device cpu`` runs the same step on the CPU (a dry run);
g. the device's memory bandwidth as a GPU run records it (``gpu_probe.py bandwidth``) against the card's
   specification (bench/planner/gpus.toml): the decode bound's denominator.

Without ``--config``, (b) builds random-weight models of three real geometries on the GPU (an 8B GQA, a
hybrid sliding-window and an MLA config from tests/data/configs): no model file has to travel.

Writes ``gpu_check.md`` (the tables and the exact command) and ``gpu_check.json`` under ``--out``. Without
an NVIDIA GPU it prints why, runs nothing and exits with code 3. Exit 0: every check ran and agreed;
1: a check disagreed, failed or was skipped for lack of time or of a CUDA torch.

Each check is a module of this package (sampler, kv, overhead, engine_runs, llama_build, kv_quant: rows, the
measuring step, its table and its problems); this one parses the arguments and runs them in order.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from kvbench.kv.units import GIB

from .bandwidth import run_bandwidth
from .common import ROOT, Budget
from .engine_runs import run_engines
from .kv import CONFIG_DIR, DEFAULT_CONFIGS, run_kv
from .kv_quant import run_kv_quant
from .llama_build import run_llama_build
from .probe import find_torch_python
from .report import render_markdown, verdict
from .sampler import run_sampler

EXIT_NO_GPU = 3


def no_gpu_message(error: str | None) -> str:
    return (f"no NVIDIA GPU found (NVML: {error or 'no device'}): the GPU checks need one; nothing was run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.selfcheck.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_check.md/json (default results/gpu/<time>-<gpu>)")
    parser.add_argument("--model", action="append", default=[], help="an extra local HF model folder (repeatable)")
    parser.add_argument("--config", action="append", default=[], type=Path,
                        help="a config.json: (b) builds a random-weight model of it on the GPU (repeatable; "
                             "default: an 8B GQA, a hybrid sliding-window and an MLA geometry, "
                             f"{', '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--no-configs", action="store_true", help="(b) without the default configs")
    parser.add_argument("--llama-source", type=Path,
                        help="(e) a llama.cpp source archive or folder (backends/llamacpp/scripts/pack_llama_source.sh "
                             "makes one under 64 MiB): build its CUDA llama-server here if the time allows")
    parser.add_argument("--families", action="store_true",
                        help="(b) also on kvbench validate's families (random-weight models of bench/run/kv_families.toml)")
    parser.add_argument("--no-embedded", action="store_true", help="(b) without the embedded model")
    parser.add_argument("--budget-s", type=float, default=540, help="the whole check's time budget (default 540)")
    parser.add_argument("--alloc-gib", type=float, default=4.0, help="size of check (a)'s allocation")
    parser.add_argument("--engines", default="hf,vllm,llamacpp", help="engines for check (c); '' for none")
    parser.add_argument("--torch-python", help="an interpreter whose torch sees CUDA (default: found)")
    parser.add_argument("--no-kv-quant", action="store_true", help="without (f), transformers' quantised cache")
    parser.add_argument("--kv-quant-device", default="cuda", choices=["cuda", "cpu"],
                        help="(f) on the CPU instead: a dry run of the same step (smaller prompts)")
    args = parser.parse_args(argv)
    t_start = time.monotonic()
    budget = Budget(args.budget_s)
    command = shlex.join(["python", "-m", "kvbench.selfcheck.gpu_check", *(sys.argv[1:] if argv is None else argv)])

    from kvbench.common.hardware import NVML

    nvml = NVML()
    if not nvml.available:
        print(no_gpu_message(nvml.error), file=sys.stderr)
        return EXIT_NO_GPU

    names = nvml.device_names()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "results" / "gpu" / f"{stamp}-{names[0].lower().replace('nvidia', '').strip().replace(' ', '-')}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        driver = nvml.nv.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:
        driver = None
    result: dict = {"id": out.name, "command": command, "started_at": datetime.now(timezone.utc).isoformat(),
                    "environment": {"gpus": nvml.devices(), "driver": driver}, "skipped": []}

    def save():
        result["seconds"] = time.monotonic() - t_start
        result["environment"]["memory_api"] = nvml.memory_api
        result["ok"], result["problems"] = verdict(result)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "gpu_check.md").write_text(render_markdown(result))

    python, info, tried = find_torch_python(args.torch_python)
    result["environment"].update({"torch_python": python, **{k: info.get(k) for k in ("torch", "cuda", "transformers")}})
    print(f"GPU: {', '.join(names)}; CUDA torch: {python or 'none found'}", flush=True)
    if python is None:
        result["skipped"].append("(a), (b): no interpreter whose torch sees CUDA (" + "; ".join(tried) + ")")
    else:
        run_sampler(result, nvml, python, int(args.alloc_gib * GIB), budget, out / "logs")
        save()
        if info.get("transformers"):
            configs = args.config or ([] if args.no_configs else [CONFIG_DIR / c for c in DEFAULT_CONFIGS])
            run_kv(result, nvml, python, budget, out, save, embedded=not args.no_embedded, models=args.model,
                   configs=configs, families=args.families)
        else:
            result["skipped"].append(f"(b): {python} has torch but not transformers")
    if python is not None:  # (g): a read of seconds, before the engines take the card
        run_bandwidth(result, nvml, python, budget)
        save()
    if python is not None and info.get("transformers") and not args.no_kv_quant:
        run_kv_quant(result, python, args.kv_quant_device, budget, out / "logs")
        save()
    if args.llama_source:
        run_llama_build(result, args.llama_source, nvml, out, budget)
        save()
    engines = [e for e in args.engines.split(",") if e]
    if engines:
        run_engines(result, engines, nvml, out, budget)
    save()
    ok, problems = verdict(result)
    print(render_markdown(result))
    print(f"written: {out / 'gpu_check.md'} and gpu_check.json ({result['seconds']:.0f} s)")
    return 0 if ok else 1
