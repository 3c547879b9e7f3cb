"""The default benchmark: what ``make bench`` runs on this machine, the CPU default or the GPU one.

Pure part: :func:`choose_default_bench` takes the GPUs found (name, memory) and the model's KV bytes per
token, weights and context limit, and returns a :class:`DefaultBench` (workload, engines, context cap, a
note). The machine itself is read by :mod:`kvbench.common.hardware`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.backends import DEFAULT_ENGINES
from kvbench.common.hardware import GPUInfo, detect_gpus, has_nvidia_gpu
from kvbench.kv.units import GIB
from kvbench.planner.deploy import MARGIN as PLAN_MARGIN
from kvbench.planner.overhead import ASSUMED_GIB

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
# GPU sizing: a share of the card kept free, and the runtime overhead besides weights and KV
# (CUDA context, activations, the allocator's slack): the planner's defaults, not yet measured here.
MARGIN = PLAN_MARGIN  # the planner's margin where no engine rule says otherwise
OVERHEAD_BYTES = int(ASSUMED_GIB * GIB)
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


def choose_default_bench(gpus: list[GPUInfo], *, kv_bytes_per_token: float, weights_bytes: float,
                         model_max_context: int | None, max_concurrency: int = 16, margin: float = MARGIN,
                         overhead_bytes: int = OVERHEAD_BYTES, output_tokens: int = 128) -> DefaultBench:
    """The default benchmark for these GPUs and this model (no GPU: the CPU default).

    Every engine runs alone on the first GPU (vLLM and transformers use cuda:0), so its memory sizes the
    ladder: weights + overhead + KV for ``max_concurrency`` sequences of the longest context must fit in
    (1 - margin) of the card. The context is the model's own limit when that fits, else the longest
    whole multiple of 1,024 tokens (256 below 2,048) that does (passed as --max-context; longer rungs are skipped).
    """
    if not gpus:
        return DefaultBench("cpu", CPU_WORKLOAD, ENGINES, None, "no NVIDIA GPU found: the CPU default")
    card = gpus[0]
    usable = card.memory_bytes * (1 - margin) - weights_bytes - overhead_bytes
    fits_tokens = int(usable // (kv_bytes_per_token * max_concurrency)) if usable > 0 else 0
    step = CONTEXT_STEP if fits_tokens >= 2 * CONTEXT_STEP else 256  # a small card: finer steps
    cap = fits_tokens // step * step
    model_limit = model_max_context or 2048
    others = f" ({len(gpus)} GPUs: the engines use the first)" if len(gpus) > 1 else ""
    sizing = (f"{card.name} {card.memory_bytes / GIB:.1f} GiB{others}: weights {weights_bytes / GIB:.2f} GiB, "
              f"overhead {overhead_bytes / GIB:.1f} GiB, {margin:.0%} kept free, "
              f"KV {kv_bytes_per_token:,.0f} B/token x {max_concurrency} sequences")
    if cap < CONTEXT_STEP + output_tokens:
        raise DefaultBenchError(f"the model does not fit the GPU default benchmark: {sizing} leave room for "
                           f"{max(fits_tokens, 0):,} tokens per sequence (a 1,024-token prompt needs more)")
    if cap >= model_limit:
        return DefaultBench("gpu", GPU_WORKLOAD, ENGINES, None,
                       f"{sizing}: the model's whole {model_limit:,}-token context fits", list(gpus))
    return DefaultBench("gpu", GPU_WORKLOAD, ENGINES, cap,
                   f"{sizing}: context capped at {cap:,} tokens (the model allows {model_limit:,})", list(gpus))


# --- the model's side ------------------------------------------------------------------------------

def model_sizing(model: str) -> tuple[float, float, int | None]:
    """(KV bytes per token at 16 bits, weights bytes as transformers/vLLM load them, context limit)."""
    from kvbench.common import models
    from kvbench.kv.geometry import kv_bytes_per_token
    from kvbench.planner import resolve_model

    path = str(models.embedded_gguf(model)) if model in models.EMBEDDED else model
    planned = resolve_model(path)
    weights = planned.weights_bytes
    if weights is None:
        raise DefaultBenchError(f"{model}: its weights are {planned.weights_source}: the GPU ladder cannot be sized")
    if path.endswith(".gguf"):
        # transformers and vLLM read a bf16 copy: 2 bytes per parameter whatever the GGUF's quantisation.
        from gguf import GGUFReader

        weights = 2 * sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    geom = planned.geometry
    return kv_bytes_per_token(geom, "bf16"), weights, geom.max_context


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
    per_token, weights, context = model_sizing(model)
    return choose_default_bench(gpus, kv_bytes_per_token=per_token, weights_bytes=weights, model_max_context=context,
                          max_concurrency=max(wl.concurrency), output_tokens=wl.output_tokens)
