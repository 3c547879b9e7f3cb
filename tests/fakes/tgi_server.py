"""A fake Hugging Face Text Generation Inference server (router 3.x wire format).

Sources (huggingface/text-generation-inference):
- router/src/lib.rs: ``StreamResponse {index, token, top_tokens (skipped when empty), generated_text,
  details}``, ``Token {id, text, logprob, special}``, ``StreamDetails {finish_reason, generated_tokens,
  seed, input_length}``, ``ErrorResponse {error, error_type}``, FinishReason serialised as
  ``length`` / ``eos_token`` / ``stop_sequence``, ``Info`` (model_id, ..., version, sha, docker_label).
- router/src/server.rs ``compat_generate``: POST / takes ``{inputs, parameters, stream}`` and answers as
  /generate_stream when ``stream`` is true (huggingface_hub's InferenceClient.text_generation posts there).
- router/src/server.rs ``generate_stream_internal``: /generate_stream always answers 200 with an SSE body;
  a validation, overload or generation error is one ``data:{"error":...,"error_type":...}`` event
  (``impl From<InferError> for Event``); /generate answers the same error as HTTP 422 JSON. A body that
  is not a GenerateRequest is rejected by axum's Json extractor with 422 and a plain-text message.
- router/src/validation.rs: ``Input validation error: `inputs` tokens + `max_new_tokens` must be <= N.
  Given: P `inputs` tokens and M `max_new_tokens``` and ``... `inputs` must have less than N tokens. Given: P``;
  ``max_new_tokens`` defaults to 100.
- backends/v3/src/lib.rs: log ``Setting max batch total tokens to N`` and gauge ``tgi_batch_max_total_tokens``;
  backends/v3/src/backend.rs: gauges ``tgi_batch_current_max_tokens`` (the running batch's prompt +
  max_new_tokens reservation, 0 when idle), ``tgi_batch_current_size``, ``tgi_queue_size``;
  server/text_generation_server/models/flash_causal_lm.py: shard log ``KV-cache blocks: N, size: B``.

The fake tokenizer counts words (kvbench prompts are one token per word). Knobs for tests, as attributes
(in-process) or FAKE_TGI_* environment variables (as the stand-in ``text-generation-launcher``):
``pool_tokens``, ``token_delay_s``, ``eos_after`` (emit EOS as the k-th token), ``cut_after`` (close the
connection after k token events), ``batch_slots`` (requests decoded at once; the rest queue),
``errors_as_http_422`` (answer validation errors on /generate_stream as /generate does), ``pool_gauge``
(False: no tgi_batch_max_total_tokens, as before 2.3.1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import datetime, timezone

from tests.fakes._http import FakeServer, Handler, count_words

VERSION = "3.3.5"
DEFAULT_POOL_TOKENS = 65_536


def _ts() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TGIHandler(Handler):
    def do_GET(self):
        fake: FakeTGI = self.server.fake
        if self.path == "/health":
            self.send_bytes(200, b"", "text/plain")
        elif self.path == "/info":
            fake.info_headers = dict(self.headers)
            self.send_json(200, fake.info())
        elif self.path == "/metrics":
            self.send_text(200, fake.metrics(), "text/plain; version=0.0.4")
        else:
            self.send_bytes(404, b"", "text/plain")

    def do_POST(self):
        fake: FakeTGI = self.server.fake
        if self.path not in ("/generate_stream", "/generate", "/"):
            return self.send_bytes(404, b"", "text/plain")
        raw = self.read_body()
        if self.path == "/":  # compat_generate: the body's `stream` picks the route
            try:
                self.path = "/generate_stream" if json.loads(raw).get("stream") else "/generate"
            except (ValueError, AttributeError):
                pass
        try:
            req = json.loads(raw)
            inputs = req["inputs"]
            params = req.get("parameters") or {}
        except (ValueError, KeyError, TypeError):
            return self.send_text(422, "Failed to deserialize the JSON body into the target type: missing field "
                                       "`inputs` at line 1 column %d" % len(raw))
        fake.last_request = req
        # GenerateRequest.add_special_tokens (default true): the fake's tokenizer adds one BOS token
        n_in = count_words(inputs) + (1 if req.get("add_special_tokens", True) else 0)
        max_new = params.get("max_new_tokens") or 100
        error = fake.validate(n_in, max_new)
        if error and (self.path == "/generate" or fake.errors_as_http_422):
            return self.send_json(422, {"error": error, "error_type": "validation"})
        if self.path == "/generate":
            return self.send_json(422, {"error": "kvbench's fake serves /generate_stream only", "error_type": "validation"})
        self.start_stream("text/event-stream", {"x-compute-type": "gpu+optimized", "X-Accel-Buffering": "no"})
        if error:
            self._event({"error": error, "error_type": "validation"})
            return self.end_stream()
        if not fake.admit():
            self._event({"error": "Model is overloaded", "error_type": "overloaded"})
            return self.end_stream()
        try:
            fake.wait_for_slot(n_in + max_new)
            self._generate(fake, n_in, max_new, params)
        finally:
            fake.release(n_in + max_new)

    def _event(self, obj) -> None:
        self.chunk(b"data:" + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    def _generate(self, fake: "FakeTGI", n_in: int, max_new: int, params: dict) -> None:
        n_out = max_new if fake.eos_after is None else min(max_new, fake.eos_after)
        text = []
        for i in range(1, n_out + 1):
            time.sleep(fake.token_delay_s)
            eos = fake.eos_after is not None and i == fake.eos_after
            token = {"id": 2 if eos else 1000 + i, "text": "</s>" if eos else f" w{i}", "logprob": -0.25, "special": eos}
            if not eos:
                text.append(token["text"])
            last = i == n_out
            details = None
            if last and params.get("details"):
                details = {"finish_reason": "eos_token" if eos else "length", "generated_tokens": n_out,
                           "seed": None, "input_length": n_in}
            self._event({"index": i, "token": token, "generated_text": "".join(text) if last else None,
                         "details": details})
            if fake.cut_after is not None and i >= fake.cut_after:
                return self.cut()
        self.end_stream()


class FakeTGI(FakeServer):
    handler = TGIHandler

    def __init__(self, host="127.0.0.1", port=0, model_id="/data/model", max_input_tokens=4095,
                 max_total_tokens=4096, max_concurrent_requests=128, pool_tokens=DEFAULT_POOL_TOKENS,
                 token_delay_s=0.002, eos_after=None, cut_after=None, batch_slots=None, errors_as_http_422=False):
        super().__init__(host, port)
        self.model_id, self.max_input_tokens, self.max_total_tokens = model_id, max_input_tokens, max_total_tokens
        self.max_concurrent_requests, self.pool_tokens, self.token_delay_s = max_concurrent_requests, pool_tokens, token_delay_s
        self.eos_after, self.cut_after, self.batch_slots = eos_after, cut_after, batch_slots
        self.errors_as_http_422 = errors_as_http_422
        self.pool_gauge = True  # False: TGI before 2.3.1, no tgi_batch_max_total_tokens on /metrics
        self.last_request: dict | None = None
        self.info_headers: dict | None = None  # the request headers of the last GET /info
        self.sha: str | None = None  # the router's git sha in /info (None: a build without one)
        self.in_flight = self.running = self.queued = self.reserved = 0
        self.requests = 0
        self.peak_reserved = self.peak_queued = 0
        self.cond = threading.Condition(self.lock)

    def info(self) -> dict:
        return {"model_id": self.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": self.max_concurrent_requests, "max_best_of": 2, "max_stop_sequences": 4,
                "max_input_tokens": self.max_input_tokens, "max_total_tokens": self.max_total_tokens,
                "validation_workers": 2, "max_client_batch_size": 4, "router": "text-generation-router",
                "version": VERSION, "sha": self.sha, "docker_label": f"sha-{self.sha[:7]}" if self.sha else None}

    def validate(self, n_in: int, max_new: int) -> str | None:
        if n_in > self.max_input_tokens:
            return (f"Input validation error: `inputs` must have less than {self.max_input_tokens} tokens. "
                    f"Given: {n_in}")
        if n_in + max_new > self.max_total_tokens:
            return (f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {self.max_total_tokens}. "
                    f"Given: {n_in} `inputs` tokens and {max_new} `max_new_tokens`")
        return None

    def admit(self) -> bool:
        with self.lock:
            if self.in_flight >= self.max_concurrent_requests:
                return False
            self.in_flight += 1
            self.requests += 1
            return True

    def wait_for_slot(self, reservation: int) -> None:
        with self.cond:
            self.queued += 1
            self.peak_queued = max(self.peak_queued, self.queued)
            while (self.batch_slots is not None and self.running >= self.batch_slots) or \
                    self.reserved + reservation > self.pool_tokens:
                self.cond.wait(0.05)
            self.queued -= 1
            self.running += 1
            self.reserved += reservation
            self.peak_reserved = max(self.peak_reserved, self.reserved)

    def release(self, reservation: int) -> None:
        with self.cond:
            self.in_flight -= 1
            self.running -= 1
            self.reserved -= reservation
            self.cond.notify_all()

    def metrics(self) -> str:
        # metrics-exporter-prometheus: counters keep their name (no _total), gauges as set.
        with self.lock:
            rows = [("tgi_request_count", "counter", self.requests),
                    *([("tgi_batch_max_total_tokens", "gauge", self.pool_tokens)] if self.pool_gauge else []),
                    ("tgi_batch_current_max_tokens", "gauge", self.reserved),
                    ("tgi_batch_current_size", "gauge", self.running),
                    ("tgi_queue_size", "gauge", self.queued)]
        return "".join(f"# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in rows)


def main(argv=None) -> None:
    """``text-generation-launcher`` stand-in: the launcher's flags, the launcher's and router's log lines."""
    p = argparse.ArgumentParser(prog="text-generation-launcher")
    p.add_argument("--model-id", required=True)
    p.add_argument("--hostname", default="0.0.0.0")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--max-input-tokens", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--max-batch-prefill-tokens", type=int)
    p.add_argument("--kv-cache-dtype", choices=["fp8_e4m3fn", "fp8_e5m2"])
    p.add_argument("--dtype", choices=["float16", "bfloat16"])
    args = p.parse_args(argv)
    env = os.environ
    pool = int(env.get("FAKE_TGI_POOL_TOKENS", DEFAULT_POOL_TOKENS))
    fake = FakeTGI(args.hostname, args.port, args.model_id, args.max_input_tokens or 4095, args.max_total_tokens or 4096,
                   args.max_concurrent_requests, pool, float(env.get("FAKE_TGI_TOKEN_DELAY_S", "0.002")))
    print(f"{_ts()}  INFO text_generation_launcher: Args {{ model_id: \"{args.model_id}\", hostname: \"{args.hostname}\", "
          f"port: {args.port}, kv_cache_dtype: {args.kv_cache_dtype!r} }}", flush=True)
    print(f"{_ts()}  INFO text_generation_launcher: KV-cache blocks: {pool}, size: 1", flush=True)
    print(f"{_ts()}  INFO text_generation_router_v3: backends/v3/src/lib.rs:125: Setting max batch total tokens to {pool}",
          flush=True)
    print(f"{_ts()}  INFO text_generation_router::server: router/src/server.rs:2416: Connected", flush=True)
    fake.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
