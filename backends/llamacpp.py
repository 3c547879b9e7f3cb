"""llama.cpp: the real C++ ``llama-server`` (the program Ollama runs inside), built from source.

KV pool: llama.cpp's own ``llama_kv_cache: size = ...`` log line(s) (printed with ``-lv 4``; sliding-window
models print one per cache). KV in use: /slots, per slot the prompt tokens plus the tokens decoded so far.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
from pathlib import Path

import httpx

from kvbench.envs import InstallStep, Recipe
from kvbench.hardware import cpu_model, has_nvcc, has_nvidia_gpu
from kvbench.units import MIB

from .base import Backend, extra_args
from .prometheus import gauge_sum, metric_samples
from .streaming import stream_sse
from .types import KVInUse, KVPool, RequestResult, ServerSpec

BUILD_SCRIPT = Path(__file__).with_name("scripts") / "build_llama_server.sh"
_NATIVE_FLAG = '-DGGML_NATIVE="${KVBENCH_GGML_NATIVE:-ON}"'

# llama_kv_cache: size =   90.00 MiB (  4096 cells,  30 layers,  1/1 seqs), K (f16):   45.00 MiB, V (f16):   45.00 MiB
# (older builds prefix the line with llama_kv_cache_unified: and use the same fields)
KV_LINE = re.compile(
    r"llama_kv_cache(?:_unified)?: size =\s*(?P<mib>[\d.]+) MiB \(\s*(?P<cells>\d+) cells,\s*(?P<layers>\d+) layers,"
    r"\s*(?P<streams>\d+)/(?P<seqs_max>\d+) seqs\), K \((?P<type_k>\w+)\):\s*(?P<k_mib>[\d.]+) MiB, "
    r"V \((?P<type_v>\w+)\):\s*(?P<v_mib>[\d.]+) MiB")
# llama.cpp's cache type names for kvbench's dtype names.
CACHE_TYPES = {"auto": "f16", "fp16": "f16", "f16": "f16", "bf16": "bf16", "fp32": "f32", "f32": "f32",
               "q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "iq4_nl": "iq4_nl"}


def parse_kv_log(text: str) -> list[dict]:
    """Every KV cache the server allocated, as logged (one entry per cache; SWA models have two)."""
    caches = []
    for m in KV_LINE.finditer(text):
        caches.append({"mib": float(m["mib"]), "cells": int(m["cells"]), "layers": int(m["layers"]),
                       "streams": int(m["streams"]), "seqs": int(m["seqs_max"]), "type_k": m["type_k"], "type_v": m["type_v"],
                       "k_mib": float(m["k_mib"]), "v_mib": float(m["v_mib"])})
    return caches


class LlamaCppBackend(Backend):
    engine = "llamacpp"
    supports_prefix_caching = True
    default_version = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        native = "OFF" if platform.machine() not in ("x86_64", "AMD64") else "ON"
        if has_nvidia_gpu() and has_nvcc():
            return cls._cuda_recipe(version, native)
        return Recipe("llamacpp", version, (
            InstallStep(("bash", "-c", BUILD_SCRIPT.read_text(), "build_llama_server", version, "{env}"),
                        env=(("KVBENCH_GGML_NATIVE", native),)),),
            venv=False, extra_key=(platform.machine(), cpu_model()))  # -march=native: rebuild on another CPU

    @classmethod
    def _cuda_recipe(cls, version: str, native: str) -> Recipe:
        """The CUDA build (a GPU and nvcc here): the same script with -DGGML_CUDA=ON (with GGML_NATIVE, for
        this machine's GPU architecture), and a CUDA_BUILD marker that tells command() to offload."""
        script = BUILD_SCRIPT.read_text()
        if script.count(_NATIVE_FLAG) != 1:
            raise RuntimeError(f"{BUILD_SCRIPT.name} no longer has one {_NATIVE_FLAG}: update the CUDA recipe")
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        from kvbench.hardware import detect_gpus

        return Recipe("llamacpp", version, (
            InstallStep(("bash", "-c", script.replace(_NATIVE_FLAG, "-DGGML_CUDA=ON " + _NATIVE_FLAG),
                         "build_llama_server", version, "{env}"),
                        env=(("KVBENCH_GGML_NATIVE", native), ("CUDACXX", nvcc))),
            InstallStep(("bash", "-c", 'echo "-DGGML_CUDA=ON" > "$1/CUDA_BUILD"', "mark", "{env}")),),
            venv=False, extra_key=(platform.machine(), cpu_model(), "cuda", *(g.name for g in detect_gpus())))

    def cuda_build(self) -> bool:
        return self.env_path is not None and (Path(self.env_path) / "CUDA_BUILD").exists()

    def command(self, spec: ServerSpec):
        if spec.model.gguf_path is None:
            raise ValueError("llama.cpp needs a GGUF model file")
        cache_type = CACHE_TYPES.get(spec.kv_dtype)
        if cache_type is None:
            raise ValueError(f"llama.cpp has no KV type {spec.kv_dtype!r}; known: {', '.join(sorted(CACHE_TYPES))}")
        cores = os.cpu_count() or 1
        # Generation: on 2 cores -t 2 was 4-12x slower per token than -t 1 (the harness needs a core).
        # Prompt processing (-tb) uses every core: on 2 cores that nearly doubled prefill speed.
        threads = self.options.get("threads", 1 if cores <= 2 else cores // 2)
        batch_threads = self.options.get("batch_threads", cores)
        argv = [str(self.env_path / "bin" / "llama-server"), "-m", str(spec.model.gguf_path),
                "--host", spec.host, "--port", str(spec.port),
                # n_ctx is the total over all slots: each of the -np slots gets max_context cells.
                "-c", str(spec.max_context * spec.pool_sequences), "-np", str(spec.pool_sequences),
                "-t", str(threads), "-tb", str(batch_threads), "--metrics", "--slots", "--no-webui",
                "--cache-type-k", cache_type, "--cache-type-v", cache_type,
                "-lv", "4"]  # the llama_kv_cache lines are printed at this verbosity only
        if cache_type not in ("f16", "f32", "bf16"):
            argv += ["-fa", "on"]  # quantised V cache needs flash attention
        extra = extra_args(self.options)
        if self.cuda_build() and not {"-ngl", "--n-gpu-layers", "--gpu-layers"} & set(extra):
            argv += ["-ngl", "999"]  # every layer, and so its KV cache, on the GPU
        argv += extra
        return argv, {}

    def kv_dtype_name(self) -> str:
        return CACHE_TYPES.get(self.spec.kv_dtype, self.spec.kv_dtype)

    def reported_version(self) -> str:
        try:
            props = self.http.get(self.base_url + "/props").json()
            build = props.get("build_info")
            return f"{self.version} ({build})" if build else self.version
        except (httpx.HTTPError, ValueError):
            return self.version

    def tokenize(self, text: str) -> list[int] | None:
        response = self.http.post(self.base_url + "/tokenize", json={"content": text, "add_special": False})
        return response.json()["tokens"] if response.status_code == 200 else None

    async def stream(self, client, prompt) -> RequestResult:
        body = {"prompt": list(prompt.token_ids), "n_predict": prompt.output_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "return_tokens": True,
                # reuse of a slot's cached prompt prefix: off unless the workload switches it on
                "cache_prompt": bool(self.spec.prefix_caching)}
        return await stream_sse(client, self.base_url + "/completion", body, prompt, self._read_event)

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        if "error" in event:
            result.error = str(event["error"])[:500]
            return
        result.add_chunk(now, len(event.get("tokens") or []))
        if event.get("stop"):
            result.prompt_tokens_reported = event.get("tokens_evaluated")
            result.output_tokens_reported = event.get("tokens_predicted")
            result.engine_details = {"timings": event.get("timings"), "stop_type": event.get("stop_type"),
                                     "tokens_cached": event.get("tokens_cached")}

    def kv_pool(self) -> KVPool | None:
        caches = parse_kv_log(self.server.log_path.read_text(errors="replace")) if self.server else []
        if not caches:
            return None
        # "cells" is per stream: without a unified cache every slot has a stream of its own.
        # MiB with two decimals is all the log gives: the bytes are exact to 0.005 MiB.
        # A sliding-window model logs a second, smaller cache; the token capacity is the full-attention one.
        return KVPool(bytes=round(sum(c["mib"] for c in caches) * MIB),
                      tokens=max(c["cells"] * c["streams"] for c in caches),
                      source="llama_kv_cache log line", details={"caches": caches})

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        slots = client.get(self.base_url + "/slots").json()
        # A slot's n_prompt_tokens is the length of its cached token list, which grows as generated
        # tokens are fed back (so n_decoded must not be added on top).
        tokens = sum(slot.get("n_prompt_tokens", 0) for slot in slots if slot.get("is_processing"))
        return KVInUse(bytes=tokens * self.kv_bytes_per_token(), tokens=tokens,
                       source="/slots n_prompt_tokens x bytes/token")

    def queue_state(self, client: httpx.Client) -> dict | None:
        """Deferred requests (no free slot) from /metrics; /slots lists slots only, so it cannot show them."""
        response = client.get(self.base_url + "/metrics")
        if response.status_code != 200:  # started without --metrics
            return None
        samples = metric_samples(response.text, ("llamacpp:requests_deferred", "llamacpp:requests_processing"))
        waiting = gauge_sum(samples, "llamacpp:requests_deferred")
        if waiting is None:
            return None
        return {"waiting": waiting, "running": gauge_sum(samples, "llamacpp:requests_processing"),
                "source": "llamacpp:requests_deferred/requests_processing (/metrics)"}
