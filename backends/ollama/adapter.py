"""Ollama: ``ollama serve`` from PATH (kvbench installs nothing), the benchmark's GGUF imported through the
API (blob upload + ``/api/create``), requests on ``/api/generate`` (NDJSON) as raw text.

The untimed calls (model import and load, ``/api/ps``, ``/api/show``, ``/api/version``) go through the
official ``ollama`` Python client, so they parse Ollama's replies with the types Ollama's own client
uses; the timed requests stay on kvbench's streaming client (backends/streaming.py).

Ollama takes text only and has no ignore_eos: a request may stop early at EOS; ``eval_count`` says how many
tokens it generated and the runner's token contract flags the shortfall. ``prompt_eval_count`` below the
tokens sent is Ollama's silent truncation to num_ctx (reported as is; the runner flags it). The client
counts one token per non-empty ``response`` chunk: a token whose text Ollama holds back (an incomplete
UTF-8 sequence) or the EOS token arrives as no chunk, so the received count can trail ``eval_count``.

KV pool: Ollama's server log, which since v0.30 carries llama-server's ``llama_kv_cache: size = ...``
lines (older: ``msg="kv cache" device=... size="1.0 GiB"``, one decimal), of the last model load;
/api/ps (size, size_vram, context_length) goes into the details. KV in use: not measured, Ollama exposes no
live KV figure (its runner's /slots is not reachable), so ``kv_in_use`` is None.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvbench.common.envs import Recipe, kvbench_home
from kvbench.common.redact import scrub
from kvbench.kv.model_config import geometry_from_gguf_keys
from kvbench.kv.rules import KVQuestion
from kvbench.kv.units import MIB

from ..base import Backend
from ..capabilities import Capabilities, ServedModel
from ..options import Option
from ..process import read_log
from ..shared.llama_log import parse_kv_log
from ..streaming import stream_ndjson
from ..types import EngineStartError, KVInUse, KVPool, RequestResult, ServerSpec
from .kvrules import OllamaKV

# 0.12.11-0.24: time=... level=INFO source=backend.go:... msg="kv cache" device=CUDA0 size="1.0 GiB"
SLOG_KV = re.compile(r'msg="kv cache" device=(?P<device>\S+) size="(?P<value>[\d.]+) (?P<unit>B|KiB|MiB|GiB|TiB)"')
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# A model load starts here in the log; the KV lines of the last load are the ones that hold.
LOAD_MARKERS = ('msg="starting runner"', 'msg="starting llama server"', "llama_model_loader: loaded meta data")


def last_load(text: str) -> str:
    start = max((text.rfind(m) for m in LOAD_MARKERS), default=-1)
    return text[start:] if start >= 0 else text


def parse_slog_kv(text: str) -> list[dict]:
    """``msg="kv cache"`` lines (one per device), sizes as format.HumanBytes2 prints them (one decimal)."""
    return [{"device": m["device"], "bytes": round(float(m["value"]) * UNITS[m["unit"]]), "printed": f"{m['value']} {m['unit']}"}
            for m in SLOG_KV.finditer(text)]


def model_tag(spec: ServerSpec) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", spec.model.name.lower()).strip("-.") or "model"
    return f"kvbench-{name}:{spec.model.sha256[:12] if spec.model.sha256 else 'latest'}"


@dataclass(frozen=True)
class OllamaServedModel(ServedModel):
    def models(self, backend: Backend) -> list[str] | None:
        """The model the requests use: the server's own (``served_model``), or the benchmark's GGUF that
        kvbench imported under its tag (then it is the run's model by construction: its file's name)."""
        if backend.options.get("served_model"):
            return [str(backend.options["served_model"])]
        gguf = backend.spec.model.gguf_path if backend.spec else None
        return [gguf.name] if gguf is not None else None


class OllamaBackend(Backend):
    engine = "ollama"
    kv_rules = OllamaKV()
    default_version = "0.30.0"  # nominal: the ollama on PATH is what runs; /api/version says which
    #: The options this adapter reads (-b ollama:KEY=VALUE); checked by BackendConfig.parse, listed by `kvbench backends`.
    option_specs = (
        Option("binary", str, None, "path of the ollama executable", default_text="the one on PATH"),
        Option("models_dir", str, None, "OLLAMA_MODELS", default_text="$KVBENCH_HOME/ollama/models"),
        Option("flash_attention", bool, None, "OLLAMA_FLASH_ATTENTION", default_text="on for a quantised KV cache"),
        Option("debug", bool, True, "OLLAMA_DEBUG (some versions log the KV cache only at this level)"),
        Option("served_model", str, None, "use this model as it is on the server instead of importing the GGUF"),
        Option("engine_mode", str, "sized", "sized: parallel slots, context and KV type set by kvbench; deployed: "
               "Ollama's own (requests still ask num_ctx: prompts longer than its default would be cut)",
               choices=("sized", "deployed")),
    )
    accepts_token_ids = False
    forces_output_length = False  # no ignore_eos in Ollama's API
    health_path = "/api/version"
    capabilities = Capabilities(served_model=OllamaServedModel())

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = ""  # the name requests use

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        return Recipe("ollama", version, (), venv=False)  # nothing to install: `ollama` comes from PATH

    # --- lifecycle -----------------------------------------------------------------------------
    def models_dir(self) -> Path:
        return Path(self.options.get("models_dir") or kvbench_home() / "ollama" / "models")

    def command(self, spec: ServerSpec):
        binary = self.options.get("binary") or shutil.which("ollama")
        if not binary:
            raise EngineStartError("ollama not on PATH: install Ollama (https://ollama.com/download), give "
                                   "ollama:binary=/path/to/ollama, or attach to a running server with "
                                   "-b ollama:url=http://host:11434")
        if spec.model.gguf_path is None:
            raise ValueError("Ollama needs a GGUF model file")
        cache_type = self._cache_type(spec)
        flash = self.options.get("flash_attention", cache_type != "f16")  # quantised KV needs flash attention
        env = {"OLLAMA_HOST": f"{spec.host}:{spec.port}", "OLLAMA_MODELS": str(self.models_dir()),
               "OLLAMA_NUM_PARALLEL": str(spec.pool_sequences), "OLLAMA_MAX_LOADED_MODELS": "1",
               "OLLAMA_CONTEXT_LENGTH": str(spec.max_context), "OLLAMA_KV_CACHE_TYPE": cache_type,
               "OLLAMA_FLASH_ATTENTION": "1" if flash else "0", "OLLAMA_KEEP_ALIVE": "-1",
               "OLLAMA_NOPRUNE": "1"}
        if self.options.get("engine_mode", "sized") == "deployed":  # Ollama's defaults, unless asked for
            for key, option in (("OLLAMA_NUM_PARALLEL", None), ("OLLAMA_MAX_LOADED_MODELS", None),
                                ("OLLAMA_CONTEXT_LENGTH", None), ("OLLAMA_KV_CACHE_TYPE", None),
                                ("OLLAMA_FLASH_ATTENTION", "flash_attention")):
                if option is None or option not in self.options:
                    env.pop(key)
        if self.options.get("debug", True):
            env["OLLAMA_DEBUG"] = "1"  # the runner's KV lines are logged at this level by some versions
        return [str(binary), "serve"], env

    def _cache_type(self, spec: ServerSpec) -> str:
        return self.kv_rules.resolve_dtype(KVQuestion(spec.model.geometry, spec.kv_dtype))

    def start(self, spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
        super().start(spec, log_path, timeout_s)
        self._prepare_model(timeout_s)

    def attach(self, spec: ServerSpec, url: str, timeout_s: float = 30.0) -> None:
        super().attach(spec, url, timeout_s)
        self._prepare_model(max(timeout_s, 300.0))

    def client(self, timeout_s: float | None = None):
        """The official Ollama client for this server (imported here: only an Ollama run needs it), with the
        credentials and TLS settings every call to an attached server uses where the adapter has them."""
        import ollama
        return ollama.Client(host=self.base_url, timeout=timeout_s or self.untimed_timeout_s,
                             headers=self.auth_headers or None, verify=self.tls)

    def _prepare_model(self, timeout_s: float) -> None:
        """Use ``served_model`` if given, else import the benchmark's GGUF; then load it with our num_ctx."""
        import ollama
        try:
            with self.client(timeout_s) as client:
                self._import_and_load(client)
        except (ollama.ResponseError, ConnectionError, httpx.HTTPError, ValueError) as exc:
            # a ResponseError's text is Ollama's own {"error": ...} message
            status = f"HTTP {exc.status_code} " if isinstance(exc, ollama.ResponseError) else ""
            raise EngineStartError(f"ollama: preparing {self.model or 'the model'}: {status}{str(exc)[:300]}",
                                   self.log_tail()) from None

    def _import_and_load(self, client) -> None:
        import ollama
        if self.options.get("served_model"):
            self.model = str(self.options["served_model"])
        else:
            gguf = self.spec.model.gguf_path
            if gguf is None:
                raise EngineStartError("Ollama needs a GGUF model file (or ollama:served_model=NAME)")
            self.model = model_tag(self.spec)
            digest = "sha256:" + self.spec.model.sha256  # the GGUF's own digest, computed once at load
            try:  # HEAD /api/blobs: the client has no call for it; its transport raises on a 404
                client._request_raw("HEAD", f"/api/blobs/{digest}")
            except ollama.ResponseError as exc:
                if exc.status_code != 404:
                    raise
                if client.create_blob(gguf) != digest:  # uploads, under the digest it computes itself
                    raise EngineStartError(f"{Path(gguf).name} changed while kvbench read it (digest differs)")
            client.create(self.model, files={Path(gguf).name: digest}, stream=False)
        # An empty prompt loads the model (done_reason "load") with the options every request uses.
        client.generate(self.model, "", keep_alive=-1, options=self._options(0))

    def reported_version(self) -> str:
        import ollama
        try:  # the client has no version call: its transport asks /api/version with its headers and errors
            with self.client() as client:
                return client._request_raw("GET", "/api/version").json()["version"]
        except (ollama.ResponseError, ConnectionError, httpx.HTTPError, KeyError, ValueError, TypeError):
            return self.version

    def kv_dtype_name(self) -> str:
        return self._cache_type(self.spec)

    # --- measurement ---------------------------------------------------------------------------
    def _options(self, n_predict: int) -> dict:
        return {"num_ctx": self.spec.max_context, "num_predict": n_predict, "temperature": 0, "top_k": 1, "seed": 0}

    async def stream(self, client, prompt) -> RequestResult:
        body = {"model": self.model, "prompt": prompt.text, "raw": True, "stream": True, "keep_alive": -1,
                "options": self._options(prompt.output_tokens)}
        return await stream_ndjson(client, self.base_url + "/api/generate", body, prompt, self._read_event,
                                   final_event="Ollama's final object (done: true)")

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        if "error" in event:
            result.error = scrub(str(event["error"]))[:500]
            return
        result.add_chunk(now, 1 if event.get("response") else 0)
        if event.get("done"):
            result.prompt_tokens_reported = event.get("prompt_eval_count")
            result.output_tokens_reported = event.get("eval_count")
            result.engine_details = {k: event.get(k) for k in ("done_reason", "total_duration", "load_duration",
                                                                "prompt_eval_duration", "eval_duration")}

    def running_model(self) -> dict | None:
        """This model's /api/ps entry (size, size_vram, context_length, expires_at), None when it is not
        loaded; as JSON values (the client parses sizes and times)."""
        import ollama
        try:
            with self.client() as client:
                models = client.ps().models
        except (ollama.ResponseError, ConnectionError, httpx.HTTPError, ValueError):
            return None
        wanted = self.model if ":" in self.model else f"{self.model}:latest"
        found = next((m for m in models if m.name in (self.model, wanted) or m.model in (self.model, wanted)), None)
        return found.model_dump(mode="json") if found else None

    def show_geometry(self):
        """The model's KV geometry from /api/show ``model_info`` (raw GGUF keys), as Ollama sees it."""
        with self.client() as client:
            return geometry_from_gguf_keys(dict(client.show(self.model).modelinfo or {}), "/api/show model_info")

    def kv_pool(self) -> KVPool | None:
        import ollama
        details: dict = {}
        ps = self.running_model()
        if ps:
            details["api_ps"] = {k: ps.get(k) for k in ("size", "size_vram", "context_length", "expires_at")}
        try:
            details["bytes_per_token_api_show"] = self.kv_rules.bytes_per_token(
                KVQuestion(self.show_geometry(), self.kv_dtype_name()))
        except (httpx.HTTPError, ConnectionError, KeyError, ValueError, ollama.ResponseError):  # ConfigError is
            pass  # a ValueError
        text = last_load(read_log(self.server.log_path)) if self.server else ""
        caches = parse_kv_log(text)
        if caches:
            return KVPool(bytes=round(sum(c["mib"] for c in caches) * MIB),
                          tokens=max(c["cells"] * c["streams"] for c in caches),
                          source="llama_kv_cache log line (Ollama server log)", details={"caches": caches, **details})
        devices = parse_slog_kv(text)
        if devices:
            # The log gives bytes to one decimal of its unit; tokens from /api/ps: context_length per slot.
            slots = self.spec.pool_sequences if not self.attached else None
            tokens = ps["context_length"] * slots if ps and ps.get("context_length") and slots else None
            return KVPool(bytes=sum(d["bytes"] for d in devices), tokens=tokens,
                          source='msg="kv cache" log line (Ollama server log; one decimal of its unit)',
                          details={"devices": devices, **details})
        return None

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        return None  # not measured: Ollama exposes no live KV figure
