"""Plain Hugging Face transformers (the baseline): backends/scripts/hf_worker.py in an environment of its own."""
from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from kvbench.envs import InstallStep, Recipe, ensure_env, env_python, pip_install
from kvbench.hardware import has_nvidia_gpu

from .base import Backend
from .streaming import stream_sse
from .types import KVInUse, KVPool, RequestResult, ServerSpec

SCRIPTS = Path(__file__).with_name("scripts")
WORKER = SCRIPTS / "hf_worker.py"
CONVERTER = SCRIPTS / "hf_convert_gguf.py"
# What the scripts run with: offline, and nothing of the harness's environment.
SCRIPT_ENV = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}


class HFBackend(Backend):
    engine = "hf"
    default_version = "5.24.0"

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        # torch 2.13.0 is the CPU build on these machines; gguf + accelerate let transformers read GGUF files.
        torch = "torch==2.13.0"
        packages = (torch, f"transformers=={version}", "gguf", "accelerate", "safetensors", "sentencepiece")
        if has_nvidia_gpu():
            # PyPI's Linux torch wheel is the CUDA build; a local CPU wheel (a find-links folder) would win
            # the resolution, so the environment is refused unless its torch sees CUDA.
            return Recipe("hf", version, (pip_install(*packages), InstallStep((
                "{python}", "-c", "import sys, torch; ok = torch.version.cuda and torch.cuda.is_available(); "
                "print('torch', torch.__version__, 'cuda', torch.version.cuda); "
                "sys.exit(0 if ok else 'this torch is not a CUDA build that sees the GPU: the GPU profile needs one')")),),
                          extra_key=("cuda",))
        return Recipe("hf", version, (pip_install(*packages),))

    @classmethod
    def gguf_converter(cls, log=print, python: Path | None = None):
        """A :data:`kvbench.models.GGUFConverter` run by transformers in this engine's environment (installed
        on first use), or by ``python``: it dequantises the GGUF into bf16 safetensors plus the tokenizer."""
        def convert(gguf: Path, out_dir: Path, log_file: Path) -> None:
            interpreter = python or env_python(ensure_env(cls.recipe(cls.default_version), log=log))
            with log_file.open("w") as out:
                code = subprocess.run([str(interpreter), str(CONVERTER), str(gguf), str(out_dir)], stdout=out,
                                      stderr=subprocess.STDOUT, env=SCRIPT_ENV).returncode
            if code != 0:
                raise RuntimeError(f"{CONVERTER.name} exited with code {code}")
        return convert

    def command(self, spec: ServerSpec):
        dtype = "bf16" if spec.kv_dtype == "auto" else spec.kv_dtype
        argv = [str(env_python(self.env_path)), str(WORKER), "--model", str(spec.model.hf_dir),
                "--host", spec.host, "--port", str(spec.port), "--dtype", dtype,
                "--max-batch", str(spec.max_concurrency),
                "--batch-wait-ms", str(self.options.get("batch_wait_ms", 200))]
        if "threads" in self.options:
            argv += ["--threads", str(self.options["threads"])]
        return argv, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}

    def reported_version(self) -> str:
        try:
            return self.http.get(self.base_url + "/info").json()["version"]
        except (httpx.HTTPError, KeyError, ValueError):
            return self.version

    async def stream(self, client, prompt) -> RequestResult:
        body = {"prompt_token_ids": list(prompt.token_ids), "max_new_tokens": prompt.output_tokens, "ignore_eos": True}
        return await stream_sse(client, self.base_url + "/generate", body, prompt, self._read_event)

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        if "error" in event:
            result.error = event["error"]
        elif "token_ids" in event:
            result.add_chunk(now, len(event["token_ids"]))
        elif event.get("done"):
            result.prompt_tokens_reported = event["usage"]["prompt_tokens"]
            result.output_tokens_reported = event["usage"]["completion_tokens"]
            result.engine_details = event.get("kv", {})

    def kv_pool(self) -> KVPool | None:
        # Static batching has no pool: the cache grows with the batch and is freed after it.
        return KVPool(bytes=None, tokens=None, source="no pool (static batching)")

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        state = client.get(self.base_url + "/kv").json()
        return KVInUse(bytes=state["kv_bytes_in_use"], tokens=None, source="cache tensors")

    def kv_peak(self) -> KVInUse | None:
        """Exact: the cache tensors' bytes at the end of each generate call, when the cache is largest."""
        state = self.http.get(self.base_url + "/kv").json()
        return KVInUse(bytes=state["kv_bytes_peak"], tokens=state["kv_tokens_peak"],
                       source="cache tensors (numel x element_size) at the end of generate",
                       details={"allocator_bytes": state.get("allocator_kv_bytes_peak"),
                                "allocator_generate_peak_bytes": state.get("allocator_generate_peak_bytes"),
                                "allocator_reserved_delta_bytes": state.get("allocator_reserved_delta_bytes"),
                                "device": state.get("device")})

    def reset_cell(self) -> None:
        self.http.get(self.base_url + "/kv", params={"reset": 1})
