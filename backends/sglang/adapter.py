"""SGLang: ``python -m sglang.launch_server`` in its own environment (the ``sglang`` wheel, on a machine with an
NVIDIA GPU: SGLang publishes no CPU build, see docs/engines.md), or attach to a running server.

Requests go to the native ``/generate`` as token ids (``input_ids``) with ``sampling_params`` {max_new_tokens,
ignore_eos, temperature 0} and ``stream``: SGLang answers ``data: {"text", "output_ids", "meta_info"}``
events (output_ids and completion_tokens cumulative unless the server runs --incremental-streaming-output)
and ``data: [DONE]``; an error inside the stream is one ``data: {"error": {...}}`` event
(entrypoints/http_server.py serve_generate_request). Each event's new tokens are the growth of
``meta_info.completion_tokens``; the final event (finish_reason set) carries the counts.

KV pool: ``max_total_num_tokens`` of ``/server_info`` (``/get_server_info`` before 0.5.x), else the gauge
``sglang:max_total_num_tokens``, else the scheduler's log line ``max_total_num_tokens=N, ...``, in tokens;
bytes from the rules (the buffers as allocated: tokens + a padding page per pool). The log's ``KV Cache is
allocated. ... #tokens: N, K size: X GB, V size: Y GB`` lines go into the details. KV in use:
``sglang:kv_used_tokens`` (tokens the running requests hold in the full pool; radix-cached tokens that can
be evicted are not in it), else ``sglang:num_used_tokens``, plus ``sglang:swa_used_tokens`` in a hybrid
model; SGLang refreshes these gauges after each prefill batch and every ``--decode-log-interval`` (40) decode
steps, so a poll reads them up to that many steps late. Queue: ``sglang:num_queue_reqs``,
``sglang:num_running_reqs``, ``sglang:num_retracted_requests_total`` (SGLang retracts, not preempts). /metrics
needs --enable-metrics, which kvbench always passes; from 0.5.23 it adds --enable-mfu-metrics (step_bytes.py).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import httpx

from kvbench.common.envs import InstallStep, Recipe, env_python, pip_install
from kvbench.common.hardware import has_nvidia_gpu
from kvbench.common.redact import scrub
from kvbench.kv.geometry import round_up
from kvbench.kv.rules import KVQuestion
from kvbench.kv.units import GIB

from ..base import Backend, extra_args
from ..capabilities import Capabilities, PrefixCache, Telemetry
from ..options import EXTRA_ARGS, Option
from ..process import read_log
from ..prometheus import PrometheusPolled, gauge_sum
from ..shared.served_models import OpenAIModelList
from ..streaming import stream_sse
from ..types import EngineStartError, KVInUse, KVPool, RequestResult, ServerSpec
from .kvrules import SGLangKV
from .step_bytes import STEP_BYTES

# kvbench KV dtype -> SGLang's --kv-cache-dtype (fp8) or --dtype (the model dtype, which auto KV takes)
KV_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
MODEL_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                "f16": "float16", "fp32": "float32", "float32": "float32"}
# mem_cache/memory_pool.py _finalize_allocation_log; scheduler.py: "max_total_num_tokens=N, chunked_prefill_size=..."
# (releases before 0.4.10 print no dtype: "KV Cache is allocated. #tokens: 367404, K size: 8.23 GB, V size: 8.23 GB")
ALLOCATED_LINE = re.compile(r"KV Cache is allocated\.(?: dtype: (\S+),)?(?: #tokens: (\d+),)? "  # 0.4.2: no #tokens
                            r"(?:K size: ([\d.]+) GB, V size: ([\d.]+) GB|KV size: ([\d.]+) GB)")
SCHEDULER_LINE = re.compile(r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+), max_prefill_tokens=(\d+), "
                            r"max_running_requests=(\d+), context_len=(\d+)")
# model_runner.py: "Init torch distributed ends. mem usage=1.96 GB", "Load weight end. ... avail mem=12.25 GB,
# mem usage=125.65 GB." (SGLang's "GB" are GiB: its get_available_gpu_memory divides by 1 << 30)
PRELOAD_LINE = re.compile(r"Init torch distributed ends\..*?mem usage=(-?[\d.]+) GB")
WEIGHTS_LINE = re.compile(r"Load weight end\..*?avail mem=(-?[\d.]+) GB, mem usage=(-?[\d.]+) GB")
WEIGHTS_LINE_04 = re.compile(r"Load weight end\..*?avail mem=(-?[\d.]+) GB\s*$", re.M)  # 0.4.2: no mem usage
POOL_END_LINE = re.compile(r"Memory pool end\. avail mem=(-?[\d.]+) GB")
BEFORE_LOAD_LINE = re.compile(r"Load weight begin\. avail mem=(-?[\d.]+) GB")
REFUSAL_LINE = re.compile(r"(Not enough memory\. Please try to increase --mem-fraction-static\.?|Loaded weights leave "
                          r"no GPU memory for the KV cache[^\n]*)")
SWA_LINE = re.compile(r"Use sliding window memory pool\. full_layer_tokens=(\d+), swa_layer_tokens=(\d+)")
NO_CPU_BUILD = ("SGLang publishes no CPU build on the package registries (its kernels, sglang-kernel, are CUDA "
                "wheels only; docs/engines.md): run it on a machine with an NVIDIA GPU, give sglang:python=PATH "
                "(an interpreter with your own SGLang CPU build), or attach with -b sglang:url=http://host:port")


def parse_sglang_log(text: str) -> dict:
    """The launch log's pool figures (the last start's: a restarted server logs again)."""
    out: dict = {}
    pools = [{"dtype": m[0], "tokens": int(m[1]) if m[1] else None,
              **({"k_gib": float(m[2]), "v_gib": float(m[3])} if m[2] else {"kv_gib": float(m[4])})}
             for m in ALLOCATED_LINE.findall(text)]
    if pools:
        out["allocated"] = pools
    found = SCHEDULER_LINE.findall(text)
    if found:
        keys = ("max_total_num_tokens", "chunked_prefill_size", "max_prefill_tokens", "max_running_requests",
                "context_len")
        out.update(zip(keys, map(int, found[-1])))
    swa = SWA_LINE.findall(text)
    if swa:
        out["full_layer_tokens"], out["swa_layer_tokens"] = map(int, swa[-1])
    return out


def startup_figures(text: str) -> dict | None:
    """The figures of ``Backend.startup_figures_from_log`` from an SGLang launch log (the last of each: TP0's where
    every rank logs; each rank's figures are its own GPU's)."""
    log = parse_sglang_log(text)
    out: dict = {}
    if pools := log.get("allocated"):
        last = pools[-1]
        out["kv_pool_bytes"] = (last.get("kv_gib") or last.get("k_gib", 0) + last.get("v_gib", 0)) * GIB
        if last["tokens"] is not None:
            out["pool_tokens"] = last["tokens"]
    if "pool_tokens" not in out and "max_total_num_tokens" in log:
        out["pool_tokens"] = log["max_total_num_tokens"]
    if weights := WEIGHTS_LINE.findall(text):
        out["weights_bytes"] = float(weights[-1][1]) * GIB
        out["avail_after_load_bytes"] = float(weights[-1][0]) * GIB
    elif weights := WEIGHTS_LINE_04.findall(text):
        out["avail_after_load_bytes"] = float(weights[-1]) * GIB
    if preload := PRELOAD_LINE.findall(text):
        out["terms"] = {"before loading": float(preload[-1]) * GIB}
    if before := BEFORE_LOAD_LINE.findall(text):  # what the fraction applies to (memory free before loading)
        out["avail_before_load_bytes"] = float(before[-1]) * GIB
    if end := POOL_END_LINE.findall(text):
        out["avail_after_pool_bytes"] = float(end[-1]) * GIB
    if refusal := REFUSAL_LINE.findall(text):
        out["refusal"] = refusal[-1].strip()
    if not out:
        return None
    wanted = (ALLOCATED_LINE, SCHEDULER_LINE, WEIGHTS_LINE, WEIGHTS_LINE_04, PRELOAD_LINE, BEFORE_LOAD_LINE,
              POOL_END_LINE, REFUSAL_LINE)
    out["lines"] = [line.strip() for line in text.splitlines() if any(p.search(line) for p in wanted)]
    return out


def _find(info: dict, key: str):
    """``key`` of /server_info, at its top level or one level down (the argument groups)."""
    if key in info:
        return info[key]
    for value in info.values():
        if isinstance(value, dict) and key in value:
            return value[key]
    return None


@dataclass(frozen=True)
class SGLangPrefixCache(PrefixCache):
    """SGLang's radix cache, emptied through /flush_cache."""

    def empty(self, backend: Backend) -> None:
        """POST /flush_cache (entrypoints/http_server.py): 400 while requests run or wait, retried briefly."""
        for _ in range(20):
            response = backend.http.post(backend.base_url + "/flush_cache")
            if response.status_code == 200:
                return
            if response.status_code != 400:
                raise EngineStartError(f"SGLang's /flush_cache answered HTTP {response.status_code}")
            time.sleep(0.1)
        raise EngineStartError("SGLang refused to flush its cache for 2 s (requests still running or waiting)")


class SGLangBackend(PrometheusPolled, Backend):
    engine = "sglang"
    default_version = "0.5.23"
    kv_rules = SGLangKV()
    #: The options this adapter reads (-b sglang:KEY=VALUE); checked by BackendConfig.parse, listed by
    #: `kvbench backends`.
    option_specs = (
        Option("engine_mode", str, "sized", "sized: the KV pool (--max-total-tokens) and --max-running-requests set by "
               "kvbench for the workload; deployed: SGLang's own (mem_fraction_static auto, its request cap)",
               choices=("sized", "deployed")),
        Option("python", str, None, "an interpreter with sglang installed", default_text="the sglang environment's"),
        Option("max_total_tokens", int, None, "KV pool in tokens (--max-total-tokens; SGLang only lowers its own)",
               default_text="sized: every sequence of the workload at full length"),
        Option("mem_fraction_static", float, None, "share of the GPU for weights + KV pool (--mem-fraction-static)",
               default_text="SGLang's own (auto, by GPU memory)", maximum=1.0),
        Option("page_size", int, None, "tokens per KV page (--page-size)", default_text="SGLang's own: 1, or its "
               "attention backend's"),
        Option("attention_backend", str, None, "--attention-backend", default_text="SGLang's choice"),
        Option("swa_full_tokens_ratio", float, None, "SWA pool / full pool tokens (--swa-full-tokens-ratio)",
               default_text="SGLang's own: 0.8"),
        Option("tp", int, 1, "GPUs to split the model over (--tp-size)"),
        Option("device", str, None, "--device; cpu also sets SGLANG_USE_CPU_ENGINE=1 (needs an SGLang CPU build)",
               default_text="SGLang's own (auto-detect)"),
        EXTRA_ARGS,
    )
    health_path = "/health"
    capabilities = Capabilities(
        prefix_cache=SGLangPrefixCache(
            switchable=True, reset="POST /flush_cache (SGLang refuses, HTTP 400, while requests run or wait)",
            report="meta_info.cached_tokens of each request's final event (prompt tokens the radix cache served)"),
        telemetry=Telemetry({"sglang:token_usage": "kv_usage", "sglang:num_running_reqs": "requests_running",
                             "sglang:num_queue_reqs": "requests_waiting",
                             "sglang:num_retracted_requests_total": "preemptions"}),
        served_model=OpenAIModelList(), step_bytes=STEP_BYTES)
    POLLED = ("sglang:kv_used_tokens", "sglang:num_used_tokens", "sglang:swa_used_tokens", "sglang:token_usage",
              "sglang:max_total_num_tokens", "sglang:num_queue_reqs", "sglang:num_running_reqs",
              "sglang:num_retracted_requests_total")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._info: dict | None = None
        self._cells: tuple[float, float] | None = None

    @classmethod
    def gpus_used(cls, options: dict) -> int:
        return int(options.get("tp") or 1)

    @classmethod
    def parallelism(cls, options: dict) -> dict[str, int]:
        """Its tensor-parallel size."""
        return {"tp": cls.gpus_used(options)}

    @classmethod
    def own_install(cls, options: dict) -> str | None:
        """python=PATH: an interpreter with the user's own SGLang (a CPU build, say): nothing installed."""
        return f"python={options['python']}" if options.get("python") else None

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        if has_nvidia_gpu():
            return Recipe("sglang", version, (
                pip_install(f"sglang=={version}"),
                InstallStep(("{python}", "-c", "import sys, torch; print('torch', torch.__version__, 'cuda', "
                             "torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else "
                             "'sglang installed a torch that sees no GPU')")),
            ), extra_key=("cuda",))
        # Nothing installable here: say why in the install log instead of pulling gigabytes of CUDA wheels.
        return Recipe("sglang", version, (InstallStep(("sh", "-c", f"echo '{NO_CPU_BUILD}' >&2; exit 1")),),
                      venv=False)

    # --- lifecycle -----------------------------------------------------------------------------
    @property
    def deployed(self) -> bool:
        return self.options.get("engine_mode", "sized") == "deployed"

    def kv_question(self, spec: ServerSpec) -> KVQuestion:
        """This server's KV as SGLang's rules see it: dtype, page size, split, backend and SWA options."""
        page = self.options.get("page_size")
        options = {"attention_backend": self.options.get("attention_backend"),
                   "swa_full_tokens_ratio": self.options.get("swa_full_tokens_ratio")}
        options = {k: v for k, v in options.items() if v is not None}
        device = self.options.get("device") or ("gpu" if has_nvidia_gpu() else "cpu")
        return KVQuestion(spec.model.geometry, self._dtype_name(spec), tp=self.gpus_used(self.options),
                          block_size=int(page) if page else None, device="cpu" if device == "cpu" else "gpu",
                          version=self.version, options=options)

    def pool_tokens(self, spec: ServerSpec) -> int:
        """Sized: every sequence of the workload at full length, in whole pages."""
        page = self.kv_rules.page_size(self.kv_question(spec))
        return spec.pool_sequences * round_up(spec.max_context, page)

    def command(self, spec: ServerSpec):
        kv = spec.kv_dtype.lower()
        python = self.options.get("python") or str(env_python(self.env_path))
        argv = [python, "-m", "sglang.launch_server", "--model-path", str(spec.model.hf_dir),
                "--served-model-name", spec.model.name, "--host", spec.host, "--port", str(spec.port),
                "--context-length", str(spec.max_context), "--enable-metrics", "--log-level", "info"]
        if kv in KV_CACHE_DTYPES:
            argv += ["--kv-cache-dtype", KV_CACHE_DTYPES[kv]]
        elif kv in MODEL_DTYPES:
            argv += ["--dtype", MODEL_DTYPES[kv]]
        elif kv != "auto":
            raise ValueError(f"SGLang has no KV dtype {spec.kv_dtype!r}; known: auto, "
                             f"{', '.join(sorted({*KV_CACHE_DTYPES, *MODEL_DTYPES}))}")
        if not self.deployed or "max_total_tokens" in self.options:
            argv += ["--max-total-tokens", str(int(self.options.get("max_total_tokens") or self.pool_tokens(spec)))]
        if not self.deployed:
            argv += ["--max-running-requests", str(spec.max_concurrency)]
        for flag, value in (("--mem-fraction-static", self.options.get("mem_fraction_static")),
                            ("--page-size", self.options.get("page_size")),
                            ("--attention-backend", self.options.get("attention_backend")),
                            ("--swa-full-tokens-ratio", self.options.get("swa_full_tokens_ratio")),
                            ("--device", self.options.get("device"))):
            if value is not None:
                argv += [flag, str(value)]
        tp = int(self.options.get("tp") or 1)
        if tp > 1:
            argv += ["--tp-size", str(tp)]
        if spec.prefix_caching is False:
            argv.append("--disable-radix-cache")
        argv += self.capabilities.step_bytes.server_args(self)  # its bytes a pass, beside the decode bound
        env = {"HF_HUB_OFFLINE": "1"}
        if self.options.get("device") == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # srt/utils/common.py is_cpu()
        return argv + extra_args(self.options), env

    def stop(self) -> list[dict]:
        self._info = self._cells = None
        return super().stop()

    def kv_dtype_name(self) -> str:
        return self._dtype_name(self.spec)

    def _dtype_name(self, spec: ServerSpec) -> str:
        kv = spec.kv_dtype.lower()
        if kv == "auto":
            return self.kv_rules.resolve_dtype(KVQuestion(spec.model.geometry, "auto"))
        return self.kv_rules.dtypes.get(kv, kv)

    def server_info(self) -> dict:
        """/server_info (SGLang 0.5.x), else the deprecated /get_server_info; {} when neither answers."""
        if self._info is None:
            for path in ("/server_info", "/get_server_info"):
                try:
                    reply = self.http.get(self.base_url + path)
                    if reply.status_code == 200 and isinstance(reply.json(), dict):
                        self._info = reply.json()
                        break
                except (httpx.HTTPError, ValueError):
                    continue
        return self._info or {}

    def reported_version(self) -> str:
        version = _find(self.server_info(), "version")
        return str(version) if version else self.version

    # --- measurement ---------------------------------------------------------------------------
    async def stream(self, client, prompt) -> RequestResult:
        body = {"input_ids": prompt.token_ids, "stream": True,
                "sampling_params": {"max_new_tokens": prompt.output_tokens, "ignore_eos": True, "temperature": 0.0}}
        seen = [0]  # completion tokens counted so far (the events carry the running total)

        def read_event(event: dict, now: float, result: RequestResult) -> None:
            if "error" in event:
                err = event["error"]
                result.error = (err.get("message") if isinstance(err, dict) else str(err)) or str(err)
                result.error = scrub(result.error)[:500]
                return
            meta = event.get("meta_info") or {}
            done = meta.get("completion_tokens")
            if done is None:  # no count: one event per token
                done = seen[0] + 1
            result.add_chunk(now, max(0, int(done) - seen[0]))
            seen[0] = max(seen[0], int(done))
            finish = meta.get("finish_reason")
            if finish is not None:
                result.prompt_tokens_reported = meta.get("prompt_tokens")
                result.output_tokens_reported = seen[0]
                result.engine_details = {"finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
                                         "cached_tokens": meta.get("cached_tokens"),
                                         "num_retractions": meta.get("num_retractions")}
                if isinstance(meta.get("cached_tokens"), int):
                    result.prompt_tokens_cached = meta["cached_tokens"]

        return await stream_sse(client, self.base_url + "/generate", body, prompt, read_event,
                                final_event="SGLang's final event (meta_info.finish_reason)")

    def _log(self) -> dict:
        return parse_sglang_log(read_log(self.server.log_path)) if self.server else {}

    def _pool_details(self, tokens: int, info: dict, log: dict, samples: dict) -> dict:
        q = self.kv_question(self.spec)
        page = _find(info, "page_size") or self.kv_rules.page_size(q)
        swa = gauge_sum(samples, "sglang:max_total_num_tokens_swa") or log.get("swa_layer_tokens")
        details = {"max_total_num_tokens": tokens, "page_size": int(page), "tp": self.gpus_used(self.options),
                   "device": q.device, "dtype": self.kv_dtype_name(), "version": self.version,
                   "mem_fraction_static": _find(info, "mem_fraction_static"),
                   "max_running_requests": _find(info, "max_running_requests") or log.get("max_running_requests"),
                   "context_length": _find(info, "context_length") or log.get("context_len"), "log": log}
        ratio = _find(info, "swa_full_tokens_ratio") or self.options.get("swa_full_tokens_ratio")
        if ratio is not None:
            details["swa_full_tokens_ratio"] = float(ratio)
        if self.options.get("attention_backend") or _find(info, "attention_backend"):
            details["attention_backend"] = self.options.get("attention_backend") or _find(info, "attention_backend")
        if swa is not None:
            details["swa_tokens"] = int(swa)
        return details

    @classmethod
    def startup_figures_from_log(cls, text: str) -> dict | None:
        return startup_figures(text)

    def startup_settings(self, spec: ServerSpec) -> dict:
        """Sized (or with max_total_tokens): --max-total-tokens caps the pool SGLang profiles (it only lowers
        it); --mem-fraction-static where given, else SGLang's auto fraction (its startup rule)."""
        options = {k: self.options[k] for k in ("mem_fraction_static", "page_size") if self.options.get(k) is not None}
        cap = None
        if not self.deployed or "max_total_tokens" in self.options:
            cap = int(self.options.get("max_total_tokens") or self.pool_tokens(spec))
        device = self.options.get("device") or ("gpu" if has_nvidia_gpu() else "cpu")
        return {"engine_options": options, "pool_tokens_cap": cap, "kv_dtype": self._dtype_name(spec),
                "device": "cpu" if device == "cpu" else "gpu"}

    def kv_pool(self) -> KVPool | None:
        info, log = self.server_info(), self._log()
        try:
            samples = self.metrics(self.http, ("sglang:max_total_num_tokens", "sglang:max_total_num_tokens_swa"))
        except httpx.HTTPError:
            samples = {}
        tokens, source = _find(info, "max_total_num_tokens"), "max_total_num_tokens (/server_info)"
        if not tokens:
            tokens, source = gauge_sum(samples, "sglang:max_total_num_tokens"), "sglang:max_total_num_tokens (/metrics)"
        if not tokens:
            tokens, source = log.get("max_total_num_tokens"), "scheduler log 'max_total_num_tokens=N'"
        if not tokens:
            return None
        tokens = int(tokens)
        details = self._pool_details(tokens, info, log, samples)
        per_token = self.kv_rules.pool_bytes_per_token(self.spec.model.geometry, self.kv_dtype_name(), details)
        return KVPool(bytes=round(tokens * per_token), tokens=tokens, details=details,
                      source=f"{source} x bytes/token (the rules: the buffers of every pool, padding page included)")

    def kv_from_samples(self, samples: dict) -> KVInUse | None:
        tokens, name = gauge_sum(samples, "sglang:kv_used_tokens"), "sglang:kv_used_tokens"
        if tokens is None:
            tokens, name = gauge_sum(samples, "sglang:num_used_tokens"), "sglang:num_used_tokens"
        if tokens is None:
            usage, total = gauge_sum(samples, "sglang:token_usage"), gauge_sum(samples, "sglang:max_total_num_tokens")
            if usage is None or not total:
                return None
            tokens, name = usage * total, "sglang:token_usage x sglang:max_total_num_tokens (usage rounded to 0.01)"
        if self._cells is None:  # bytes per token of each pool: once, not at every poll
            self._cells = self.kv_rules.cells(self.kv_question(self.spec))
        full, swa_cell = self._cells
        swa = gauge_sum(samples, "sglang:swa_used_tokens") if swa_cell else None
        tp = self.gpus_used(self.options)
        per_gpu = tokens * full + (swa or 0) * swa_cell
        source = f"{name} x bytes/token" + (" + sglang:swa_used_tokens x SWA bytes/token" if swa is not None else "")
        return KVInUse(bytes=per_gpu * tp, tokens=tokens, source=source + (f" x {tp} GPUs" if tp > 1 else ""),
                       details={"bytes_per_gpu": per_gpu, "swa_tokens": swa})

    def queue_from_samples(self, samples: dict) -> dict | None:
        waiting = gauge_sum(samples, "sglang:num_queue_reqs")
        if waiting is None:
            return None
        return {"waiting": waiting, "running": gauge_sum(samples, "sglang:num_running_reqs"),
                "preemptions": gauge_sum(samples, "sglang:num_retracted_requests_total"),
                "source": "sglang:num_queue_reqs/num_running_reqs, sglang:num_retracted_requests_total (/metrics)"}
