"""The default benchmark: what ``make bench`` runs on this machine, the CPU default or the GPU one.

Pure part: :func:`choose_default_bench` takes the GPUs found (name, memory) and the model as the planner reads it,
and returns a :class:`DefaultBench` (workload, engines, context cap, a note). The ladder is sized by the KV budget
vLLM, the most demanding engine of the default set, would take on the card: the planner's startup rule for vLLM
(backends/vllm/gpumem.py: CUDA's total x gpu_memory_utilization less the weights, its profile run's peak, its
non-torch memory and, from 0.21, its CUDA-graph estimate), at the settings kvbench starts it with (--max-num-seqs
the workload's concurrency, --max-model-len the cap). The machine itself is read by :mod:`kvbench.common.hardware`.
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
# The engine whose startup rule sizes the ladder: of the default set, the one that keeps a share of the card free
# and reserves its profile peak and CUDA graphs besides the weights (transformers and llama.cpp allocate as they go
# or for the slots they are given)
SIZING_ENGINE = "vllm"
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


def _startup(model, card: GPUInfo, limit: int, sequences: int):
    """vLLM's deployment of ``model`` on ``card`` as kvbench starts it (--max-model-len ``limit``,
    --max-num-seqs ``sequences``): the planner's Setup, its startup ledger and the pool it holds."""
    from kvbench.planner import PlanInput, gpu_of_device, setup
    from kvbench.planner.capacity import capacity, kv_room

    s = setup(PlanInput(model=model, engine=SIZING_ENGINE, gpu=gpu_of_device(card.name, card.memory_bytes),
                        max_model_len=limit, batch=sequences, engine_options={"max_num_seqs": sequences},
                        allow_long_context=True))
    room = kv_room(s)
    return s, room, capacity(s, max(room, 0.0))


def choose_default_bench(gpus: list[GPUInfo], *, model=None, max_concurrency: int = 16,
                         output_tokens: int = 128) -> DefaultBench:
    """The default benchmark for these GPUs and this model (no GPU: the CPU default).

    Every engine runs alone on the first GPU (vLLM and transformers use cuda:0), so its memory sizes the ladder:
    ``max_concurrency`` sequences of the longest context must fit in the KV pool vLLM would make on the card by
    its own startup rule (:func:`kvbench.planner.startup.startup_view`: its fraction of CUDA's total less the
    weights, its profile peak, its non-torch memory and its CUDA-graph estimate). The context is the model's own
    limit when that fits, else the longest whole multiple of 1,024 tokens (256 below 2,048) that does (passed as
    --max-context; longer rungs are skipped). ``model``: the planner's reading of the model (resolve_model).
    """
    if not gpus:
        return DefaultBench("cpu", CPU_WORKLOAD, ENGINES, None, "no NVIDIA GPU found: the CPU default")
    if model is None:
        raise DefaultBenchError("the GPU default benchmark is sized from the model: none given")
    if model.weights_bytes is None:
        raise DefaultBenchError(f"{model.name}: its weights are {model.weights_source}: the GPU ladder cannot be sized")
    card = gpus[0]
    model_limit = model.geometry.max_context or 2048

    def holds(limit: int) -> bool:
        return (_startup(model, card, limit, max_concurrency)[2].sequences or 0) >= max_concurrency

    s, room, cap = _startup(model, card, model_limit, max_concurrency)
    mem = s.startup
    per_token = s.rules.bytes_per_token(s.question(context=model_limit, batch=1))
    others = f" ({len(gpus)} GPUs: the engines use the first)" if len(gpus) > 1 else ""
    terms = "".join(f", {t.name} {t.bytes / GIB:.2f} GiB" for t in mem.terms if t.bytes)
    sizing = (f"{card.name} {card.memory_bytes / GIB:.1f} GiB ({s.gpu.name}){others}: vLLM "
              f"{s.version or s.rules.version}'s startup rule, {mem.fraction:g} of CUDA's {mem.cuda_bytes / GIB:.2f} "
              f"GiB less weights {s.weights_per_gpu / GIB:.2f} GiB{terms}: a KV budget of {max(room, 0) / GIB:.2f} "
              f"GiB; KV {per_token:,.0f} B/token x {max_concurrency} sequences")
    caveat = f" ({mem.verified_note})" if not mem.verified else ""
    if (cap.sequences or 0) >= max_concurrency:
        return DefaultBench("gpu", GPU_WORKLOAD, ENGINES, None,
                            f"{sizing}: the model's whole {model_limit:,}-token context fits{caveat}", list(gpus))
    # the longest limit whose pool holds every sequence: whole steps, found by bisection on vLLM's own rule
    step = CONTEXT_STEP if holds(2 * CONTEXT_STEP) else 256  # a small card: finer steps
    lo, hi = 0, model_limit // step  # holds(lo * step) (0: nothing), not holds(hi * step)
    if hi * step < model_limit and holds(hi * step):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid * step) else (lo, mid)
    limit = lo * step
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
    return choose_default_bench(gpus, model=model_sizing(model), max_concurrency=max(wl.concurrency),
                                output_tokens=wl.output_tokens)
