"""Hugging Face Text Generation Inference: ``text-generation-launcher`` when it is on PATH, else Docker with
TGI's image. Nothing is installed by kvbench (TGI is neither on PyPI nor in Debian): the recipe is empty.

Requests go to the native ``/generate_stream`` (SSE), as text: TGI takes no token ids. Its API has no
ignore_eos, so a request may stop early at EOS; the adapter reports what TGI says it generated
(``details.generated_tokens``) and its finish_reason, and the runner's token contract flags the shortfall.

KV pool: the gauge ``tgi_batch_max_total_tokens`` on /metrics (since 2.3.1), else the router's log line
``Setting max batch total tokens to N`` or the shard's ``KV-cache blocks: N, size: B`` (since 2.4.0), in
tokens, x bytes per token from the model's geometry (exact for one shard: max_batch_total_tokens is
num_blocks x BLOCK_SIZE). KV in use: ``tgi_batch_current_max_tokens``, a reservation (prompt +
max_new_tokens of every request in the running batch), not tokens written.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

import httpx

from kvbench.common.envs import Recipe
from kvbench.common.redact import scrub

from ..base import Backend, extra_args
from ..capabilities import Capabilities, ServedModel
from ..options import EXTRA_ARGS, Option
from ..process import read_log
from ..prometheus import PrometheusPolled, gauge_sum
from ..streaming import stream_sse
from ..types import EngineStartError, KVInUse, KVPool, RequestResult, ServerSpec
from .kvrules import TGIKV

IMAGE = "ghcr.io/huggingface/text-generation-inference"
LAUNCHER = "text-generation-launcher"
# kvbench KV dtype -> TGI's --kv-cache-dtype (TGI stores fp8 only as these two)
FP8 = {"fp8": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn", "fp8_e4m3fn": "fp8_e4m3fn", "fp8_e5m2": "fp8_e5m2"}
# kvbench KV dtype -> TGI's --dtype (the cache then takes the model's dtype); "auto": TGI's own choice
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "float16": "float16"}

MAX_BATCH_LINE = re.compile(r"Setting max batch total tokens to (\d+)")
BLOCKS_LINE = re.compile(r"KV-cache blocks: (\d+), size: (\d+)")


def parse_tgi_log(text: str) -> dict:
    """The launcher log's KV figures (the last of each: a restarted shard logs again)."""
    out: dict = {}
    totals = MAX_BATCH_LINE.findall(text)
    if totals:
        out["max_batch_total_tokens"] = int(totals[-1])
    blocks = BLOCKS_LINE.findall(text)
    if blocks:
        out["num_blocks"], out["block_size"] = int(blocks[-1][0]), int(blocks[-1][1])
    return out


@dataclass(frozen=True)
class TGIServedModel(ServedModel):
    def models(self, backend: Backend) -> list[str] | None:
        """The model_id of TGI's /info (the folder or hub id the launcher was given)."""
        try:
            return [str(backend.http.get(backend.base_url + "/info").json()["model_id"])]
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return None


class TGIBackend(PrometheusPolled, Backend):
    engine = "tgi"
    kv_rules = TGIKV()
    default_version = "3.3.5"  # the Docker image tag when TGI runs in Docker
    #: The options this adapter reads (-b tgi:KEY=VALUE); checked by BackendConfig.parse, listed by `kvbench backends`.
    option_specs = (
        Option("mode", str, "auto", "how TGI starts", choices=("auto", "launcher", "docker")),
        Option("launcher", str, None, "path of text-generation-launcher", default_text="the one on PATH"),
        Option("image", str, None, "Docker image", default_text=f"{IMAGE}:VERSION"),
        Option("gpus", str, "all", "docker run --gpus (empty: none)"),
        Option("max_batch_prefill_tokens", int, None, "--max-batch-prefill-tokens", default_text="the context cap"),
        Option("max_concurrent_requests", int, None, "--max-concurrent-requests",
               default_text="the workload's top concurrency"),
        Option("engine_mode", str, "sized", "sized: prefill batch and concurrency set by kvbench for the workload; "
               "deployed: TGI's own (its warm-up sizes max-batch-total-tokens either way)",
               choices=("sized", "deployed")),
        Option("num_shard", int, None, "GPUs to shard the model over (--num-shard)", default_text="TGI's own"),
        EXTRA_ARGS,
    )
    accepts_token_ids = False
    forces_output_length = False  # no ignore_eos in TGI's API
    health_path = "/health"
    capabilities = Capabilities(served_model=TGIServedModel())
    POLLED = ("tgi_batch_current_max_tokens", "tgi_queue_size")  # the samples polled during a cell

    @classmethod
    def gpus_used(cls, options: dict) -> int:
        return int(options.get("num_shard") or 1)

    @classmethod
    def parallelism(cls, options: dict) -> dict[str, int]:
        """Its shards (tensor parallel)."""
        return {"tp": cls.gpus_used(options)}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode: str | None = None  # "launcher" or "docker", set by command()
        self.container: str | None = None

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        # Nothing to install: the launcher is the user's, or Docker pulls the image on first start.
        return Recipe("tgi", version, (), venv=False)

    # --- lifecycle -----------------------------------------------------------------------------
    def _limits(self, spec: ServerSpec) -> list[str]:
        # Every request is prompt + output <= max_context tokens; TGI wants max_input < max_total and
        # a prefill batch that holds one whole prompt.
        argv = ["--max-input-tokens", str(spec.max_context - 1), "--max-total-tokens", str(spec.max_context)]
        deployed = self.options.get("engine_mode", "sized") == "deployed"
        if not deployed or "max_batch_prefill_tokens" in self.options:
            argv += ["--max-batch-prefill-tokens",
                     str(int(self.options.get("max_batch_prefill_tokens", spec.max_context)))]
        if not deployed or "max_concurrent_requests" in self.options:
            argv += ["--max-concurrent-requests",
                     str(int(self.options.get("max_concurrent_requests", spec.max_concurrency)))]
        if self.options.get("num_shard"):
            argv += ["--num-shard", str(int(self.options["num_shard"]))]
        kv = spec.kv_dtype.lower()
        if kv in FP8:
            argv += ["--kv-cache-dtype", FP8[kv]]
        elif kv in DTYPES:
            argv += ["--dtype", DTYPES[kv]]
        elif kv != "auto":
            raise ValueError(f"TGI has no KV dtype {spec.kv_dtype!r}; known: auto, {', '.join(sorted({*FP8, *DTYPES}))}")
        return argv + extra_args(self.options)

    def command(self, spec: ServerSpec):
        mode = self.options.get("mode", "auto")
        launcher = self.options.get("launcher") or shutil.which(LAUNCHER)
        docker = shutil.which("docker")
        if mode == "launcher" or (mode == "auto" and launcher):
            if not launcher:
                raise EngineStartError(f"{LAUNCHER} not on PATH (tgi:mode=launcher)")
            self.mode = "launcher"
            return ([launcher, "--model-id", str(spec.model.hf_dir), "--hostname", spec.host, "--port", str(spec.port),
                     *self._limits(spec)], {"HF_HUB_OFFLINE": "1"})
        if mode in ("docker", "auto") and docker:
            self.mode = "docker"
            self.container = f"kvbench-tgi-{spec.port}"
            image = self.options.get("image", f"{IMAGE}:{self.version}")
            gpus = self.options.get("gpus", "all")
            argv = [docker, "run", "--rm", "--name", self.container, "--shm-size", "1g",
                    # published on the loopback interface only; TGI listens on port 80 inside
                    "-p", f"{spec.host}:{spec.port}:80", "-v", f"{spec.model.hf_dir}:/data/model:ro",
                    "-e", "HF_HUB_OFFLINE=1"]
            if gpus:
                argv += ["--gpus", str(gpus)]
            return [*argv, image, "--model-id", "/data/model", *self._limits(spec)], {}
        if mode not in ("auto", "launcher", "docker"):
            raise ValueError(f"tgi:mode={mode!r}: one of auto, launcher, docker")
        if mode == "docker":
            raise EngineStartError("docker not available (tgi:mode=docker)")
        raise EngineStartError(f"{LAUNCHER} not on PATH and docker not available: install TGI "
                               "(https://huggingface.co/docs/text-generation-inference) or Docker, or attach to a "
                               "running server with -b tgi:url=http://host:port")

    def stop(self) -> list[dict]:
        if self.mode == "docker" and self.container and self.server and self.server.alive():
            # The docker CLI forwards SIGTERM, but a SIGKILLed CLI would leave the container running.
            subprocess.run([shutil.which("docker") or "docker", "stop", "-t", "10", self.container],
                           capture_output=True, timeout=30, check=False)
        return super().stop()

    def reported_version(self) -> str:
        # /info on the adapter's own client, not huggingface_hub's InferenceClient.get_endpoint_info: that
        # call refuses every request, even to a local server, when HF_HUB_OFFLINE=1 (which offline benchmark
        # machines and kvbench's tests set), takes no timeout and no CA bundle, and returns the JSON unparsed,
        # so it would check nothing more. The official client drives the fake in tests/backends/test_fake_conformance.py.
        # (TGI's own old client, the `text-generation` package, requires huggingface-hub < 1.0: it cannot be
        # installed beside kvbench's huggingface_hub >= 1.0 and transformers 5.)
        try:
            info = self.http.get(self.base_url + "/info").json()
            version = info["version"]
            return f"{version} ({info['sha'][:7]})" if info.get("sha") else version
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return self.version

    def kv_dtype_name(self) -> str:
        kv = self.spec.kv_dtype.lower()
        return FP8.get(kv) or ("fp16" if DTYPES.get(kv) == "float16" else "bf16")

    # --- measurement ---------------------------------------------------------------------------
    async def stream(self, client, prompt) -> RequestResult:
        # add_special_tokens false: the prompt's tokens are the text's own, as sent to every engine
        body = {"inputs": prompt.text, "add_special_tokens": False,
                "parameters": {"max_new_tokens": prompt.output_tokens, "details": True,
                               "decoder_input_details": False, "do_sample": False}}
        # /generate_stream sends no [DONE]: a stream without the final event (details) ended early
        return await stream_sse(client, self.base_url + "/generate_stream", body, prompt, self._read_event,
                                final_event="TGI's final event (details)")

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        if "error" in event:  # validation / overloaded / generation errors arrive as one event, HTTP 200
            result.error = scrub(f"{event.get('error_type') or 'error'}: {event['error']}")[:500]
            return
        token = event.get("token")
        # One event per generated token; a special token (EOS) is a generated token too.
        result.add_chunk(now, 1 if token else 0)
        details = event.get("details")
        if details:
            result.prompt_tokens_reported = details.get("input_length")  # absent before TGI 2.x: unknown
            result.output_tokens_reported = details.get("generated_tokens")
            result.engine_details = {"finish_reason": details.get("finish_reason"), "seed": details.get("seed"),
                                     "last_token_special": bool(token and token.get("special"))}

    @classmethod
    def startup_figures_from_log(cls, text: str) -> dict | None:
        """The router's "Setting max batch total tokens to N" (the tokens its warmup left the KV blocks) and the
        shard's "KV-cache blocks: N, size: B" where it prints them."""
        log = parse_tgi_log(text)
        if not log:
            return None
        out: dict = {"device": "gpu"}
        if "max_batch_total_tokens" in log:
            out["pool_tokens"] = log["max_batch_total_tokens"]
        if "num_blocks" in log:
            out["blocks"] = log["num_blocks"]
            out.setdefault("pool_tokens", log["num_blocks"] * log["block_size"])
        out["lines"] = [line.strip() for line in text.splitlines()
                        if MAX_BATCH_LINE.search(line) or BLOCKS_LINE.search(line)]
        return out

    def startup_settings(self, spec: ServerSpec) -> dict:
        """The warmup's prefill (--max-batch-prefill-tokens: the context cap when sized) is what TGI's rule reads."""
        deployed = self.options.get("engine_mode", "sized") == "deployed"
        prefill = self.options.get("max_batch_prefill_tokens", None if deployed else spec.max_context)
        return {"engine_options": {"max_batch_prefill_tokens": int(prefill)} if prefill else {},
                "kv_dtype": spec.kv_dtype}

    def kv_pool(self) -> KVPool | None:
        log = parse_tgi_log(read_log(self.server.log_path)) if self.server else {}
        try:
            tokens = gauge_sum(self.metrics(self.http), "tgi_batch_max_total_tokens")
        except httpx.HTTPError:
            tokens = None
        if tokens:
            source = "tgi_batch_max_total_tokens (/metrics) x bytes/token"
        elif "max_batch_total_tokens" in log:
            tokens, source = log["max_batch_total_tokens"], "router log 'Setting max batch total tokens' x bytes/token"
        elif "num_blocks" in log:
            tokens, source = log["num_blocks"] * log["block_size"], "shard log 'KV-cache blocks: N, size: B' x bytes/token"
        else:
            return None
        tokens = int(tokens)
        return KVPool(bytes=round(tokens * self.kv_bytes_per_token()), tokens=tokens, source=source,
                      details={"log": log, "per_shard": True})

    def kv_from_samples(self, samples: dict) -> KVInUse | None:
        tokens = gauge_sum(samples, "tgi_batch_current_max_tokens")
        if tokens is None:
            return None
        return KVInUse(bytes=tokens * self.kv_bytes_per_token(), tokens=tokens,
                       source="tgi_batch_current_max_tokens x bytes/token (a reservation: prompt + max_new_tokens "
                              "of the running batch, not tokens written)")

    def queue_from_samples(self, samples: dict) -> dict | None:
        waiting = gauge_sum(samples, "tgi_queue_size")
        return None if waiting is None else {"waiting": waiting, "source": "tgi_queue_size (/metrics)"}
