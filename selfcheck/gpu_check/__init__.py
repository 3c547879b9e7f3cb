"""The GPU checks, ``python -m kvbench.selfcheck.gpu_check`` (``make gpu-check``): one module per check, each
with its rows, its measuring step, its table and its problems.

- ``sampler``: (a) the NVML sampler against a real allocation
- ``kv``: (b) transformers' KV cache on CUDA measured three ways against the hf rules
- ``engine_runs``: (c) each installed engine through ``kvbench run``
- ``overhead``: (d) the runtime overhead per model against the planner's assumption
- ``llama_build``: (e) llama.cpp's CUDA server built from a source archive
- ``kv_quant``: (f) transformers' quantised caches against the bf16 one
- ``probe``: the CUDA side (the transformers engine's gpu_probe.py) and NVML snapshots; ``common``: what
  they share; ``report``: the verdict and gpu_check.md; ``main``: the arguments and the order of the checks.

The names below are those the checks' tests use.
"""
from .common import Budget
from .engine_runs import check_engines, engine_row
from .kv import CONFIG_DIR, DEFAULT_CONFIGS, NEW_TOKENS, check_kv, kv_cells, kv_row
from .kv_quant import check_kv_quant, kv_quant_caches, kv_quant_rows, run_kv_quant
from .llama_build import build_llama, cuda_architecture, llama_build_argv
from .main import EXIT_NO_GPU, main, no_gpu_message
from .overhead import overhead_row
from .report import render_markdown, verdict
from .sampler import check_sampler, sampler_row

__all__ = ["Budget", "CONFIG_DIR", "DEFAULT_CONFIGS", "EXIT_NO_GPU", "NEW_TOKENS", "build_llama", "check_engines",
           "check_kv", "check_kv_quant", "check_sampler", "cuda_architecture", "engine_row", "kv_cells",
           "kv_quant_caches", "kv_quant_rows", "kv_row", "llama_build_argv", "main", "no_gpu_message",
           "overhead_row", "render_markdown", "run_kv_quant", "sampler_row", "verdict"]
