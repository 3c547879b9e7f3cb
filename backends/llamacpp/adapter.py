"""llama.cpp: the real C++ ``llama-server`` (the program Ollama runs inside), built from source.

KV pool: llama.cpp's own ``llama_kv_cache: size = ...`` log line(s) (printed with ``-lv 4``; sliding-window
models print one per cache). KV in use: /slots, per slot the prompt tokens plus the tokens decoded so far.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from kvbench.common.envs import InstallStep, Recipe, ensure_env
from kvbench.common.hardware import cpu_flags, cpu_model, has_nvcc, has_nvidia_gpu
from kvbench.common.models import ModelFiles
from kvbench.common.redact import scrub
from kvbench.kv.rules import KVCheck, KVQuestion, KVRules
from kvbench.kv.units import MIB

from ..base import Backend, extra_args
from ..capabilities import Capabilities, KVQuantisation, PrefixCache, Telemetry
from ..options import EXTRA_ARGS, Option, speculation_options
from ..process import last_error_line, read_log
from ..prometheus import capped_get, gauge_sum, metric_samples, note_dropped
from ..shared.served_models import OpenAIModelList
from ..streaming import stream_sse
from ..types import EngineStartError, KVInUse, KVPool, RequestResult, ServerSpec
from .kvrules import EMBEDDED_CASES, FAMILY_CASE, LlamaCppKV
from .speculation import CONVERTED, DRAFT_DEFAULT, SPECULATION, drafter
from .startup_log import BUFFER_LINE, KV_LINE, parse_buffers, parse_kv_log, split_draft_log, startup_figures  # noqa: F401 (re-exported)

SCRIPTS = Path(__file__).with_name("scripts")
BUILD_SCRIPT = SCRIPTS / "build_llama_server.sh"
CONVERTER_SCRIPT = SCRIPTS / "fetch_llama_converter.sh"
CONVERT = SCRIPTS / "llamacpp_convert.py"


def converted_gguf(model: ModelFiles) -> Path:
    """Where the GGUF llama.cpp's converter makes of ``model``'s HF folder is kept (made once)."""
    from kvbench.common.envs import kvbench_home

    return kvbench_home() / "models" / model.sha256[:16] / f"{Path(model.name).name}.gguf"
_NATIVE_FLAG = '-DGGML_NATIVE="${KVBENCH_GGML_NATIVE:-ON}"'
# llama.cpp's AMX matmul (ggml-cpu/amx, compiled in wherever -march=native reaches AMX) segfaults on its first
# computation on some AMX CPUs: upstream ggml-org/llama.cpp#20824 (open), PR #26954 (the tile-data permission
# is asked for on the main thread only). Seen here on a Sapphire-Rapids-class Xeon with the embedded Q4_1 GGUF
# and the MLA family's. GCC's -mno-amx-* win over -march=native in either order, so the build keeps every
# other feature of the CPU (AVX-512 VNNI and BF16, the repacked kernels); docs/engines.md has the measurement.
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
NO_AMX_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
UPSTREAM_AMX_ISSUE = "ggml-org/llama.cpp#20824"


def native_build() -> tuple[str, str]:
    """(GGML_NATIVE, extra C/C++ flags) of this machine's build: -march=native on x86-64, AMX left out where
    the CPU has it; a portable build elsewhere."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "OFF", ""
    return "ON", NO_AMX_CFLAGS if set(AMX_FLAGS) & set(cpu_flags()) else ""

def slot_tokens_in_kv(slot: dict) -> int:
    """The tokens one /slots entry holds in the KV cache. Once it decodes, its n_prompt_tokens is the
    length of its cached token list, which grows as generated tokens are fed back (so n_decoded is not added
    on top). Before, while its prompt is processed, n_prompt_tokens already reads the tokens taken in (2,048
    at 0.2 s for a 3,000-token prompt whose prefill took a minute, polled on this machine) and only
    n_prompt_tokens_processed are in the cache: counting the former drew a KV line at its height before any
    prefill ran, and dips as slots moved between batches."""
    prompt = int(slot.get("n_prompt_tokens") or 0)
    decoded = max((int(t.get("n_decoded") or 0) for t in _as_list(slot.get("next_token"))), default=0)
    processed = slot.get("n_prompt_tokens_processed")
    if decoded or processed is None:  # decoding, or a server that does not say (the older figure)
        return prompt
    return min(prompt, int(processed))


def readable_slot_tokens(slots) -> list[int]:
    """The tokens in KV of each processing slot of a /slots answer; a slot that cannot be read (not an
    object, a count that is not a number) is dropped and counted, not the whole poll."""
    out = []
    for slot in slots if isinstance(slots, list) else []:
        try:
            if slot.get("is_processing"):
                out.append(slot_tokens_in_kv(slot))
        except (AttributeError, TypeError, ValueError):
            note_dropped("/slots", "slot not readable")
    if not isinstance(slots, list):
        note_dropped("/slots", "not a list of slots")
    return out


def _as_list(value) -> list[dict]:
    """``next_token`` is one object in some llama-server versions, a list (one per sequence) in others."""
    if isinstance(value, dict):
        return [value]
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


@dataclass(frozen=True)
class LlamaServerPrefixCache(PrefixCache):
    """llama-server's per-slot prompt cache, emptied by erasing every slot."""

    def empty(self, backend: Backend) -> None:
        slots = backend.http.get(backend.base_url + "/slots")
        slots.raise_for_status()
        for slot in slots.json():
            response = backend.http.post(backend.base_url + f"/slots/{slot['id']}", params={"action": "erase"})
            if response.status_code != 200:
                message = _error_message(response)
                raise EngineStartError(f"llama-server refused to erase slot {slot['id']}: {message}"
                                       + (" (start it with --slot-save-path DIR)" if "slot-save-path" not in message
                                          and response.status_code == 501 else ""))


class LlamaCppBackend(Backend):
    engine = "llamacpp"
    default_version = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
    #: The options this adapter reads (-b llamacpp:KEY=VALUE); checked by BackendConfig.parse, listed by `kvbench backends`.
    option_specs = (
        Option("engine_mode", str, "sized", "sized: -c and -np set by kvbench for the workload; deployed: "
               "llama-server's own context and slots, every layer on the GPU (-ngl 999)",
               choices=("sized", "deployed")),
        Option("gguf", str, None, "a GGUF file to serve instead of the model's own; 'converted': the one "
               "llama.cpp's converter makes from its HF folder (what speculative=draft serves by default)",
               default_text="the model's GGUF, or one llama.cpp's converter makes from its HF folder"),
        Option("threads", int, None, "generation threads (-t)", default_text="1 on <= 2 cores, else cores/2"),
        Option("batch_threads", int, None, "prompt-processing threads (-tb)", default_text="all cores"),
        Option("split_mode", str, None, "how several GPUs share the model (--split-mode)",
               choices=("none", "layer", "row"), default_text="llama.cpp's own: layer, over every visible GPU"),
        Option("tensor_split", str, None, "share of the model per GPU, e.g. 3/1 (-ts; llama.cpp reads / like a "
               "comma, which would end the option here)", default_text="by free memory"),
        *speculation_options(tuple(SPECULATION.methods), "llama.cpp's own (3 drafted, 48 looked up)", DRAFT_DEFAULT),
        EXTRA_ARGS,
    )
    kv_rules = LlamaCppKV()
    capabilities = Capabilities(
        prefix_cache=LlamaServerPrefixCache(
            switchable=True,
            reset=("POST /slots/N?action=erase for every slot (it needs --slot-save-path, which kvbench gives, "
                   "pointing at the run's logs folder, when it starts llama-server for --reset-cache-between-cells); "
                   "the host prompt cache (--cache-ram) is not erased by it"),
            report="timings.cache_n of each request's last event (prompt tokens reused from the slot's cache)"),
        # n_probs: the pre-sampling probabilities, a softmax over the whole vocabulary (server-context.cpp
        # populate_token_probs with post_sampling_probs false); no prompt log-probabilities (n_probs covers
        # generated tokens only)
        kv_quantisation=KVQuantisation(top_logprobs_max=20),
        telemetry=Telemetry({"llamacpp:kv_cache_usage_ratio": "kv_usage",
                             "llamacpp:requests_processing": "requests_running",
                             "llamacpp:requests_deferred": "requests_waiting"}),
        served_model=OpenAIModelList(),
        speculation=SPECULATION)

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        native, cflags = native_build()
        env = (("KVBENCH_GGML_NATIVE", native), ("KVBENCH_GGML_CFLAGS", cflags))
        # -march=native: rebuilt on a CPU of another model or other features (a model name can be generic)
        machine = (platform.machine(), cpu_model(), *cpu_flags())
        if has_nvidia_gpu() and has_nvcc():
            return cls._cuda_recipe(version, env, machine)
        return Recipe("llamacpp", version, (
            InstallStep(("bash", "-c", BUILD_SCRIPT.read_text(), "build_llama_server", version, "{env}"), env=env),),
            venv=False, extra_key=machine)

    @classmethod
    def _cuda_recipe(cls, version: str, env: tuple, machine: tuple) -> Recipe:
        """The CUDA build (a GPU and nvcc here): the same script with -DGGML_CUDA=ON (with GGML_NATIVE, for
        this machine's GPU architecture), and a CUDA_BUILD marker that tells command() to offload."""
        script = BUILD_SCRIPT.read_text()
        if script.count(_NATIVE_FLAG) != 1:
            raise RuntimeError(f"{BUILD_SCRIPT.name} no longer has one {_NATIVE_FLAG}: update the CUDA recipe")
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        from kvbench.common.hardware import detect_gpus

        return Recipe("llamacpp", version, (
            InstallStep(("bash", "-c", script.replace(_NATIVE_FLAG, "-DGGML_CUDA=ON " + _NATIVE_FLAG),
                         "build_llama_server", version, "{env}"), env=(*env, ("CUDACXX", nvcc))),
            InstallStep(("bash", "-c", 'echo "-DGGML_CUDA=ON" > "$1/CUDA_BUILD"', "mark", "{env}")),),
            venv=False, extra_key=(*machine, "cuda", *(g.name for g in detect_gpus())))

    @classmethod
    def machine_build(cls, version: str) -> str | None:
        native, cflags = native_build()
        if native == "OFF":
            return f"GGML_NATIVE=OFF (a portable build for {platform.machine()})"
        features = ", ".join(cpu_flags()) or "none of kvbench's speed flags"
        if cflags:
            return (f"GGML_NATIVE=ON (-march=native: {features}) without AMX ({cflags}): llama.cpp's AMX matmul "
                    f"crashes on such CPUs ({UPSTREAM_AMX_ISSUE})")
        return f"GGML_NATIVE=ON (-march=native: {features})"

    def start_failure_hint(self, failure: str, log_tail: str) -> str | None:
        """A llama-server that a signal ended before it was ready, classified by what its log shows."""
        log = read_log(self.server.log_path) if self.server and self.server.log_path.exists() else log_tail
        if "SIGILL" in failure:
            return ("the build uses an instruction this CPU lacks (built on another machine?): `kvbench setup -b "
                    "llamacpp` builds one for this CPU")
        if not any(sig in failure for sig in ("SIGSEGV", "SIGABRT", "SIGBUS")):
            return None
        if "AMX model buffer" in log or "AMX_INT8 = 1" in log:
            return (f"llama.cpp's AMX matmul crash ({UPSTREAM_AMX_ISSUE}): this build has AMX; kvbench's recipe "
                    f"builds without it ({NO_AMX_CFLAGS}), or add -b 'llamacpp:extra_args=--no-repack'")
        if "model buffer size" not in log:
            return "it crashed while loading the model: is the GGUF whole and of an architecture this version knows?"
        return ("it crashed on its first computation: try -b 'llamacpp:extra_args=--no-repack' (the weights as "
                "stored, no repacked kernels) or another GGUF type")

    @classmethod
    def recipes(cls, version: str) -> list[Recipe]:
        return [cls.recipe(version), cls.converter_recipe(version)]

    @classmethod
    def converter_recipe(cls, version: str) -> Recipe:
        """llama.cpp's own HF -> GGUF converter, from the sources the server is built from (Python only; it
        runs with an interpreter that has torch and transformers, the hf environment's)."""
        return Recipe("llamacpp-convert", version, (
            InstallStep(("bash", "-c", CONVERTER_SCRIPT.read_text(), "fetch_llama_converter", version, "{env}")),),
            venv=False)

    @classmethod
    def gguf_from_hf(cls, python: Path, models: list[tuple[Path, Path]], log=print,
                     version: str | None = None, outtype: str = "f16") -> list[str]:
        """Convert HF folders to GGUF files with llama.cpp's converter: per (folder, gguf) "ok" or the error."""
        env = ensure_env(cls.converter_recipe(version or cls.default_version), log=log)
        argv = [str(python), str(CONVERT), str(env / "convert"), outtype]
        for folder, gguf in models:
            argv += [str(folder), str(gguf)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"})
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return [f"the converter failed: {out.stderr.strip()[-500:]}"] * len(models)

    @classmethod
    def _pool_check(cls, env: Path, model: ModelFiles, cache_type: str, context: int, slots: int, log_dir: Path,
                    case: str, family: str = "") -> KVCheck:
        """Start llama-server for ``slots`` x ``context`` and compare its logged KV buffer with the rules."""
        q = KVQuestion(model.geometry, cache_type, context, slots)
        predicted, formula = cls.kv_rules.answer(q).bytes_per_gpu, KVRules().answer(q).bytes_per_gpu
        if model.gguf_path is None:
            return KVCheck("llamacpp", case, "KV buffer bytes", predicted, None, None, 0, family=family,
                           note="cannot load here: no GGUF file", formula=formula)
        spec = ServerSpec(model=model, max_context=context, max_concurrency=slots, kv_dtype=cache_type)
        log = log_dir / f"llamacpp-{family or model.name}-{cache_type}-{context}x{slots}.log"
        try:
            pool = cls.pool_at_start(env, spec, log, 120)
        except EngineStartError as exc:
            return KVCheck("llamacpp", case, "KV buffer bytes", predicted, None, None, 0, family=family,
                           note=f"cannot load here: {exc}: {last_error_line(exc.log_tail)}", formula=formula)
        caches = pool.details["caches"] if pool else []
        return KVCheck("llamacpp", case, "KV buffer bytes", predicted, pool.bytes if pool else None, None,
                       tolerance=(0.005 * MIB + 1) * max(1, len(caches)), family=family, formula=formula,
                       note=("log gives MiB to 2 decimals; caches: " + ", ".join(
                           f"{c['layers']} layers x {c['cells']} cells" for c in caches)) if pool else
                       "no llama_kv_cache line in the log")

    @classmethod
    def kv_checks(cls, env: Path, model: ModelFiles, log_dir: Path) -> list[KVCheck]:
        return [cls._pool_check(env, model, cache_type, context, slots, log_dir,
                                f"{cache_type}, {slots} slot(s) x {context} tokens")
                for cache_type, context, slots in EMBEDDED_CASES]

    @classmethod
    def measure_kv(cls, env: Path, models: list[ModelFiles], log_dir: Path, python: Path | None = None) -> list[KVCheck]:
        context, slots = FAMILY_CASE
        return [cls._pool_check(env, m, "f16", context, slots, log_dir, f"{slots} slots x {context} tokens, f16",
                                family=m.name) for m in models]

    def cuda_build(self) -> bool:
        return self.env_path is not None and (Path(self.env_path) / "CUDA_BUILD").exists()

    @classmethod
    def gpus_used(cls, options: dict) -> int:
        """GPUs the layers are split over: the non-zero shares of tensor_split, 1 with split_mode=none, else
        every GPU found (llama.cpp's default splits layers over all visible GPUs; 1 without one)."""
        if options.get("split_mode") == "none":
            return 1
        if options.get("tensor_split"):
            return max(1, sum(1 for x in str(options["tensor_split"]).replace("/", ",").split(",")
                              if x.strip() and float(x) > 0))
        if not has_nvidia_gpu():
            return 1
        from kvbench.common.hardware import detect_gpus

        return max(1, len(detect_gpus()))

    def served_gguf(self, model: ModelFiles) -> Path | None:
        """The GGUF the server loads, or None where llama.cpp's converter makes it from the model's HF folder:
        a model without a GGUF, ``gguf=converted``, or the default draft (the model's own GGUF is then the draft,
        a quantised copy of the target)."""
        given = self.options.get("gguf")
        default_draft = self.options.get("speculative") == "draft" and not self.options.get("draft_model")
        if given == CONVERTED or (given is None and default_draft):
            return None
        return Path(given) if given else model.gguf_path

    def gguf_for(self, model: ModelFiles, log=print) -> Path:
        """The model's GGUF: the one given, else one made once from its HF folder (a hub download) with
        llama.cpp's own converter (convert_hf_to_gguf.py of the sources the server is built from, run by the
        hf environment's interpreter), f16/bf16 as the weights are, cached beside kvbench's other models."""
        if model.gguf_path is not None:
            return model.gguf_path
        from kvbench.backends import hf_tools_python

        out = converted_gguf(model)
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        python = hf_tools_python(log)
        log(f"converting {model.name} to GGUF with llama.cpp's convert_hf_to_gguf.py into {out} (once)")
        result = self.gguf_from_hf(python, [(model.hf_dir, partial)], log=log, version=self.version, outtype="auto")
        if result != ["ok"] or not partial.exists():
            raise EngineStartError(f"llama.cpp's converter could not make a GGUF of {model.name}: {result[0]}")
        partial.rename(out)  # only a whole file has the final name
        return out

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slot_dir: Path | None = None

    def start(self, spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
        self._slot_dir = log_path.parent  # --slot-save-path must name a folder; erasing a slot writes nothing
        super().start(spec, log_path, timeout_s)

    def command(self, spec: ServerSpec):
        method, draft = drafter(self.options, spec.model)
        gguf = self.served_gguf(spec.model)
        if gguf is None:  # an HF folder (a hub id), the default draft's target, or gguf=converted
            gguf = self.gguf_for(replace(spec.model, gguf_path=None))
        deployed = self.options.get("engine_mode", "sized") == "deployed"
        cache_type = self.kv_rules.resolve_dtype(KVQuestion(spec.model.geometry, spec.kv_dtype))
        cores = os.cpu_count() or 1
        # Generation: on 2 cores -t 2 was 4-12x slower per token than -t 1 (the harness needs a core).
        # Prompt processing (-tb) uses every core: on 2 cores that nearly doubled prefill speed.
        threads = self.options.get("threads", 1 if cores <= 2 else cores // 2)
        batch_threads = self.options.get("batch_threads", cores)
        argv = [str(self.env_path / "bin" / "llama-server"), "-m", str(gguf),
                "--host", spec.host, "--port", str(spec.port)]
        if not deployed:  # deployed: llama-server's own context and slots
            # n_ctx is the total over all slots: each of the -np slots gets max_context cells.
            argv += ["-c", str(spec.max_context * spec.pool_sequences), "-np", str(spec.pool_sequences)]
        argv += ["-t", str(threads), "-tb", str(batch_threads), "--metrics", "--slots", "--no-webui",
                 "--cache-type-k", cache_type, "--cache-type-v", cache_type,
                 "-lv", "4"]  # the llama_kv_cache lines are printed at this verbosity only
        if cache_type not in ("f16", "f32", "bf16"):
            argv += ["-fa", "on"]  # quantised V cache needs flash attention
        if spec.reset_prefix_cache:  # llama-server serves slot actions (erase among them) only with a save path
            argv += ["--slot-save-path", str(self._slot_dir or Path.cwd())]
        if self.options.get("split_mode"):
            argv += ["--split-mode", str(self.options["split_mode"])]
        if self.options.get("tensor_split"):
            argv += ["-ts", str(self.options["tensor_split"])]
        argv += self.capabilities.speculation.server_args(self, method, self.options.get("speculative_tokens"),
                                                          str(draft) if draft else None)
        extra = extra_args(self.options)
        if self.cuda_build() and not {"-ngl", "--n-gpu-layers", "--gpu-layers"} & set(extra):
            argv += ["-ngl", "999"]  # every layer, and so its KV cache, on the GPU
        argv += extra
        return argv, {}

    def kv_dtype_name(self) -> str:
        return self.kv_rules.resolve_dtype(KVQuestion(self.spec.model.geometry, self.spec.kv_dtype))

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
        body = {"prompt": prompt.token_ids, "n_predict": prompt.output_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "return_tokens": True,
                # reuse of a slot's cached prompt prefix: off unless the workload switches it on
                "cache_prompt": bool(self.spec.prefix_caching)}
        if prompt.top_logprobs:
            body["n_probs"] = min(prompt.top_logprobs, self.capabilities.kv_quantisation.top_logprobs_max)
        return await stream_sse(client, self.base_url + "/completion", body, prompt, CompletionEvents())

    def kv_pool(self) -> KVPool | None:
        """The target's pool; a draft model's own KV cache (logged after it) is kept apart in the details."""
        if not self.server:
            return None
        target, draft = split_draft_log(read_log(self.server.log_path))
        pool = self.kv_pool_from_log(target)
        if pool is not None and (draft_pool := self.kv_pool_from_log(draft)):
            pool.details["draft_kv_bytes"] = draft_pool.bytes
        return pool

    @classmethod
    def startup_figures_from_log(cls, text: str) -> dict | None:
        return startup_figures(text)

    def startup_settings(self, spec: ServerSpec) -> dict:
        """Sized: -c limit x slots -np slots (the cache allocated for every slot at the limit); deployed:
        llama-server's own context and slots, which kvbench does not plan here."""
        if self.options.get("engine_mode", "sized") == "deployed":
            return {"not_planned": "deployed: llama-server's own context and slots"}
        cache_type = self.kv_dtype_name() if self.spec else self.kv_rules.resolve_dtype(
            KVQuestion(spec.model.geometry, spec.kv_dtype))
        options = {"flash_attn": True} if cache_type not in ("f16", "f32", "bf16") else {}
        gguf = self.served_gguf(spec.model) or converted_gguf(spec.model)
        return {"batch": spec.pool_sequences, "kv_dtype": cache_type, "engine_options": options,
                "model_file": str(gguf) if gguf else None, "device": "gpu" if self.cuda_build() else "cpu"}

    @classmethod
    def kv_pool_from_log(cls, text: str) -> KVPool | None:
        caches = parse_kv_log(text)
        if not caches:
            return None
        # "cells" is per stream: without a unified cache every slot has a stream of its own.
        # MiB with two decimals is all the log gives: the bytes are exact to 0.005 MiB.
        # A sliding-window model logs a second, smaller cache; the token capacity is the full-attention one.
        buffers = parse_buffers(text)
        gpu_kv = [b for dev, b in buffers["kv"].items() if not dev.upper().startswith("CPU")]
        gpu_model = [b for dev, b in buffers["model"].items() if not dev.upper().startswith("CPU")]
        weights = sum(buffers["model"].values()) or None
        return KVPool(bytes=round(sum(c["mib"] for c in caches) * MIB),
                      tokens=max(c["cells"] * c["streams"] for c in caches),
                      source="llama_kv_cache log line",
                      details={"caches": caches, "kv_buffers": buffers["kv"], "model_buffers": buffers["model"],
                               # the fullest GPU's KV buffers (layers split over GPUs: not an even share)
                               "bytes_per_gpu": max(gpu_kv) if gpu_kv else None, "weights_bytes": weights,
                               "weights_bytes_per_gpu": max(gpu_model) if gpu_model else None,
                               "weights_source": "llama.cpp log: model buffer size" if weights else None})

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        slots = capped_get(client, self.base_url + "/slots").json()
        tokens = sum(readable_slot_tokens(slots))
        return KVInUse(bytes=tokens * self.kv_bytes_per_token(), tokens=tokens,
                       source="/slots tokens in KV (prompt processed, then n_prompt_tokens) x bytes/token")

    def queue_state(self, client: httpx.Client) -> dict | None:
        """Deferred requests (no free slot) from /metrics; /slots lists slots only, so it cannot show them."""
        response = capped_get(client, self.base_url + "/metrics")
        if response.status_code != 200:  # started without --metrics
            return None
        samples = metric_samples(response.text, ("llamacpp:requests_deferred", "llamacpp:requests_processing"))
        waiting = gauge_sum(samples, "llamacpp:requests_deferred")
        if waiting is None:
            return None
        return {"waiting": waiting, "running": gauge_sum(samples, "llamacpp:requests_processing"),
                "source": "llamacpp:requests_deferred/requests_processing (/metrics)"}


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


class CompletionEvents:
    """Reads one request's /completion stream events into its result. Its tokens are counted by the running
    ``tokens_predicted`` each event carries, not by the event's ``tokens``: llama-server holds back a token
    whose text ends inside a UTF-8 character and sends its text with the next event, whose ``tokens`` names
    that last token only, and the final event of a stream has none (tools/server/server-context.cpp,
    process_token and send_final_response). Counted by ``tokens``, an output of multi-byte characters read
    as 35 of 64 tokens on an AMX machine's `make bench`. The held-back tokens' probabilities are not sent."""

    def __init__(self):
        self.predicted = 0  # the engine's count at the last event

    def __call__(self, event: dict, now: float, result: RequestResult) -> None:
        if "error" in event:
            result.error = scrub(str(event["error"]))[:500]
            return
        predicted = event.get("tokens_predicted")
        if type(predicted) is int and predicted >= self.predicted:
            result.add_chunk(now, predicted - self.predicted)
            self.predicted = predicted
        else:  # no running count: the event's own tokens
            result.add_chunk(now, len(event.get("tokens") or []))
        # ids from the event's tokens (return_tokens): with a drafter, accepted drafts come without probabilities
        result.output_ids += [t for t in event.get("tokens") or [] if type(t) is int]
        for p in event.get("completion_probabilities") or []:  # asked with n_probs
            result.top_logprobs.append({int(t["id"]): float(t["logprob"]) for t in p.get("top_logprobs") or []})
        if event.get("stop"):
            result.prompt_tokens_reported = event.get("tokens_evaluated")
            result.output_tokens_reported = event.get("tokens_predicted")
            timings = event.get("timings") or {}
            result.engine_details = {"timings": timings, "stop_type": event.get("stop_type"),
                                     "tokens_cached": event.get("tokens_cached")}
            if isinstance(timings.get("cache_n"), int):  # prompt tokens the slot's cache served
                result.prompt_tokens_cached = timings["cache_n"]
            if "draft_n" in timings:  # sent only by a server that drafted for this request
                result.spec_draft_tokens = timings["draft_n"]
                result.spec_accepted_tokens = timings.get("draft_n_accepted")
