"""A fake SGLang server (0.5.23 wire format), and a stand-in for ``python -m sglang.launch_server``.

Sources (sgl-project/sglang, python/sglang as the 0.5.23 wheel ships it):
- srt/entrypoints/http_server.py: ``/health`` and ``/health_generate`` (200, empty body); ``/model_info`` and the
  deprecated ``/get_model_info``; ``/server_info`` (the resolved server args, the scheduler's init info
  ``status``/``max_total_num_tokens``/``max_req_input_len``/``startup_time``, ``internal_states``, ``version``,
  ``frontend``) and the deprecated ``/get_server_info``; ``/flush_cache`` (GET or POST, its plain-text answer);
  ``/generate``: the body checked against api/v1/api_types.py GenerateRequest first (unknown top-level keys
  ignored, unknown ``sampling_params`` keys a 400 ``{"error": "unknown field `x`, expected one of ..."}``), then
  with ``stream`` one ``data: {...}`` event per step and ``data: [DONE]``, an error inside the stream one
  ``data: {"error": {"message", "type": "invalid_request_error", "code": 400, "retryable": false}}`` event
  (serve_generate_request).
- srt/managers/tokenizer_manager.py: the event's ``text`` (cumulative), ``output_ids`` (cumulative: the
  default, not --incremental-streaming-output) and ``meta_info`` {id, finish_reason, prompt_tokens,
  weight_version, num_retractions, reasoning_tokens, completion_tokens, cached_tokens}; finish_reason None
  until the last, then ``{"type": "length", "length": n}`` or ``{"type": "stop", "matched": id}``
  (managers/schedule_batch.py FINISH_LENGTH / FINISH_MATCHED_TOKEN); the length checks' messages
  (_validate_one_request: "The input (N tokens) is longer than the model's context length (C tokens)." and
  "Requested token count exceeds ...").
- srt/entrypoints/openai/serving_completions.py + protocol.py: ``/v1/completions`` stream chunks
  (CompletionStreamResponse: id, object, created, model, choices [index, text, logprobs, finish_reason,
  matched_stop], usage null) and the final usage chunk (exclude_none: choices [], usage {prompt_tokens,
  total_tokens, completion_tokens, reasoning_tokens}); ``/v1/models`` (ModelCard: owned_by "sglang", root,
  max_model_len).
- srt/observability/metrics_collector.py: the ``sglang:`` gauges (num_running_reqs, num_queue_reqs, token_usage
  rounded to 0.01, num_used_tokens, kv_used_tokens, kv_available_tokens, kv_evictable_tokens,
  max_total_num_tokens, swa_*) and the counter num_retracted_requests_total, labelled model_name,
  engine_type "unified", tp_rank, pp_rank, moe_ep_rank; written here by prometheus_client, as SGLang does.
  The counter cuda_graph_passes_total by mode (prefill_none once a request's prefill, decode_none once a decode
  pass) and, with --enable-mfu-metrics, estimated_read/write_bytes_per_gpu_total by SGLang's own formulas
  (managers/scheduler_components/metrics_reporter.py _init_estimated_perf_constants, _estimate_prefill_perf,
  _estimate_decode_perf) on the model's config.json; the fake decodes each request on its own, so a decode pass
  (SGLang's batch) is counted as a run of tokens of distinct requests.
- srt/mem_cache/memory_pool.py _finalize_allocation_log, managers/scheduler.py, model_runner.py: the launch
  log's ``KV Cache is allocated. dtype: torch.bfloat16, #tokens: N, K size: X GB, V size: Y GB`` (GiB, buffers
  of N + page_size rows), ``max_total_num_tokens=N, chunked_prefill_size=...`` and "The server is fired up and
  ready to roll!".

Radix cache: a finished request's tokens stay in the pool as evictable (kv_evictable_tokens), not in use.
The fake tokenizer counts words. Knobs (attributes, or FAKE_SGLANG_* environment variables for the stand-in):
``pool_tokens``, ``token_delay_s``, ``eos_after``, ``cut_after``, ``batch_slots``, ``stream_interval``;
FAKE_SGLANG_BYTES_PER_TOKEN sizes the stand-in's K/V log line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tests.fakes._http import FakeServer, Handler, count_words

VERSION = "0.5.23"
DEFAULT_POOL_TOKENS = 65_536
# api/v1/api_types.py SamplingParams, in declaration order (decode_SamplingParams rejects any other key)
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                   "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                   "custom_params", "beam_width", "watermark", "choice")
EOS_ID = 2
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. "
           "(When there are running or waiting requests, the operation will not be performed.)\n")


def _log_ts(tp: bool = True) -> str:
    return f"[{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}{' TP0' if tp else ''}]"


def unknown_field(key: str) -> str:
    """serde's unknown_field text, as api_types.py _unknown_field writes it."""
    return f"unknown field `{key}`, expected one of " + ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)


class SGLangHandler(Handler):
    def do_GET(self):
        fake: FakeSGLang = self.server.fake
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/health_generate"):
            self.send_bytes(200, b"", "text/plain")
        elif path in ("/server_info", "/get_server_info") and (path == "/get_server_info" or fake.new_info_routes):
            self.send_json(200, fake.server_info())
        elif path in ("/model_info", "/get_model_info"):
            self.send_json(200, fake.model_info())
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{
                "id": fake.served_model_name, "object": "model", "created": int(fake.started), "owned_by": "sglang",
                "root": fake.model_path, "parent": None, "max_model_len": fake.context_length}]})
        elif path == "/metrics":
            self.send_bytes(200, fake.metrics(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/flush_cache":
            self.send_text(200, fake.flush())
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self):
        fake: FakeSGLang = self.server.fake
        path = self.path.split("?", 1)[0]
        if path == "/flush_cache":
            return self.send_text(200, fake.flush())
        if path not in ("/generate", "/v1/completions"):
            return self.send_json(404, {"detail": "Not Found"})
        try:
            body = self.read_json()
        except ValueError:
            return self.send_json(400, {"error": "expected value at line 1 column 1"})
        fake.last_request = body
        if path == "/v1/completions":
            return self._completions(fake, body)
        params = body.get("sampling_params") or {}
        bad = next((k for k in params if k not in SAMPLING_FIELDS), None) if isinstance(params, dict) else None
        if bad is not None:  # generate_contract_error: a 400 before anything is generated
            return self.send_json(400, {"error": unknown_field(bad)})
        ids = body.get("input_ids")
        n_in = len(ids) if ids is not None else count_words(body["text"]) if body.get("text") else 0
        max_new = params.get("max_new_tokens", 128)
        error = fake.validate(body, n_in, max_new)
        if not body.get("stream"):
            if error:
                return self.send_json(400, {"error": {"message": error, "type": "invalid_request_error", "code": 400}})
            out = None
            for out in fake.generate(n_in, max_new, params):
                pass
            return self.send_json(200, out)
        self.start_stream("text/event-stream")
        if error:
            self._event({"error": {"message": error, "type": "invalid_request_error", "code": 400, "retryable": False}})
        else:
            events = fake.generate(n_in, max_new, params)
            for i, out in enumerate(events, 1):
                self._event(out)
                if fake.cut_after is not None and i >= fake.cut_after:
                    events.close()  # the request aborted: its tokens go back to the pool
                    return self.cut()
        self.chunk(b"data: [DONE]\n\n")
        self.end_stream()

    def _event(self, obj) -> None:
        self.chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    def _completions(self, fake: "FakeSGLang", body: dict) -> None:
        prompt = body.get("prompt")
        n_in = len(prompt) if isinstance(prompt, list) else count_words(prompt or "")
        max_new = body.get("max_tokens", 16)
        params = {"max_new_tokens": max_new, "ignore_eos": bool(body.get("ignore_eos"))}
        error = fake.validate(body, n_in, max_new)
        if error:
            return self.send_json(400, {"object": "error", "message": error, "type": "BadRequestError",
                                        "param": None, "code": 400})
        rid, created, model = uuid.uuid4().hex, int(time.time()), body.get("model", "default")
        if not body.get("stream"):
            out = None
            for out in fake.generate(n_in, max_new, params):
                pass
            meta = out["meta_info"]
            return self.send_json(200, {
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": out["text"], "logprobs": None,
                             "finish_reason": meta["finish_reason"]["type"], "matched_stop": None}],
                "usage": {"prompt_tokens": n_in, "total_tokens": n_in + meta["completion_tokens"],
                          "completion_tokens": meta["completion_tokens"], "reasoning_tokens": 0}})
        self.start_stream("text/event-stream")
        text_sent = 0
        for out in fake.generate(n_in, max_new, params):
            finish = out["meta_info"]["finish_reason"]
            self._event({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [{
                "index": 0, "text": out["text"][text_sent:], "logprobs": None,
                "finish_reason": finish["type"] if finish else None,
                "matched_stop": finish.get("matched") if finish else None}], "usage": None})
            text_sent = len(out["text"])
            last = out
        if (body.get("stream_options") or {}).get("include_usage"):
            done = last["meta_info"]["completion_tokens"]
            self._event({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                         "usage": {"prompt_tokens": n_in, "total_tokens": n_in + done, "completion_tokens": done,
                                   "reasoning_tokens": 0}})
        self.chunk(b"data: [DONE]\n\n")
        self.end_stream()


class FakeSGLang(FakeServer):
    handler = SGLangHandler

    def __init__(self, host="127.0.0.1", port=0, model_path="/data/model", served_model_name=None,
                 context_length=4096, pool_tokens=DEFAULT_POOL_TOKENS, page_size=1, max_running_requests=None,
                 token_delay_s=0.002, eos_after=None, cut_after=None, batch_slots=None, swa_tokens=None,
                 server_args=None, stream_interval=1, mfu=None):
        super().__init__(host, port)
        self.model_path, self.served_model_name = model_path, served_model_name or model_path
        self.context_length, self.pool_tokens, self.page_size = context_length, pool_tokens, page_size
        self.max_running_requests = max_running_requests or 2048
        self.token_delay_s, self.eos_after, self.cut_after = token_delay_s, eos_after, cut_after
        self.batch_slots = batch_slots
        self.swa_tokens = swa_tokens
        self.stream_interval = stream_interval  # --stream-interval: an event every this many tokens, and the last
        self.server_args = dict(server_args or {})
        self.new_info_routes = True  # False: an SGLang before /server_info (only /get_server_info)
        self.started = time.time()
        self.last_request: dict | None = None
        self.running = self.queued = self.used = self.evictable = self.retracted = self.flushes = 0
        self.peak_used = self.peak_queued = 0
        self.cond = threading.Condition(self.lock)
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
        self.gauges = {name: Gauge(f"sglang:{name}", doc, labels, registry=self.registry) for name, doc in (
            ("num_running_reqs", "The number of running requests."),
            ("num_queue_reqs", "The number of requests in the waiting queue."),
            ("token_usage", "The token usage."),
            ("full_token_usage", "The token usage for full attention layers."),
            ("num_used_tokens", "The number of used tokens."),
            ("kv_available_tokens", "Number of free token slots in the KV cache pool."),
            ("kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool."),
            ("kv_used_tokens", "Number of actively used token slots in the KV cache pool."),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."))}
        if swa_tokens is not None:
            for name, doc in (("swa_used_tokens", "Number of actively used token slots in the SWA pool."),
                              ("max_total_num_tokens_swa", "Maximum total number of tokens in the SWA KV cache pool.")):
                self.gauges[name] = Gauge(f"sglang:{name}", doc, labels, registry=self.registry)
        self.retractions = Counter("sglang:num_retracted_requests", "Total number of retracted requests.", labels,
                                   registry=self.registry)
        self.label_values = (self.served_model_name, "unified", "0", "0", "0")
        self.retractions.labels(*self.label_values)
        self.passes = Counter("sglang:cuda_graph_passes", "Total number of forward passes categorized by CUDA graph.",
                              (*labels, "mode"), registry=self.registry)
        doc = "Estimated number of bytes {} memory per GPU (for Model FLOPs Utilization calculations)."
        self.read_bytes = Counter("sglang:estimated_read_bytes_per_gpu", doc.format("read from"), labels,
                                  registry=self.registry)
        self.write_bytes = Counter("sglang:estimated_write_bytes_per_gpu", doc.format("written to"), labels,
                                   registry=self.registry)
        self.mfu = mfu  # SGLang's per-token constants (mfu_constants), None: --enable-mfu-metrics not given
        self.pass_members: set[str] = set()  # the requests with a token in the open decode pass

    # --- the native API -------------------------------------------------------------------------
    def server_info(self) -> dict:
        args = {"model_path": self.model_path, "served_model_name": self.served_model_name, "host": self.host,
                "port": self.port, "context_length": self.context_length, "page_size": self.page_size,
                "mem_fraction_static": 0.83, "max_running_requests": self.max_running_requests,
                "max_total_tokens": None, "kv_cache_dtype": "auto", "dtype": "auto", "tp_size": 1,
                "swa_full_tokens_ratio": 0.8, "disable_radix_cache": False, "enable_metrics": True,
                "chunked_prefill_size": 2048, "attention_backend": "triton", **self.server_args}
        return {**args, "enable_dp_attention": False, "launch_command": f"python -m sglang.launch_server "
                f"--model-path {self.model_path}", "status": "ready", "max_total_num_tokens": self.pool_tokens,
                "max_req_input_len": self.context_length - 1, "startup_time": self.started,
                "hicache_object_layout": None, "kv_events": None, "internal_states": [{
                    "last_gen_throughput": 0.0, "memory_usage": {"weight": 0.26, "kvcache": 1.4, "token_capacity":
                                                                 self.pool_tokens}}],
                "version": VERSION, "frontend": "python"}

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "served_model_name": self.served_model_name,
                "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": "default", "load_format": "auto", "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}

    def flush(self) -> str:
        with self.lock:
            self.evictable = 0
            self.flushes += 1
        return FLUSHED

    def validate(self, body: dict, n_in: int, max_new: int) -> str | None:
        if not n_in and not body.get("text") and body.get("input_ids") is None and body.get("prompt") is None:
            return "At least one of text, input_ids, image, video, or audio should be provided"
        if n_in >= self.context_length:
            return (f"The input ({n_in} tokens) is longer than the model's context length "
                    f"({self.context_length} tokens).")
        if max_new is not None and n_in + max_new > self.context_length:
            return (f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                    f"tokens. You requested a total of {n_in + max_new} tokens: {n_in} tokens from the input "
                    f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in the "
                    f"input messages or the completion to fit within the limit.")
        return None

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def generate(self, n_in: int, max_new: int, params: dict):
        """The request's events; it waits in the queue until a running slot and the pool's pages are free."""
        reserve = self._pages(n_in + max_new)
        with self.cond:
            self.queued += 1
            self.peak_queued = max(self.peak_queued, self.queued)
            while (self.running >= min(self.max_running_requests, self.batch_slots or 10**9)
                   or self.used + reserve > self.pool_tokens):
                self.cond.wait(0.05)
            self.queued -= 1
            self.running += 1
            self.evictable = max(0, min(self.evictable, self.pool_tokens - self.used - reserve))
            self.used += self._pages(n_in)
            self.peak_used = max(self.peak_used, self.used)
        self._count_pass("prefill_none", n_in * (self.mfu["weights"] + self.mfu["act"] + self.mfu["attn_act"])
                         if self.mfu else 0.0, n_in)
        held = self._pages(n_in)
        rid = uuid.uuid4().hex
        ignore_eos = bool(params.get("ignore_eos"))
        n_out = max_new if ignore_eos or self.eos_after is None else min(max_new, self.eos_after)
        ids: list[int] = []
        try:
            for i in range(1, n_out + 1):
                time.sleep(self.token_delay_s)
                eos = not ignore_eos and self.eos_after is not None and i == self.eos_after
                ids.append(EOS_ID if eos else 1000 + i)
                grown = self._pages(n_in + i)
                if i > 1:  # the first token came of the prefill pass
                    self._count_pass("decode_none", self.mfu and self.mfu["weights"] + self.mfu["act"]
                                     + self.mfu["q"] + (n_in + i - 1) * self.mfu["kv"], 1, rid)
                with self.lock:  # the new token's page
                    self.used += grown - held
                    self.peak_used = max(self.peak_used, self.used)
                held = grown
                finish = None
                if eos:
                    finish = {"type": "stop", "matched": EOS_ID}
                elif i == n_out:
                    finish = {"type": "length", "length": max_new}
                if finish is None and i % self.stream_interval:
                    continue
                text = "".join(f" w{k}" for k in range(1, i + 1 - (1 if eos else 0)))
                yield {"text": text, "output_ids": list(ids), "meta_info": {
                    "id": rid, "finish_reason": finish, "prompt_tokens": n_in, "weight_version": "default",
                    "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": i, "cached_tokens": 0}}
        finally:
            with self.cond:
                self.running -= 1
                self.used -= held
                self.evictable = min(self.pool_tokens - self.used, self.evictable + held)  # radix-cached
                self.cond.notify_all()

    def _count_pass(self, mode: str, read: float, tokens: int, rid: str = "") -> None:
        """One forward pass's counters. A decode token joins the open decode pass unless its request already
        has one in it (a batch takes one token a running request), then it opens the next."""
        with self.lock:
            if mode != "decode_none" or rid in self.pass_members or not self.pass_members:
                self.passes.labels(*self.label_values, mode).inc()
                if mode == "decode_none":
                    self.pass_members = set()
            if mode == "decode_none":
                self.pass_members.add(rid)
            if self.mfu:
                self.read_bytes.labels(*self.label_values).inc(read)
                self.write_bytes.labels(*self.label_values).inc(
                    tokens * (self.mfu["kv"] + self.mfu["act"] + self.mfu["ffn_act"]))

    def metrics(self) -> bytes:
        with self.lock:
            used, running, queued, evictable = self.used, self.running, self.queued, self.evictable
        values = {"num_running_reqs": running, "num_queue_reqs": queued, "num_used_tokens": used,
                  "token_usage": round(used / self.pool_tokens, 2), "full_token_usage": used / self.pool_tokens,
                  "kv_used_tokens": used, "kv_evictable_tokens": evictable,
                  "kv_available_tokens": self.pool_tokens - used - evictable, "max_total_num_tokens": self.pool_tokens,
                  "swa_used_tokens": min(used, self.swa_tokens or 0), "max_total_num_tokens_swa": self.swa_tokens}
        for name, gauge in self.gauges.items():
            gauge.labels(*self.label_values).set(values[name])
        return generate_latest(self.registry)


def mfu_constants(model_path: str, dtype: str) -> dict | None:
    """SGLang 0.5.23's per-token bytes (_init_estimated_perf_constants) from the model's config.json, at the
    serving dtype's width; None where there is no config to read."""
    try:
        c = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    h, layers = float(c["hidden_size"]), float(c["num_hidden_layers"])
    heads, kv_heads = float(c["num_attention_heads"]), float(c.get("num_key_value_heads") or c["num_attention_heads"])
    d, inter = float(c.get("head_dim") or h / heads), float(c.get("intermediate_size") or 0)
    width = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}.get(
        dtype if dtype != "auto" else str(c.get("torch_dtype") or c.get("dtype")), 2.0)
    return {"weights": (h * d * (heads + 2 * kv_heads) + h * d * heads + 3 * h * inter) * width * layers,
            "kv": 2 * layers * kv_heads * d * width,
            "act": (2 * h + (heads + 2 * kv_heads) * d + d * heads) * width * layers,
            "ffn_act": 3 * inter * width * layers,
            "attn_act": (heads + 2 * kv_heads) * d * width * layers,
            "q": heads * d * width * layers}


def main(argv=None) -> None:
    """``python -m sglang.launch_server`` stand-in: its flags, SGLang's launch log lines, then the fake."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["-m", "sglang.launch_server"]:
        argv = argv[2:]
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--context-length", type=int)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16",
                                                                "bfloat16", "nvfp4", "fp4_mx_block16"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--attention-backend")
    p.add_argument("--swa-full-tokens-ratio", type=float)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--device")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--enable-mfu-metrics", action="store_true")
    args = p.parse_args(argv)
    env = os.environ
    page = args.page_size
    profiled = int(env.get("FAKE_SGLANG_POOL_TOKENS", 1_000_000))
    tokens = min(profiled, args.max_total_tokens or profiled) // page * page  # --max-total-tokens only lowers it
    per_token = float(env.get("FAKE_SGLANG_BYTES_PER_TOKEN", 23_040))
    kv_dtype = {"fp8_e4m3": "torch.float8_e4m3fn", "fp8_e5m2": "torch.float8_e5m2"}.get(
        args.kv_cache_dtype, "torch.float16" if args.dtype == "float16" else "torch.bfloat16")
    context = args.context_length or 8192
    fake = FakeSGLang(args.host, args.port, args.model_path, args.served_model_name, context, tokens, page,
                      args.max_running_requests, float(env.get("FAKE_SGLANG_TOKEN_DELAY_S", "0.002")),
                      server_args={"kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype, "tp_size": args.tp_size,
                                   "max_total_tokens": args.max_total_tokens,
                                   "mem_fraction_static": args.mem_fraction_static or 0.83,
                                   "disable_radix_cache": args.disable_radix_cache,
                                   "enable_mfu_metrics": args.enable_mfu_metrics},
                      mfu=mfu_constants(args.model_path, args.dtype) if args.enable_mfu_metrics else None)
    half_gib = (tokens + page) * per_token / 2 / (1 << 30)
    print(f"{_log_ts(False)} server_args=ServerArgs(model_path='{args.model_path}', host='{args.host}', "
          f"port={args.port}, context_length={args.context_length}, max_total_tokens={args.max_total_tokens}, "
          f"page_size={page}, kv_cache_dtype='{args.kv_cache_dtype}', enable_metrics={args.enable_metrics})",
          flush=True)
    print(f"{_log_ts()} Load weight end. elapsed=0.41 s, type=LlamaForCausalLM, avail mem=70.12 GB, "
          f"mem usage=0.26 GB.", flush=True)
    print(f"{_log_ts()} KV Cache is allocated. dtype: {kv_dtype}, #tokens: {tokens}, K size: {half_gib:.2f} GB, "
          f"V size: {half_gib:.2f} GB", flush=True)
    print(f"{_log_ts()} Memory pool end. avail mem=68.70 GB", flush=True)
    print(f"{_log_ts()} max_total_num_tokens={tokens}, chunked_prefill_size=2048, max_prefill_tokens=16384, "
          f"max_running_requests={fake.max_running_requests}, context_len={context}, available_gpu_mem=68.70 GB",
          flush=True)
    print(f"{_log_ts(False)} INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)",
          flush=True)
    print(f"{_log_ts(False)} The server is fired up and ready to roll!", flush=True)
    fake.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
