"""The default benchmark: what ``make bench`` runs on this machine, the CPU default or the GPU one.

Pure part: :func:`choose_default_bench` takes the GPUs found (name, memory) and the model as the planner reads it,
and returns a :class:`DefaultBench` (workload, engines, context cap, a note). The ladder is sized by the KV each
default engine would hold on the card by the planner's startup rule for it (``KVRules.startup_memory``, read from
the engine's source: vLLM's is CUDA's total x gpu_memory_utilization less the weights, its profile run's peak, its
non-torch memory and, from 0.21, its CUDA-graph estimate), at the settings kvbench starts it with (the workload's
concurrency, the cap as the limit); the most demanding engine sets the cap. The machine itself is read by
:mod:`kvbench.common.hardware`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.backends import DEFAULT_ENGINES
from kvbench.common.hardware import GPUInfo, detect_gpus, has_nvidia_gpu
from kvbench.kv.units import GIB

CPU_WORKLOAD = "long_context_ladder"
CPU_MODEL = "smollm2"  # the embedded SmolLM2-135M GGUF: no download
# The GPU default model: what people deploy on one GPU, ungated (no licence to accept, no HF_TOKEN), Apache-2.0,
# an architecture every engine serves (Qwen2: vLLM, llama.cpp's converter, TGI, transformers), 7.6 B parameters
# (15.2 GB of bf16 safetensors) and GQA with 4 KV heads (57,344 B/token) with a 32K context. Llama-3.1-8B is
# gated: `make bench` could not download it unattended. llama.cpp serves a GGUF made from these same weights
# by llama.cpp's own converter (LlamaCppBackend.gguf_for), unless -b llamacpp:gguf=FILE names one.
GPU_MODEL = "Qwen/Qwen2.5-7B-Instruct"
GPU_WORKLOAD = "gpu_long_context"
ENGINES = DEFAULT_ENGINES
CONTEXT_STEP = 1024  # a context cap is a whole number of these (of 256 below 2,048)


@dataclass
class DefaultBench:
    """What `make bench` runs: the workload, the engines and a context cap, for the CPU or the GPU."""

    name: str  # "cpu" or "gpu": the device it runs on
    workload: str
    engines: tuple[str, ...]
    max_context: int | None  # --max-context for kvbench run (None: the model's own limit)
    note: str
    gpus: list[GPUInfo] = field(default_factory=list)

    def run_args(self) -> list[str]:
        """The `kvbench run` arguments besides the engines: the workload and the context cap."""
        args = ["--workload", self.workload]
        if self.max_context:
            args += ["--max-context", str(self.max_context)]
        return args

    def engine_args(self) -> list[str]:
        return [a for e in self.engines for a in ("-b", e)]

    def make_vars(self) -> str:
        return "\n".join([f"DEVICE={self.name}", f"ENGINES={' '.join(self.engine_args())}",
                          f"DEFAULT_ARGS={' '.join(self.run_args())}"])


class DefaultBenchError(ValueError):
    pass


def _startup(model, card: GPUInfo, limit: int, sequences: int, engine: str):
    """``engine``'s deployment of ``model`` on ``card`` as kvbench starts it (the limit ``limit``, ``sequences``
    at once: vLLM's --max-num-seqs, llama.cpp's slots): the planner's Setup and what the engine would log at start
    by its own rule (kvbench.planner.startup.startup_view; None for an engine without one)."""
    from kvbench.planner import PlanInput, engine_rules, gpu_of_device, setup
    from kvbench.planner.startup import startup_view

    options = {k: v for k, v in {"max_num_seqs": sequences}.items() if k in engine_rules(engine).rule_options}
    s = setup(PlanInput(model=model, engine=engine, gpu=gpu_of_device(card.name, card.memory_bytes),
                        max_model_len=limit, batch=sequences, engine_options=options, allow_long_context=True))
    return s, startup_view(s)


def _holds(view: dict | None, sequences: int) -> bool:
    return bool(view) and not view["refusal"] and (view["requests_at_limit"] or 0) >= sequences


def _longest(model, card: GPUInfo, engine: str, sequences: int, model_limit: int) -> int:
    """The longest limit (the model's own, else whole steps of 1,024 tokens, of 256 below 2,048) at which the
    engine's startup rule holds ``sequences`` requests of it, by bisection."""
    def holds(limit: int) -> bool:
        return _holds(_startup(model, card, limit, sequences, engine)[1], sequences)

    if holds(model_limit):
        return model_limit
    step = CONTEXT_STEP if holds(2 * CONTEXT_STEP) else 256  # a small card: finer steps
    lo, hi = 0, model_limit // step  # holds(lo * step) (0: nothing), not holds(hi * step)
    if hi * step < model_limit and holds(hi * step):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid * step) else (lo, mid)
    return lo * step


def choose_default_bench(gpus: list[GPUInfo], *, model=None, max_concurrency: int = 16,
                         output_tokens: int = 128) -> DefaultBench:
    """The default benchmark for these GPUs and this model (no GPU: the CPU default).

    Every engine runs alone on the first GPU (vLLM and transformers use cuda:0), so its memory sizes the ladder:
    ``max_concurrency`` sequences of the longest context must fit in what each default engine with a startup
    rule (``KVRules.startup_memory``: the planner's, read from the engine's source) would hold on the card, and
    the most demanding of them sets the cap: the model's own limit when that fits, else the longest whole
    multiple of 1,024 tokens (256 below 2,048) that does (passed as --max-context; longer rungs are skipped).
    ``model``: the planner's reading of the model (resolve_model).
    """
    if not gpus:
        return DefaultBench("cpu", CPU_WORKLOAD, ENGINES, None, "no NVIDIA GPU found: the CPU default")
    if model is None:
        raise DefaultBenchError("the GPU default benchmark is sized from the model: none given")
    if model.weights_bytes is None:
        raise DefaultBenchError(f"{model.name}: its weights are {model.weights_source}: the GPU ladder cannot be sized")
    card = gpus[0]
    model_limit = model.geometry.max_context or 2048
    ruled = [e for e in ENGINES if _startup(model, card, model_limit, max_concurrency, e)[1] is not None]
    if not ruled:
        raise DefaultBenchError(f"no default engine has a startup rule for {card.name}: the GPU ladder cannot be sized")
    limits = {e: _longest(model, card, e, max_concurrency, model_limit) for e in ruled}
    engine = min(ruled, key=lambda e: limits[e])  # the most demanding engine sets the cap
    limit = limits[engine]
    s, view = _startup(model, card, model_limit, max_concurrency, engine)
    mem = s.startup
    per_token = s.rules.bytes_per_token(s.question(context=model_limit, batch=1))
    others = f" ({len(gpus)} GPUs: the engines use the first)" if len(gpus) > 1 else ""
    terms = "".join(f", {t.name} {t.bytes / GIB:.2f} GiB" for t in mem.terms if t.bytes)
    sizing = (f"{card.name} {card.memory_bytes / GIB:.1f} GiB ({s.gpu.name}){others}: {mem.label} "
              f"{s.version or s.rules.version}'s startup rule (the most demanding default engine), {mem.fraction:g} "
              f"of CUDA's {mem.cuda_bytes / GIB:.2f} GiB less weights {s.weights_per_gpu / GIB:.2f} GiB{terms}: a "
              f"KV budget of {max(view['kv_budget_bytes'], 0) / GIB:.2f} GiB; KV {per_token:,.0f} B/token x "
              f"{max_concurrency} sequences")
    caveat = f" ({mem.verified_note})" if not mem.verified else ""
    if limit >= model_limit:
        return DefaultBench("gpu", GPU_WORKLOAD, ENGINES, None,
                            f"{sizing}: the model's whole {model_limit:,}-token context fits{caveat}", list(gpus))
    if limit < CONTEXT_STEP + output_tokens:
        raise DefaultBenchError(f"the model does not fit the GPU default benchmark: {sizing} leave room for "
                                f"{max(limit, 0):,} tokens per sequence (a 1,024-token prompt needs more)")
    return DefaultBench("gpu", GPU_WORKLOAD, ENGINES, limit,
                        f"{sizing}: context capped at {limit:,} tokens (the model allows {model_limit:,}){caveat}",
                        list(gpus))


# --- the model's side ------------------------------------------------------------------------------

def model_sizing(model: str):
    """The model as the planner reads it (kvbench.planner.resolve_model)."""
    from kvbench.common import models
    from kvbench.planner import resolve_model

    path = str(models.embedded_gguf(model)) if model in models.EMBEDDED else model
    planned = resolve_model(path)
    if planned.weights_bytes is None:
        raise DefaultBenchError(f"{model}: its weights are {planned.weights_source}: the GPU ladder cannot be sized")
    # a GGUF: the planner sizes vLLM's weights as the HF-format bf16 copy kvbench converts it to (served_weights)
    return planned


def default_model() -> str:
    """The model `make bench` runs here: :data:`GPU_MODEL` on a GPU machine, :data:`CPU_MODEL` otherwise."""
    return GPU_MODEL if has_nvidia_gpu() else CPU_MODEL


def default_bench_for(model: str = "smollm2", gpus: list[GPUInfo] | None = None) -> DefaultBench:
    """The default benchmark `make bench` runs for ``model`` on this machine."""
    if not has_nvidia_gpu():
        return DefaultBench("cpu", CPU_WORKLOAD, ENGINES, None, "no NVIDIA GPU found (or KVBENCH_GPU=0): the CPU default")
    gpus = detect_gpus() if gpus is None else gpus
    if not gpus:
        raise DefaultBenchError("KVBENCH_GPU=1 but no NVIDIA GPU was found (NVML and nvidia-smi)")
    return gpu_default_bench(model, gpus)


def gpu_default_bench(model: str, gpus: list[GPUInfo]) -> DefaultBench:
    """The GPU default benchmark for ``model`` on these GPUs: the GPU workload's ladder sized for their memory."""
    from kvbench.workloads import load

    wl = load(GPU_WORKLOAD)
    return choose_default_bench(gpus, model=model_sizing(model), max_concurrency=wl.load.max_in_flight(),
                                output_tokens=wl.output_tokens)
