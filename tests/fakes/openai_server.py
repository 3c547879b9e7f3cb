"""A fake OpenAI-compatible completions server in vLLM's dialect (vllm/entrypoints/openai/protocol.py and
serving_completion.py; the OpenAI API reference for the base format):

- GET /v1/models: ``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by", "root",
  "max_model_len"}]}``; GET /version: ``{"version": ...}`` (vLLM's own route).
- POST /v1/completions with ``stream: true``: SSE ``data: {"id", "object": "text_completion", "created",
  "model", "choices": [{"index", "text", "logprobs", "finish_reason", "stop_reason"(, "token_ids")}]}``,
  then with ``stream_options.include_usage`` a chunk with ``choices: []`` and ``usage {prompt_tokens,
  total_tokens, completion_tokens}``, then ``data: [DONE]``. ``prompt`` is a string or a list of ids.
- Errors: HTTP 404 ``{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
  "param": "model", "code": 404}}``; HTTP 400 for a prompt + max_tokens over max_model_len (vLLM's
  "This model's maximum context length is N tokens. However, you requested M tokens ..." message).

A server of another dialect: ``vllm_extensions=False`` answers a request with ``ignore_eos``,
``min_tokens`` or ``return_token_ids`` as OpenAI's own API answers an argument it does not know (HTTP 400
``{"error": {"message": "Unrecognized request argument supplied: ignore_eos", "type":
"invalid_request_error", "param": null, "code": null}}``); ``token_id_prompts=False`` answers a prompt given
as a list of ids with HTTP 400 ``{"error": {"message": "prompt must be a string", "type":
"invalid_request_error", "param": "prompt", "code": null}}`` (as servers that take text only do).

Knobs: ``first_token_delay_s`` (a function of the prompt: seconds before its first token, a spread of
TTFTs that is the same for the same prompts), ``tokens_per_chunk`` (several tokens per SSE chunk, as with vLLM's stream interval),
``eos_after`` (stop with finish_reason "stop" unless the request says ignore_eos), ``cut_after`` (close
the connection after k chunks), ``include_usage`` (False: a server that ignores stream_options).

A hosted endpoint: ``tls`` (an ``ssl.SSLContext`` with the server's certificate) serves https;
``require_auth`` (the exact ``Authorization`` header value) answers every request without it with
HTTP 401 ``{"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "code":
"invalid_api_key"}}`` (OpenAI's answer); ``auth_seen`` records the Authorization header of every request.

Checked by the official ``openai`` client, each reply also strictly against its types:
tests/backends/openai/test_fake_conformance.py.
"""
from __future__ import annotations

import json
import socket
import ssl
import threading
import time

from tests.fakes._http import FakeServer, Handler, Server, count_words


class OpenAIHandler(Handler):
    def setup(self):
        # as uvicorn does: without TCP_NODELAY, a TLS server's small writes wait ~40 ms behind its session
        # ticket for the client's delayed ACK, and a whole stream arrives at once
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    def _authorized(self) -> bool:
        fake: FakeOpenAI = self.server.fake
        seen = self.headers.get("Authorization")
        with fake.lock:
            fake.auth_seen.append(seen)
        if fake.require_auth is None or seen == fake.require_auth:
            return True
        if self.command == "POST":
            self.read_body()
        self.send_json(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                       "param": None, "code": "invalid_api_key"}})
        return False

    def do_GET(self):
        fake: FakeOpenAI = self.server.fake
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [
                {"id": fake.model, "object": "model", "created": 1764000000, "owned_by": "vllm", "root": fake.model,
                 "parent": None, "max_model_len": fake.max_model_len}]})
        elif self.path == "/version" and fake.version is not None:  # version=None: a server without the route
            self.send_json(200, {"version": fake.version})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self):
        fake: FakeOpenAI = self.server.fake
        if not self._authorized():
            return
        if self.path != "/v1/completions":
            return self.send_json(404, {"detail": "Not Found"})
        fake.last_request = req = self.read_json()
        if req.get("model") != fake.model:
            return self.send_json(404, {"error": {"message": f"The model `{req.get('model')}` does not exist.",
                                                  "type": "NotFoundError", "param": "model", "code": 404}})
        unknown = [k for k in ("ignore_eos", "min_tokens", "return_token_ids") if k in req]
        if unknown and not fake.vllm_extensions:
            return self.send_json(400, {"error": {"message": f"Unrecognized request argument supplied: {unknown[0]}",
                                                  "type": "invalid_request_error", "param": None, "code": None}})
        prompt = req.get("prompt")
        if isinstance(prompt, list) and not fake.token_id_prompts:
            return self.send_json(400, {"error": {"message": "prompt must be a string", "type": "invalid_request_error",
                                                  "param": "prompt", "code": None}})
        n_prompt = len(prompt) if isinstance(prompt, list) else count_words(prompt or "")
        max_tokens = int(req.get("max_tokens") or 16)
        if n_prompt + max_tokens > fake.max_model_len:
            return self.send_json(400, {"error": {
                "message": f"This model's maximum context length is {fake.max_model_len} tokens. However, you "
                           f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} in "
                           f"the completion). Please reduce the length of the messages or completion.",
                "type": "BadRequestError", "param": None, "code": 400}})
        n_out = max_tokens
        if fake.eos_after is not None and not req.get("ignore_eos"):
            n_out = min(n_out, max(fake.eos_after, int(req.get("min_tokens") or 0)))
        base = {"id": "cmpl-fake0001", "object": "text_completion", "created": int(time.time()), "model": fake.model}
        self.start_stream("text/event-stream; charset=utf-8")
        sent, chunks = 0, 0
        if fake.first_token_delay_s is not None:
            time.sleep(fake.first_token_delay_s(prompt))
        while sent < n_out:
            time.sleep(fake.token_delay_s)
            k = min(fake.tokens_per_chunk, n_out - sent)
            ids = list(range(1000 + sent, 1000 + sent + k))
            sent += k
            done = sent == n_out
            choice = {"index": 0, "text": "".join(f" w{i}" for i in ids), "logprobs": None,
                      "finish_reason": ("length" if n_out == max_tokens else "stop") if done else None,
                      "stop_reason": None}
            if req.get("return_token_ids"):
                choice["token_ids"] = ids
            self._event({**base, "choices": [choice], "usage": None})
            chunks += 1
            if fake.cut_after is not None and chunks >= fake.cut_after:
                return self.cut()
        if fake.include_usage and (req.get("stream_options") or {}).get("include_usage"):
            self._event({**base, "choices": [], "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
                                                           "completion_tokens": n_out}})
        self.chunk(b"data: [DONE]\n\n")
        self.end_stream()

    def _event(self, obj) -> None:
        self.chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


class FakeOpenAI(FakeServer):
    handler = OpenAIHandler

    def __init__(self, host="127.0.0.1", port=0, model="smollm2", max_model_len=8192, version="0.32.0",
                 token_delay_s=0.002, tokens_per_chunk=1, eos_after=None, cut_after=None, include_usage=True,
                 tls: ssl.SSLContext | None = None, require_auth: str | None = None, vllm_extensions=True,
                 token_id_prompts=True, first_token_delay_s=None):
        super().__init__(host, port)
        self.first_token_delay_s = first_token_delay_s  # prompt -> seconds before its first token (beside token_delay_s)
        self.vllm_extensions, self.token_id_prompts = vllm_extensions, token_id_prompts
        self.tls, self.require_auth = tls, require_auth
        self.auth_seen: list[str | None] = []
        self.model, self.max_model_len, self.version = model, max_model_len, version
        self.token_delay_s, self.tokens_per_chunk = token_delay_s, tokens_per_chunk
        self.eos_after, self.cut_after, self.include_usage = eos_after, cut_after, include_usage
        self.last_request: dict | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def start(self):
        if self.tls is None:
            return super().start()
        self.httpd = Server((self.host, self.port), self.handler)
        self.httpd.socket = self.tls.wrap_socket(self.httpd.socket, server_side=True)
        self.httpd.fake = self
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self
