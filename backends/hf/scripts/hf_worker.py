"""The transformers baseline: plain ``model.generate`` behind a small HTTP server, run in the hf environment.

Static batching, no paging: requests that arrive within ``--batch-wait-ms`` of the first are generated
together as one batch; nothing joins a batch once it runs. The KV cache is a DynamicCache the worker
owns, so its bytes are read exactly from the cache tensors (numel x element_size over every layer's keys
and values) while generation runs, and, on CUDA, from the allocator as well.

``--cache-config JSON`` makes it transformers' QuantizedCache instead (what generate builds for
cache_implementation="quantized" with that cache_config: {"backend": "quanto", "nbits": 4, ...}); its bytes
are the quantised states' own tensors (packed codes, scales, shifts) plus the residual keys and values.
A request may ask for ``top_logprobs`` (k <= 20): the done event then carries the generated ids and, per
position, the top k of log_softmax over the model's raw logits (before generate's logits processors).

Endpoints: GET /health, GET /info, GET /kv[?reset=1], POST /generate (SSE stream).
Standard library only besides torch and transformers, so the engine's environment stays minimal.
"""
from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache
from transformers.generation.streamers import BaseStreamer

# transformers 5.24 renamed generate's past_key_values to cache (the old name warns until 5.40).
_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])
CACHE_KWARG = "cache" if _VERSION >= (5, 24) else "past_key_values"


TOP_LOGPROBS_MAX = 20


def tensor_bytes(t) -> int:
    """Bytes a tensor holds: a tensor subclass (quanto's WeightQBitsTensor, PackedTensor) by its inner tensors."""
    if t is None:
        return 0
    if isinstance(t, (tuple, list)):  # (codes, scale) pairs of other quantised layers
        return sum(tensor_bytes(x) for x in t)
    if not isinstance(t, torch.Tensor):
        return 0
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def cache_bytes(cache) -> tuple[int, int]:
    """(bytes, longest cached sequence length) of a cache, summed over its K and V tensors (a quantised
    layer's quantised states and its residual keys and values)."""
    if cache is None:
        return 0, 0
    total, seq = 0, 0
    if hasattr(cache, "layers") and any(hasattr(layer, "_quantized_keys") for layer in cache.layers):
        for layer in cache.layers:
            total += tensor_bytes(getattr(layer, "_quantized_keys", None))
            total += tensor_bytes(getattr(layer, "_quantized_values", None))
            total += tensor_bytes(getattr(layer, "keys", None)) + tensor_bytes(getattr(layer, "values", None))
            seq = max(seq, int(getattr(layer, "cumulative_length", 0)))
        return total, seq
    if hasattr(cache, "layers"):  # transformers >= 4.56
        tensors = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    else:  # <= 4.53
        tensors = [*cache.key_cache, *cache.value_cache]
    for t in tensors:
        if t is not None and t.numel():
            total += t.numel() * t.element_size()
            seq = max(seq, t.shape[-2])
    return total, seq


class Job:
    def __init__(self, token_ids: list[int], max_new_tokens: int, ignore_eos: bool, top_logprobs: int = 0):
        self.token_ids, self.max_new_tokens, self.ignore_eos = token_ids, max_new_tokens, ignore_eos
        self.top_logprobs = top_logprobs
        self.events: queue.Queue = queue.Queue()
        self.generated = 0


class RowStreamer(BaseStreamer):
    """Pushes each new token of every row to its job's queue as generate produces it."""

    def __init__(self, jobs: list[Job]):
        self.jobs, self.prompt_seen = jobs, False

    def put(self, value):
        if not self.prompt_seen:  # generate first "puts" the prompt itself
            self.prompt_seen = True
            return
        now = time.time()
        for job, token in zip(self.jobs, value.reshape(len(self.jobs), -1)[:, -1].tolist()):
            if job.generated < job.max_new_tokens:
                job.generated += 1
                job.events.put({"token_ids": [token], "worker_time": now})

    def end(self):
        pass


def _gpus() -> range:
    return range(torch.cuda.device_count())


def _sync():
    for i in _gpus():
        torch.cuda.synchronize(i)


def _allocated() -> int:
    """The CUDA allocator's live bytes over every GPU (device_map may spread the model and its cache)."""
    return sum(torch.cuda.memory_allocated(i) for i in _gpus())


def _reserved() -> int:
    return sum(torch.cuda.memory_reserved(i) for i in _gpus())


def _max_allocated() -> int:
    return sum(torch.cuda.max_memory_allocated(i) for i in _gpus())


def _reset_peaks():
    for i in _gpus():
        torch.cuda.reset_peak_memory_stats(i)


class Worker:
    def __init__(self, model_dir: str, dtype: str, max_batch: int, batch_wait_ms: float, device_map: str = "",
                 cache_config: dict | None = None):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        if device_map:  # e.g. "auto": accelerate spreads the layers over every GPU; inputs go to the first
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype, device_map=device_map).eval()
            self.input_device = self.model.get_input_embeddings().weight.device
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
            self.input_device = torch.device(self.device)
        self.devices = sorted({str(p.device) for p in self.model.parameters()})
        self.weights_bytes = sum(t.numel() * t.element_size()
                                 for t in [*self.model.parameters(), *self.model.buffers()])
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_ms / 1000
        self.cache_config = dict(cache_config or {})
        if self.cache_config:
            self.new_cache()  # refused settings fail at start, not in a cell
            self.warm_quantizer()
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.cache = None  # the live cache, read by /kv from the HTTP threads
        self.peak_bytes = 0
        self.peak_tokens = 0
        # CUDA only (None on CPU): the allocator's view, per cell (the highest of the cell's generate calls).
        self.allocator_peak_delta = None  # memory_allocated after generate - before: the cache alone
        self.allocator_generate_peak = None  # max_memory_allocated during generate - before: cache + activations
        self.allocator_reserved_delta = None  # memory_reserved after generate - before: what NVML can see grow
        threading.Thread(target=self.loop, daemon=True).start()

    def new_cache(self):
        """A fresh cache per generate call: a DynamicCache, or the QuantizedCache generate would build for
        cache_implementation="quantized" with this cache_config (generation/utils.py)."""
        if not self.cache_config:
            return DynamicCache(config=self.model.config)
        config = dict(self.cache_config)
        backend = config.pop("backend", "quanto")
        return QuantizedCache(backend=backend, config=self.model.config.get_text_config(decoder=True), **config)

    def warm_quantizer(self):
        """One quantise/dequantise round trip before serving: optimum-quanto builds its C++ unpack extension
        (torch cpp_extension, ninja) on first use, once per environment, which must not land in a cell."""
        cache = self.new_cache()
        layer = cache.layers[0]
        shape = (1, 1, 2 * layer.residual_length, 64)
        states = torch.randn(shape, dtype=self.dtype, device=self.input_device)
        layer.update(states, states)
        layer.update(states[:, :, :1], states[:, :, :1])  # dequantises the first update's states

    def kv_state(self) -> dict:
        live_bytes, live_seq = cache_bytes(self.cache)
        return {"kv_bytes_in_use": live_bytes, "kv_seq_len": live_seq, "kv_bytes_peak": self.peak_bytes,
                "kv_tokens_peak": self.peak_tokens, "allocator_kv_bytes_peak": self.allocator_peak_delta,
                "allocator_generate_peak_bytes": self.allocator_generate_peak,
                "allocator_reserved_delta_bytes": self.allocator_reserved_delta,
                "allocator_allocated_bytes": _allocated() if self.device == "cuda" else None,
                "allocator_reserved_bytes": _reserved() if self.device == "cuda" else None,
                "device": self.device}

    def reset_peak(self):
        self.peak_bytes, self.peak_tokens, self.allocator_peak_delta = 0, 0, None
        self.allocator_generate_peak = self.allocator_reserved_delta = None

    def loop(self):
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                self.generate(batch)
            except Exception as exc:  # report to every waiting client, keep serving
                for job in batch:
                    job.events.put({"error": f"{type(exc).__name__}: {exc}"})

    def generate(self, batch: list[Job]):
        width = max(len(j.token_ids) for j in batch)
        pad = self.model.config.pad_token_id
        pad = pad if pad is not None else (self.model.generation_config.eos_token_id or 0)
        pad = pad[0] if isinstance(pad, list) else pad
        # Left padding keeps every row's last prompt token at the end (cells use one length: no padding).
        ids = torch.tensor([[pad] * (width - len(j.token_ids)) + j.token_ids for j in batch], device=self.input_device)
        mask = torch.tensor([[0] * (width - len(j.token_ids)) + [1] * len(j.token_ids) for j in batch],
                            device=self.input_device)
        new_tokens = max(j.max_new_tokens for j in batch)
        cuda = self.device == "cuda"
        if cuda:
            _sync()
            allocated_before = _allocated()
            reserved_before = _reserved()
            _reset_peaks()  # max_memory_allocated now covers this generate call only
        self.cache = self.new_cache()
        top_k = max(j.top_logprobs for j in batch)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens if all(j.ignore_eos for j in batch) else 0,
                                      do_sample=False, streamer=RowStreamer(batch), pad_token_id=pad,
                                      output_logits=bool(top_k), return_dict_in_generate=bool(top_k),
                                      **{CACHE_KWARG: self.cache})
        tops = self.top_logprobs(out, batch, width) if top_k else None
        live_bytes, live_seq = cache_bytes(self.cache)
        if cuda:
            _sync()
            # The cache is the only allocation still alive from this generate call.
            delta = _allocated() - allocated_before
            self.allocator_peak_delta = max(self.allocator_peak_delta or 0, delta)
            peak = _max_allocated() - allocated_before  # summed over devices: exact on one GPU
            self.allocator_generate_peak = max(self.allocator_generate_peak or 0, peak)
            grown = _reserved() - reserved_before
            self.allocator_reserved_delta = max(self.allocator_reserved_delta or 0, grown)
        self.peak_bytes = max(self.peak_bytes, live_bytes)
        self.peak_tokens = max(self.peak_tokens, live_seq * len(batch))
        for row, job in enumerate(batch):
            done = {"done": True, "usage": {"prompt_tokens": len(job.token_ids), "completion_tokens": job.generated},
                    "kv": {"cache_bytes": live_bytes, "cache_seq_len": live_seq, "batch_size": len(batch)}}
            if tops is not None and job.top_logprobs:
                done["output_ids"], done["top_logprobs"] = tops[row]
            job.events.put(done)
        self.cache = None

    @classmethod
    def top_logprobs(cls, out, batch: list[Job], width: int) -> list[tuple[list[int], list[list]]]:
        """Per row: its generated ids and, per position, its top k [[id, logprob], ...]."""
        return [cls.top_logprobs_of(out, row, width, job.max_new_tokens, job.top_logprobs)
                for row, job in enumerate(batch)]

    @staticmethod
    def top_logprobs_of(out, row: int, width: int, new: int, k: int) -> tuple[list[int], list[list]]:
        """One row of a generate output (``output_logits``, ``return_dict_in_generate``): its ``new`` generated
        ids and, per position, the top ``k`` [[id, logprob], ...] of log_softmax (fp32) over the raw logits
        (before generate's logits processors: min_new_tokens masks the EOS id there, not here)."""
        n = min(new, len(out.logits))
        ids = out.sequences[row, width:width + n].tolist()
        if not k:
            return ids, []
        logprobs = torch.log_softmax(torch.stack([step[row] for step in out.logits[:n]]).float(), dim=-1)
        values, top = torch.topk(logprobs, k=k, dim=-1)
        return ids, [[[int(i), float(v)] for i, v in zip(top[p].tolist(), values[p].tolist())] for p in range(n)]


def make_handler(worker: Worker):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # keep the engine log for errors only
            pass

        def send_json(self, status: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            url = urlparse(self.path)
            if url.path == "/health":
                self.send_json(200, {"status": "ok"})
            elif url.path == "/info":
                self.send_json(200, {"engine": "transformers", "version": transformers.__version__,
                                     "torch": torch.__version__, "device": worker.device,
                                     "dtype": str(worker.dtype).removeprefix("torch."),
                                     "max_batch": worker.max_batch, "weights_bytes": worker.weights_bytes,
                                     "cache_config": worker.cache_config or None,
                                     "devices": worker.devices})
            elif url.path == "/kv":
                state = worker.kv_state()
                if parse_qs(url.query).get("reset"):
                    worker.reset_peak()
                self.send_json(200, state)
            else:
                self.send_json(404, {"error": f"no route {url.path}"})

        def do_POST(self):
            if self.path != "/generate":
                return self.send_json(404, {"error": f"no route {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                job = Job([int(t) for t in body["prompt_token_ids"]], int(body["max_new_tokens"]),
                          bool(body.get("ignore_eos", True)),
                          min(TOP_LOGPROBS_MAX, max(0, int(body.get("top_logprobs") or 0))))
            except (ValueError, KeyError, TypeError) as exc:
                return self.send_json(400, {"error": f"bad request: {exc}"})
            if not job.token_ids or job.max_new_tokens <= 0:
                return self.send_json(400, {"error": "prompt_token_ids must be non-empty, max_new_tokens > 0"})
            worker.jobs.put(job)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            while True:
                event = job.events.get()
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
                if "done" in event or "error" in event:
                    break
            self.close_connection = True

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument("--batch-wait-ms", type=float, default=200)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device-map", default="", help="from_pretrained's device_map, e.g. auto (several GPUs)")
    parser.add_argument("--cache-config", default="", help='QuantizedCache settings as JSON, e.g. '
                        '{"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 128}')
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    worker = Worker(args.model, args.dtype, args.max_batch, args.batch_wait_ms, args.device_map,
                    json.loads(args.cache_config) if args.cache_config else None)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(worker))
    print(f"hf worker ready on {args.host}:{args.port} device={worker.device} "
          f"transformers={transformers.__version__} torch={torch.__version__} "
          f"cache={json.dumps(worker.cache_config) if worker.cache_config else 'DynamicCache'}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
