"""Plain Hugging Face transformers (the baseline): backends/hf/scripts/hf_worker.py in an environment of its own."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import httpx

from kvbench.common.envs import InstallStep, Recipe, ensure_env, env_python, pip_install
from kvbench.common.hardware import has_nvidia_gpu
from kvbench.common.models import ModelFiles
from kvbench.kv.rules import KVCheck, KVQuestion, KVRules

from ..base import Backend
from ..capabilities import Capabilities, DeviceBandwidth, KVQuantisation
from ..options import Option
from ..process import run_in_own_group
from ..streaming import stream_sse
from ..types import KVInUse, KVPool, RequestResult, ServerSpec
from .kvrules import QUANTIZED, TransformersKV

SCRIPTS = Path(__file__).with_name("scripts")
WORKER = SCRIPTS / "hf_worker.py"
CONVERTER = SCRIPTS / "hf_convert_gguf.py"
PROBE = SCRIPTS / "hf_kv_probe.py"
BUILDER = SCRIPTS / "hf_build_tiny.py"
# The embedded model's cases: (dtype, prompt, new tokens, batch)
EMBEDDED_CASES = (("bf16", 300, 8, 2), ("fp32", 100, 4, 1), ("quanto-int4", 300, 8, 2))
FAMILY_CASE = (100, 4, 2)  # prompt, new tokens, batch: past the validation families' windows and chunks (64)
# optimum-quanto: transformers' QuantizedCache backend (the quanto-int4/int2 KV dtypes). It builds a C++ unpack
# extension (torch cpp_extension, with its ninja dependency and the C++ compiler `make` already needs) on first
# use: built at install, so no engine start waits for it.
QUANTO = "optimum-quanto==0.2.7"
BUILD_QUANTO = InstallStep(("{python}", "-c", "import torch; from optimum.quanto.library.extensions import get_extension; "
                            "get_extension('quanto_cpp').lib; print('quanto_cpp built for torch', torch.__version__)"))
# What the scripts run with: offline, and nothing of the harness's environment.
SCRIPT_ENV = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}


class HFBackend(Backend):
    engine = "hf"
    default_version = "5.24.0"
    reports_started_version = True
    #: The options this adapter reads (-b hf:KEY=VALUE); checked by BackendConfig.parse, listed by `kvbench backends`.
    option_specs = (
        Option("engine_mode", str, "sized", "transformers has no pool to size; deployed loads the model with "
               "device_map=auto (accelerate spreads it over every GPU) unless device_map says otherwise",
               choices=("sized", "deployed")),
        Option("batch_wait_ms", int, 200, "how long the worker waits to fill a batch (--batch-wait-ms)",
               minimum=0),
        Option("threads", int, None, "torch threads of the worker (--threads)", default_text="torch's own"),
        Option("device_map", str, None, "from_pretrained's device_map, e.g. auto: the layers over every GPU",
               default_text="the whole model on cuda:0 (or the CPU)"),
    )
    kv_rules = TransformersKV()
    # the worker's top_logprobs: log_softmax of the raw logits, top k per generated token (hf_worker.py)
    capabilities = Capabilities(kv_quantisation=KVQuantisation(top_logprobs_max=20),
                                device_bandwidth=DeviceBandwidth(script=SCRIPTS / "gpu_probe.py"))
    BUILDER = BUILDER  # what builds the random-weight validation models (its bytes key their cache)

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        # torch 2.13.0 is the CPU build on these machines; gguf + accelerate let transformers read GGUF files.
        torch = "torch==2.13.0"
        packages = (torch, f"transformers=={version}", "gguf", "accelerate", "safetensors", "sentencepiece", QUANTO)
        if has_nvidia_gpu():
            # PyPI's Linux torch wheel is the CUDA build; a local CPU wheel (a find-links folder) would win
            # the resolution, so the environment is refused unless its torch sees CUDA.
            return Recipe("hf", version, (pip_install(*packages), BUILD_QUANTO, InstallStep((
                "{python}", "-c", "import sys, torch; ok = torch.version.cuda and torch.cuda.is_available(); "
                "print('torch', torch.__version__, 'cuda', torch.version.cuda); "
                "sys.exit(0 if ok else 'this torch is not a CUDA build that sees the GPU: the GPU profile needs one')")),),
                          extra_key=("cuda",))
        return Recipe("hf", version, (pip_install(*packages), BUILD_QUANTO))

    @classmethod
    def gguf_converter(cls, log=print, python: Path | None = None):
        """A :data:`kvbench.common.models.GGUFConverter` run by transformers in this engine's environment (installed
        on first use), or by ``python``: it dequantises the GGUF into bf16 safetensors plus the tokenizer."""
        def convert(gguf: Path, out_dir: Path, log_file: Path) -> None:
            interpreter = python or env_python(ensure_env(cls.recipe(cls.default_version), log=log))
            with log_file.open("w") as out:
                # stopped with kvbench: an interrupted `kvbench setup` or run leaves no converter running
                code = run_in_own_group([str(interpreter), str(CONVERTER), str(gguf), str(out_dir)], stdout=out,
                                        stderr=subprocess.STDOUT, env=SCRIPT_ENV)
            if code != 0:
                raise RuntimeError(f"{CONVERTER.name} exited with code {code}")
        return convert

    @classmethod
    def run_script(cls, script: Path, args: list[str], jobs: list[dict], python: Path, timeout_s: float = 1800) -> list[dict]:
        """Run one of this engine's scripts on a list of jobs; its JSON list of results (one per job)."""
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(jobs, f)
            f.flush()
            out = subprocess.run([str(python), str(script), *args, f.name], capture_output=True, text=True,
                                 timeout=timeout_s, env=SCRIPT_ENV, cwd=SCRIPTS)
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return [{"error": f"{script.name} failed: {out.stderr.strip()[-500:]}"}] * len(jobs)

    @classmethod
    def build_models(cls, python: Path, tokenizer_dir: Path, jobs: list[dict]) -> list[dict]:
        """Random-weight models from configs ({"config", "out"} jobs), with the tokenizer of ``tokenizer_dir``."""
        return cls.run_script(BUILDER, [str(tokenizer_dir)], jobs, python)

    @classmethod
    def kv_checks(cls, env: Path, model: ModelFiles, log_dir: Path) -> list[KVCheck]:
        serving = cls.kv_rules.serving_dtype(model.geometry)
        jobs = [{"model": str(model.hf_dir), "prompt": p, "new": n, "batch": b, "dtype": serving if d in QUANTIZED else d,
                 "cache_config": QUANTIZED[d].cache_config() if d in QUANTIZED else None}
                for d, p, n, b in EMBEDDED_CASES]
        checks = []
        for (dtype, prompt, new, batch), got in zip(EMBEDDED_CASES, cls.run_script(PROBE, [], jobs, env_python(env))):
            q = KVQuestion(model.geometry, dtype, prompt + new - 1, batch, options={"decoded_tokens": new - 1})
            predicted = cls.kv_rules.answer(q).bytes_per_gpu
            checks.append(KVCheck("hf", f"{model.name} {dtype}, {batch} x ({prompt} + {new})", "cache tensor bytes",
                                  predicted, None, got.get("cache_bytes"), tolerance=0,
                                  note=got.get("error") or f"transformers {got['transformers']}"))
        return checks

    @classmethod
    def measure_kv(cls, env: Path, models: list[ModelFiles], log_dir: Path, python: Path | None = None) -> list[KVCheck]:
        prompt, new, batch = FAMILY_CASE
        jobs = [{"model": str(m.hf_dir), "prompt": prompt, "new": new, "batch": batch, "dtype": "bf16"} for m in models]
        checks = []
        for m, got in zip(models, cls.run_script(PROBE, [], jobs, env_python(env))):
            q = KVQuestion(m.geometry, "bf16", prompt + new - 1, batch)
            lengths = got.get("layer_lengths")
            checks.append(KVCheck("hf", f"{batch} x ({prompt} + {new}) tokens, bf16", "cache tensor bytes",
                                  cls.kv_rules.answer(q).bytes_per_gpu, None, got.get("cache_bytes"), tolerance=0,
                                  family=m.name, note=got.get("error") or f"tokens per layer {lengths}",
                                  formula=KVRules().answer(q).bytes_per_gpu))
        return checks

    def command(self, spec: ServerSpec):
        dtype = "bf16" if spec.kv_dtype == "auto" else spec.kv_dtype
        quantized = QUANTIZED.get(dtype)
        if quantized:  # the model in its serving dtype (the baseline's), the cache quantised
            dtype = self.kv_rules.serving_dtype(spec.model.geometry)
        argv = [str(env_python(self.env_path)), str(WORKER), "--model", str(spec.model.hf_dir),
                "--host", spec.host, "--port", str(spec.port), "--dtype", dtype,
                "--max-batch", str(spec.max_concurrency),
                "--batch-wait-ms", str(self.options.get("batch_wait_ms", 200))]
        if quantized:
            argv += ["--cache-config", json.dumps(quantized.cache_config())]
        if "threads" in self.options:
            argv += ["--threads", str(self.options["threads"])]
        # deployed on a GPU machine: device_map=auto (every GPU), as transformers is deployed there
        deployed_map = "auto" if self.options.get("engine_mode") == "deployed" and has_nvidia_gpu() else None
        device_map = self.options.get("device_map") or deployed_map
        if device_map:
            argv += ["--device-map", device_map]
        return argv, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}

    @classmethod
    def gpus_used(cls, options: dict) -> int:
        """device_map=auto (given, or deployed mode's) spreads the layers over every GPU found; else one."""
        device_map = options.get("device_map") or ("auto" if options.get("engine_mode") == "deployed" else None)
        if device_map != "auto" or not has_nvidia_gpu():
            return 1
        from kvbench.common.hardware import detect_gpus

        return max(1, len(detect_gpus()))

    def reported_version(self) -> str:
        try:
            return self.http.get(self.base_url + "/info").json()["version"]
        except (httpx.HTTPError, KeyError, ValueError):
            return self.version

    async def stream(self, client, prompt) -> RequestResult:
        body = {"prompt_token_ids": prompt.token_ids, "max_new_tokens": prompt.output_tokens, "ignore_eos": True}
        if prompt.top_logprobs:
            body["top_logprobs"] = min(prompt.top_logprobs, self.capabilities.kv_quantisation.top_logprobs_max)
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
            result.output_ids = [int(t) for t in event.get("output_ids") or []]
            result.top_logprobs = [{int(t): float(lp) for t, lp in top} for top in event.get("top_logprobs") or []]

    def kv_pool(self) -> KVPool | None:
        # Static batching has no pool: the cache grows with the batch and is freed after it.
        try:
            weights = self.http.get(self.base_url + "/info").json().get("weights_bytes")
        except (httpx.HTTPError, ValueError, AttributeError):
            weights = None
        return KVPool(bytes=None, tokens=None, source="no pool (static batching)",
                      details={"weights_bytes": weights,
                               "weights_source": "parameters and buffers as loaded" if weights else None})

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
