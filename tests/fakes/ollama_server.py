"""A fake Ollama server (``ollama serve``), wire format from ollama/ollama:

- docs/api.md: POST /api/generate streams NDJSON objects ``{model, created_at, response, done}``; the last
  has ``done: true``, ``done_reason``, ``total_duration``, ``load_duration``, ``prompt_eval_count``,
  ``prompt_eval_duration``, ``eval_count``, ``eval_duration`` (ns); raw mode returns no ``context``; an
  empty prompt only loads the model (``done_reason: "load"``). POST /api/create with ``files`` (file name ->
  ``sha256:<hex>``) after POST /api/blobs/sha256:<hex> (201; 400 on a digest mismatch), HEAD /api/blobs
  (200/404), GET /api/tags, POST /api/show (``model_info`` = the GGUF's keys, arrays emptied unless
  ``verbose``), GET /api/ps (``size``, ``size_vram``, ``context_length``), GET /api/version.
- server/routes.go: an unknown model is HTTP 404 ``{"error":"model \\"x\\" not found, try pulling it first"}``
  (Go's %q); /api/show answers 404 ``{"error":"model 'x' not found"}``; an error while streaming is one
  ``{"error": ...}`` line, after which the stream ends.
- Ollama's log is Go slog text (``time=... level=INFO source=... msg="..." key=value``). From v0.30 the
  GGUF runner is llama.cpp's llama-server, whose ``llama_kv_cache: size = ...`` lines appear in the same
  log; 0.12.11-0.24 print ``msg="kv cache" device=CPU size="90.0 MiB"`` (ml/backend.go BackendMemory.Log,
  sizes by format.HumanBytes2). FAKE_OLLAMA_LOG_STYLE=llamacpp (default) or slog picks the form.
- The runner sizes the cache as llama-server does: -c num_ctx x OLLAMA_NUM_PARALLEL -np OLLAMA_NUM_PARALLEL,
  one stream of num_ctx (padded to 256) cells per slot, type from OLLAMA_KV_CACHE_TYPE. A prompt longer
  than num_ctx is truncated silently (200 OK, prompt_eval_count = num_ctx).

The fake tokenizer counts words. Test knobs (attributes, or FAKE_OLLAMA_* environment variables when it
runs as the stand-in ``ollama`` executable): ``token_delay_s``, ``eos_after``, ``error_after`` (an error
line after k tokens), ``cut_after`` (close the connection after k tokens), ``log_style``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from tests.fakes._http import FakeServer, Handler, count_words

VERSION = "0.30.0"
ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
MIB = 1024 * 1024


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def human_bytes2(b: int) -> str:  # ollama format.HumanBytes2
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b} B"


def gguf_model_info(path: Path) -> dict:
    from gguf import GGUFReader
    info = {}
    for name, field in GGUFReader(str(path)).fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        info[name] = [] if isinstance(value, list) and len(value) > 5 else value
    return info


class OllamaHandler(Handler):
    def do_HEAD(self):
        fake: FakeOllama = self.server.fake
        if self.path.startswith("/api/blobs/"):
            exists = fake.blob_path(self.path.rsplit("/", 1)[1]).exists()
            return self.send_bytes(200 if exists else 404, b"", "text/plain")
        self.send_bytes(200 if self.path == "/" else 404, b"", "text/plain")

    def do_GET(self):
        fake: FakeOllama = self.server.fake
        if self.path == "/":
            self.send_text(200, "Ollama is running")
        elif self.path == "/api/version":
            self.send_json(200, {"version": VERSION})
        elif self.path == "/api/tags":
            self.send_json(200, {"models": [fake.tag(name) for name in fake.models]})
        elif self.path == "/api/ps":
            self.send_json(200, {"models": [fake.running()] if fake.loaded else []})
        else:
            self.send_text(404, "404 page not found")

    def do_POST(self):
        fake: FakeOllama = self.server.fake
        if self.path.startswith("/api/blobs/"):
            digest, data = self.path.rsplit("/", 1)[1], self.read_body()
            actual = "sha256:" + hashlib.sha256(data).hexdigest()
            if actual != digest:
                return self.send_json(400, {"error": f"digest mismatch, expected \"{digest}\", got \"{actual}\""})
            fake.blob_path(digest).parent.mkdir(parents=True, exist_ok=True)
            fake.blob_path(digest).write_bytes(data)
            return self.send_bytes(201, b"", "text/plain")
        req = self.read_json()
        if self.path == "/api/create":
            return self._create(fake, req)
        if self.path == "/api/show":
            name = fake.canonical(req.get("model", ""))
            if name not in fake.models:
                return self.send_json(404, {"error": f"model '{req.get('model')}' not found"})
            m = fake.models[name]
            return self.send_json(200, {"modelfile": f"FROM {fake.blob_path(m['digest'])}\n", "parameters": "",
                                        "template": "{{ .Prompt }}", "details": fake.details(name),
                                        "model_info": m["model_info"], "capabilities": ["completion"],
                                        "modified_at": m["modified_at"]})
        if self.path == "/api/generate":
            return self._generate(fake, req)
        self.send_text(404, "404 page not found")

    def _create(self, fake: "FakeOllama", req: dict) -> None:
        files = req.get("files") or {}
        name = fake.canonical(req.get("model", ""))
        if not files or not name:
            return self.send_json(400, {"error": "neither 'from' or 'files' was specified"})
        (fname, digest), = files.items()
        if not fake.blob_path(digest).exists():
            return self.send_json(400, {"error": f"file {fname} not found: blob {digest} does not exist"})
        fake.models[name] = {"digest": digest, "size": fake.blob_path(digest).stat().st_size,
                             "model_info": gguf_model_info(fake.blob_path(digest)), "modified_at": _now()}
        fake.log("INFO", "create.go:120", "created model", model=name)
        statuses = ["parsing GGUF", f"using existing layer {digest}", "writing manifest", "success"]
        if req.get("stream") is False:
            return self.send_json(200, {"status": "success"})
        self.start_stream("application/x-ndjson")
        for s in statuses:
            self.chunk(json.dumps({"status": s}).encode() + b"\n")
        self.end_stream()

    def _generate(self, fake: "FakeOllama", req: dict) -> None:
        name = fake.canonical(req.get("model", ""))
        if name not in fake.models:
            return self.send_json(404, {"error": f"model \"{req.get('model')}\" not found, try pulling it first"})
        options = req.get("options") or {}
        num_ctx = int(options.get("num_ctx") or fake.context_length)
        load_ns = fake.load(name, num_ctx)
        prompt = req.get("prompt") or ""
        line = {"model": req["model"], "created_at": _now()}
        if not prompt:
            return self.send_json(200, {**line, "response": "", "done": True, "done_reason": "load"})
        n_prompt = min(count_words(prompt), num_ctx)  # silent truncation, 200 OK
        num_predict = int(options.get("num_predict", -1))
        n_out = num_predict if num_predict >= 0 else 128
        if fake.eos_after is not None:
            n_out = min(n_out, fake.eos_after)
        t0 = time.perf_counter_ns()
        self.start_stream("application/x-ndjson")
        for i in range(1, n_out + 1):
            time.sleep(fake.token_delay_s)
            if fake.error_after is not None and i > fake.error_after:
                self.chunk(json.dumps({"error": "an error was encountered while running the model: "
                                                "unexpected EOF"}).encode() + b"\n")
                return self.end_stream()
            self.chunk(json.dumps({**line, "created_at": _now(), "response": f" w{i}", "done": False}).encode() + b"\n")
            if fake.cut_after is not None and i >= fake.cut_after:
                return self.cut()
        total = time.perf_counter_ns() - t0 + load_ns
        final = {**line, "created_at": _now(), "response": "", "done": True,
                 "done_reason": "stop" if fake.eos_after is not None and n_out < max(num_predict, 0) else "length",
                 "total_duration": total, "load_duration": load_ns, "prompt_eval_count": n_prompt,
                 "prompt_eval_duration": 1_000 * n_prompt, "eval_count": n_out, "eval_duration": max(total - load_ns, 1)}
        self.chunk(json.dumps(final).encode() + b"\n")
        self.end_stream()


class FakeOllama(FakeServer):
    handler = OllamaHandler

    def __init__(self, host="127.0.0.1", port=0, models_dir: str | Path = "", num_parallel=1, context_length=4096,
                 kv_cache_type="f16", flash_attention=False, log_file=None, log_style="llamacpp",
                 token_delay_s=0.002, eos_after=None, error_after=None, cut_after=None):
        super().__init__(host, port)
        self.models_dir = Path(models_dir) if models_dir else Path.home() / ".ollama" / "models"
        self.num_parallel, self.context_length = num_parallel, context_length
        self.kv_cache_type, self.flash_attention = kv_cache_type or "f16", flash_attention
        self.log_file, self.log_style = log_file or sys.stdout, log_style
        self.token_delay_s, self.eos_after, self.error_after, self.cut_after = token_delay_s, eos_after, error_after, cut_after
        self.models: dict[str, dict] = {}
        self.loaded: tuple[str, int] | None = None
        self.loaded_kv_bytes = 0

    def log(self, level: str, source: str, msg: str, **kv) -> None:
        fields = " ".join(f"{k}={json.dumps(v) if (' ' in str(v) or not str(v)) else v}" for k, v in kv.items())
        print(f"time={_now()} level={level} source={source} msg={json.dumps(msg)} {fields}".rstrip(),
              file=self.log_file, flush=True)

    def blob_path(self, digest: str) -> Path:
        return self.models_dir / "blobs" / digest.replace(":", "-")

    @staticmethod
    def canonical(name: str) -> str:
        return name if ":" in name or not name else f"{name}:latest"

    def details(self, name: str) -> dict:
        arch = self.models[name]["model_info"].get("general.architecture", "")
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                "parameter_size": "135M", "quantization_level": "Q4_1"}

    def tag(self, name: str) -> dict:
        m = self.models[name]
        return {"name": name, "model": name, "modified_at": m["modified_at"], "size": m["size"],
                "digest": m["digest"].split(":")[1], "details": self.details(name)}

    def running(self) -> dict:
        """An /api/ps entry (api/types.go ProcessModelResponse: no modified_at, unlike /api/tags)."""
        name, num_ctx = self.loaded
        size = self.models[name]["size"] + self.loaded_kv_bytes
        tag = {k: v for k, v in self.tag(name).items() if k != "modified_at"}
        return {**tag, "expires_at": "2318-01-01T00:00:00Z", "size": size, "size_vram": 0, "context_length": num_ctx}

    def load(self, name: str, num_ctx: int) -> int:
        """Start the runner for (model, num_ctx) unless it already runs; log its KV cache. Load time in ns."""
        if self.loaded == (name, num_ctx):
            return 0
        info = self.models[name]["model_info"]
        arch = info["general.architecture"]
        layers, heads = info[f"{arch}.block_count"], info[f"{arch}.attention.head_count"]
        kv_heads = info.get(f"{arch}.attention.head_count_kv", heads)
        head_k = info.get(f"{arch}.attention.key_length") or info[f"{arch}.embedding_length"] // heads
        head_v = info.get(f"{arch}.attention.value_length") or head_k
        cells = -(-num_ctx // 256) * 256  # per slot, padded to 256
        streams = self.num_parallel
        el = ELEMENT_BYTES[self.kv_cache_type]
        k_bytes = round(layers * kv_heads * head_k * el * cells * streams)
        v_bytes = round(layers * kv_heads * head_v * el * cells * streams)
        self.loaded, self.loaded_kv_bytes = (name, num_ctx), k_bytes + v_bytes
        self.log("INFO", "server.go:400", "starting runner", cmd=f"llama-server -c {num_ctx * streams} -np {streams} "
                 f"--cache-type-k {self.kv_cache_type} --cache-type-v {self.kv_cache_type}")
        if self.log_style == "slog":
            self.log("INFO", "ml/backend.go:245", "model weights", device="CPU", size=human_bytes2(self.models[name]["size"]))
            self.log("INFO", "ml/backend.go:250", "kv cache", device="CPU", size=human_bytes2(k_bytes + v_bytes))
            self.log("INFO", "ml/backend.go:261", "total memory", size=human_bytes2(self.models[name]["size"] + k_bytes + v_bytes))
        else:
            t = self.kv_cache_type
            print(f"llama_kv_cache:        CPU KV buffer size = {(k_bytes + v_bytes) / MIB:8.2f} MiB", file=self.log_file)
            print(f"llama_kv_cache: size = {(k_bytes + v_bytes) / MIB:7.2f} MiB ({cells:6d} cells, {layers:3d} layers, "
                  f"{streams:2d}/{streams} seqs), K ({t}): {k_bytes / MIB:7.2f} MiB, V ({t}): {v_bytes / MIB:7.2f} MiB",
                  file=self.log_file, flush=True)
        return 5_000_000


def main(argv=None) -> int:
    """``ollama`` stand-in: ``ollama serve`` configured by the OLLAMA_* environment variables."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print(f"ollama version is {VERSION}")
        return 0
    if argv[:1] != ["serve"]:
        print(f"Error: unknown command {argv[:1]!r} for \"ollama\" (the fake serves only)", file=sys.stderr)
        return 1
    env = os.environ
    host, _, port = env.get("OLLAMA_HOST", "127.0.0.1:11434").rpartition(":")
    fake = FakeOllama(host or "127.0.0.1", int(port), env.get("OLLAMA_MODELS", ""),
                      int(env.get("OLLAMA_NUM_PARALLEL", "1")), int(env.get("OLLAMA_CONTEXT_LENGTH", "4096")),
                      env.get("OLLAMA_KV_CACHE_TYPE", "f16"), env.get("OLLAMA_FLASH_ATTENTION", "") in ("1", "true"),
                      log_style=env.get("FAKE_OLLAMA_LOG_STYLE", "llamacpp"),
                      token_delay_s=float(env.get("FAKE_OLLAMA_TOKEN_DELAY_S", "0.002")))
    fake.log("INFO", "routes.go:1331", "server config",
             env=f"map[OLLAMA_CONTEXT_LENGTH:{fake.context_length} OLLAMA_KV_CACHE_TYPE:{fake.kv_cache_type} "
                 f"OLLAMA_MODELS:{fake.models_dir} OLLAMA_NUM_PARALLEL:{fake.num_parallel}]")
    fake.log("INFO", "routes.go:1384", f"Listening on {host}:{port} (version {VERSION})")
    fake.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
