"""How long ``kvbench plan`` takes for a catalog model, a fresh interpreter each round (issue 36 item 5): one
round is what a user waits for the first answer. Every catalog family is here, each as a user sizing a
deployment asks it (the plain formula, or an engine on a GPU with its levers): Llama, Qwen2, Qwen3-MoE, Mistral,
Gemma 2, Gemma 3 (a decoder, and a multimodal wrapper), gpt-oss, DeepSeek-V2/V3 (MLA, with data-parallel
attention and pipeline levers) and the embedded model (a GGUF). None imports transformers, gguf or numpy:
their configs are read plainly (kvbench.kv.model_config.PlainConfig, the GGUF header by
kvbench.kv.bounded.read_gguf_header), each checked equal to the libraries' reading by tests/kv/test_plain_configs.py."""
import subprocess
import sys

import pytest

CASES = {
    "llama-plain-formula": ("llama-3.1-8b", "-n", "8k"),
    "llama-vllm-h100": ("llama-3.1-70b", "-n", "8k", "--engine", "vllm", "--gpu", "H100-80GB"),
    "qwen2-vllm-l4": ("qwen2.5-7b", "-n", "10k", "--engine", "vllm", "--gpu", "L4"),
    "qwen3-moe-nvfp4-vllm-h200": ("qwen3-235b-a22b-nvfp4", "-n", "32k", "--engine", "vllm", "--gpu", "H200",
                                  "--tp", "4"),
    "mistral-plain-formula": ("mistral-7b-v0.1", "-n", "8k"),
    "gemma2-vllm-l4": ("gemma-2-9b", "-n", "8k", "--engine", "vllm", "--gpu", "L4"),
    "gemma3-text-plain-formula": ("gemma-3-1b", "-n", "32k"),
    "gemma3-wrapper-tgi-h100": ("gemma-3-27b", "-n", "128K", "--engine", "tgi", "--gpu", "H100-80GB"),
    "gpt-oss-vllm-h100": ("gpt-oss-20b", "-n", "32k", "--engine", "vllm", "--gpu", "H100-80GB"),
    "gpt-oss-120b-sglang-h200": ("gpt-oss-120b", "-n", "32k", "--batch", "16", "--engine", "sglang", "--gpu", "H200"),
    "deepseek-v2-plain-formula": ("deepseek-v2", "-n", "8k"),
    "deepseek-v3-vllm-8xh200": ("deepseek-v3", "-n", "32k", "--batch", "64", "--engine", "vllm", "--gpu", "H200",
                                "--tp", "8"),
    "embedded-gguf-llamacpp-l4": ("smollm2", "-n", "4k", "--engine", "llamacpp", "--gpu", "L4"),
}


def _plan(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvbench.cli", "plan", *args], capture_output=True, text=True,
                          check=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    return done.stdout


@pytest.mark.parametrize("args", list(CASES.values()), ids=list(CASES))
def test_plan_catalog_model(benchmark, args):
    out = benchmark.pedantic(_plan, args=args, rounds=10, warmup_rounds=1)
    assert out.startswith("Asked: ")
