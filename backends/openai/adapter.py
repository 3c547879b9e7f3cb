"""Any OpenAI-compatible server, attach only: ``-b openai:url=http://host:port``. kvbench neither starts nor
stops it and reads no KV figure from it (pool and in-use: not measured).

Requests: ``/v1/completions`` SSE with ``stream_options.include_usage`` (prompt and completion tokens from
the server's usage chunk). Prompts go as text unless ``token_ids=true`` (servers that take a list of ids,
e.g. vLLM, SGLang). ``ignore_eos=true`` adds ``ignore_eos`` and ``min_tokens`` (vLLM/SGLang extensions;
other servers may reject them); without it a request may stop early at EOS. ``return_token_ids=true`` asks
vLLM for the token ids of each chunk. The model is ``served_model`` or the first id of /v1/models.

Tokens per chunk: the number of ``token_ids`` of the choice when the server sends them, else one per
chunk with non-empty text (a server that packs several tokens into one chunk is then under-counted:
the usage's completion_tokens stays exact, and the runner compares the two).
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from kvbench.common.envs import Recipe

from ..base import Backend
from ..options import Option
from ..streaming import stream_sse
from ..types import EngineStartError, KVInUse, KVPool, RequestResult, ServerSpec

NEEDS_URL = "the openai backend benchmarks a running server: give it a url (-b openai:url=http://host:port)"


def read_completion_chunk(event: dict, now: float, result: RequestResult) -> None:
    """The choices and usage of one ``/v1/completions`` stream chunk (vLLM's too). Tokens in the chunk:
    its ``token_ids`` when the server sends them (vLLM with ``return_token_ids``), else one per non-empty
    text delta."""
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids")
        result.add_chunk(now, len(ids) if ids is not None else (1 if choice.get("text") else 0))
        if choice.get("finish_reason"):
            result.engine_details["finish_reason"] = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        result.prompt_tokens_reported = usage.get("prompt_tokens")
        result.output_tokens_reported = usage.get("completion_tokens")


class OpenAIBackend(Backend):
    engine = "openai"
    default_version = "v1"  # the API; the server's own version is whatever /version says, if it has one
    #: The options this adapter reads (-b openai:KEY=VALUE); checked by BackendConfig.parse, listed by `kvbench backends`.
    option_specs = (
        Option("served_model", str, None, "the model name requests use", default_text="the first of /v1/models"),
        Option("token_ids", bool, False, "the server takes prompts as token ids"),
        Option("ignore_eos", bool, False, "the server honours ignore_eos (exact output lengths)"),
        Option("return_token_ids", bool, False, "ask for the token ids (vLLM's return_token_ids)"),
    )
    accepts_token_ids = False
    attach_only = NEEDS_URL
    health_path = "/v1/models"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepts_token_ids = bool(self.options.get("token_ids", False))
        self.forces_output_length = bool(self.options.get("ignore_eos", False))
        self.model = ""

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        return Recipe("openai", version, (), venv=False)  # nothing to install

    def command(self, spec: ServerSpec):
        raise EngineStartError(NEEDS_URL)

    def start(self, spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
        raise EngineStartError(NEEDS_URL)

    def attach(self, spec: ServerSpec, url: str, timeout_s: float = 30.0) -> None:
        super().attach(spec, url, timeout_s)
        self.model = str(self.options.get("served_model") or "")
        if not self.model:
            try:
                models = self.http.get(self.base_url + "/v1/models").json().get("data") or []
            except (httpx.HTTPError, ValueError) as exc:
                raise EngineStartError(f"{self.base_url}/v1/models: {exc}") from None
            if not models:
                raise EngineStartError(f"{self.base_url}/v1/models lists no model: give openai:served_model=NAME")
            self.model = models[0]["id"]

    def reported_version(self) -> str:
        try:  # vLLM and SGLang answer /version; others do not
            return str(self.http.get(self.base_url + "/version").json()["version"])
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return self.version

    async def stream(self, client, prompt) -> RequestResult:
        n = prompt.output_tokens
        body = {"model": self.model, "prompt": list(prompt.token_ids) if self.accepts_token_ids else prompt.text,
                "max_tokens": n, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if self.forces_output_length:
            body.update(ignore_eos=True, min_tokens=n)
        if self.options.get("return_token_ids", False):
            body["return_token_ids"] = True
        result = await stream_sse(client, self.base_url + "/v1/completions", body, prompt, self._read_event)
        if result.error is None and result.output_tokens_reported is None:
            result.error = "stream ended without a usage chunk (does the server honour stream_options.include_usage?)"
        return result

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            result.error = (error.get("message") if isinstance(error, dict) else None) or json.dumps(error)[:500]
            return
        read_completion_chunk(event, now, result)

    def kv_pool(self) -> KVPool | None:
        return None  # not measured: the OpenAI API exposes no KV figure

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        return None
