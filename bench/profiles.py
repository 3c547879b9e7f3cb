"""Which benchmark ``make bench`` runs on this machine: the CPU default, or the GPU profile.

Pure part: :func:`choose_profile` takes the GPUs found (name, memory) and the model's KV bytes per token,
weights and context limit, and returns a :class:`Profile` (workload, engines, context cap, a note).
Detection: :func:`detect_gpus` (NVML, else ``nvidia-smi``) and :func:`has_nvidia_gpu`, which the engine
adapters' ``recipe()`` ask to choose their CUDA builds; ``KVBENCH_GPU=0`` / ``=1`` overrides detection
(the Makefile sets it from PROFILE so that the engines installed match the profile chosen).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench.planner import PlanInput

GIB = 2**30
CPU_WORKLOAD = "long_context_ladder"
GPU_WORKLOAD = "gpu_long_context"
ENGINES = ("hf", "vllm", "llamacpp")
# GPU profile sizing: a share of the card kept free, and the runtime overhead besides weights and KV
# (CUDA context, activations, the allocator's slack): the planner's defaults, not yet measured here.
MARGIN = PlanInput.margin
OVERHEAD_BYTES = int(PlanInput.overhead_gib * GIB)
CONTEXT_STEP = 1024  # a context cap is a whole number of these (of 256 below 2,048)


@dataclass(frozen=True)
class GPUInfo:
    name: str
    memory_bytes: int


@dataclass
class Profile:
    name: str  # "cpu" or "gpu"
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
        return "\n".join([f"PROFILE={self.name}", f"ENGINES={' '.join(self.engine_args())}",
                          f"PROFILE_ARGS={' '.join(self.run_args())}"])


class ProfileError(ValueError):
    pass


def choose_profile(gpus: list[GPUInfo], *, kv_bytes_per_token: float, weights_bytes: float,
                   model_max_context: int | None, max_concurrency: int = 16, margin: float = MARGIN,
                   overhead_bytes: int = OVERHEAD_BYTES, output_tokens: int = 128) -> Profile:
    """The profile for these GPUs and this model (no GPU: the CPU default).

    Every engine runs alone on the first GPU (vLLM and transformers use cuda:0), so its memory sizes the
    ladder: weights + overhead + KV for ``max_concurrency`` sequences of the longest context must fit in
    (1 - margin) of the card. The context is the model's own limit when that fits, else the longest
    whole multiple of 1,024 tokens (256 below 2,048) that does (passed as --max-context; longer rungs are skipped).
    """
    if not gpus:
        return Profile("cpu", CPU_WORKLOAD, ENGINES, None, "no NVIDIA GPU found: the CPU default")
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
        raise ProfileError(f"the model does not fit the GPU profile: {sizing} leave room for "
                           f"{max(fits_tokens, 0):,} tokens per sequence (a 1,024-token prompt needs more)")
    if cap >= model_limit:
        return Profile("gpu", GPU_WORKLOAD, ENGINES, None,
                       f"{sizing}: the model's whole {model_limit:,}-token context fits", list(gpus))
    return Profile("gpu", GPU_WORKLOAD, ENGINES, cap,
                   f"{sizing}: context capped at {cap:,} tokens (the model allows {model_limit:,})", list(gpus))


# --- detection -------------------------------------------------------------------------------------

def detect_gpus(nvml=None) -> list[GPUInfo]:
    """The NVIDIA GPUs of this machine: NVML first, else `nvidia-smi`; [] without one."""
    from bench.samplers import NVML

    nvml = nvml if nvml is not None else NVML()
    if nvml.available:
        return [GPUInfo(d["name"], d["memory_bytes"]) for d in nvml.devices()]
    if nvml.nv is not None or shutil.which("nvidia-smi") is None:  # NVML answered (no device), or no tool
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    if out.returncode == 0:
        for line in out.stdout.splitlines():
            name, _, mib = line.rpartition(",")
            if name.strip() and mib.strip().isdigit():
                gpus.append(GPUInfo(name.strip(), int(mib) * 2**20))
    return gpus


@functools.lru_cache(maxsize=1)
def _gpu_detected() -> bool:
    return bool(detect_gpus())


def has_nvidia_gpu() -> bool:
    """True on a machine with an NVIDIA GPU: the engines' recipes then install their CUDA builds.
    KVBENCH_GPU=1/0 overrides the detection (read on every call; the detection runs once)."""
    forced = os.environ.get("KVBENCH_GPU", "").strip().lower()
    if forced in ("1", "yes", "true", "gpu"):
        return True
    if forced in ("0", "no", "false", "cpu"):
        return False
    return _gpu_detected()


def has_nvcc() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


# --- the model's side ------------------------------------------------------------------------------

def model_sizing(model: str) -> tuple[float, float, int | None]:
    """(KV bytes per token at 16 bits, weights bytes as transformers/vLLM load them, context limit)."""
    from bench import models
    from bench.kvmodel import kv_bytes_per_token
    from bench.planner import resolve_model

    path = str(models.embedded_gguf(model)) if model in models.EMBEDDED else model
    planned = resolve_model(path)
    weights = planned.weights_bytes
    if path.endswith(".gguf"):
        # transformers and vLLM read a bf16 copy: 2 bytes per parameter whatever the GGUF's quantisation.
        from gguf import GGUFReader

        weights = 2 * sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    geom = planned.geometry
    return kv_bytes_per_token(geom, "bf16"), weights, geom.max_context


def profile_for(model: str = "smollm2", gpus: list[GPUInfo] | None = None) -> Profile:
    """The profile `make bench` runs for ``model`` on this machine."""
    if not has_nvidia_gpu():
        return Profile("cpu", CPU_WORKLOAD, ENGINES, None, "no NVIDIA GPU found (or KVBENCH_GPU=0): the CPU default")
    gpus = detect_gpus() if gpus is None else gpus
    if not gpus:
        raise ProfileError("KVBENCH_GPU=1 but no NVIDIA GPU was found (NVML and nvidia-smi)")
    return gpu_profile(model, gpus)


def gpu_profile(model: str, gpus: list[GPUInfo]) -> Profile:
    """The GPU profile for ``model`` on these GPUs: the GPU workload's ladder sized for their memory."""
    from workloads import load

    wl = load(GPU_WORKLOAD)
    per_token, weights, context = model_sizing(model)
    return choose_profile(gpus, kv_bytes_per_token=per_token, weights_bytes=weights, model_max_context=context,
                          max_concurrency=max(wl.concurrency), output_tokens=wl.output_tokens)
