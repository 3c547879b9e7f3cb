"""Any OpenAI-compatible server, attach only: ``-b openai:url=http://host:port``. kvbench neither starts nor
stops it and reads no KV figure from it (pool and in-use: not measured).

Requests: ``/v1/completions`` SSE. Once attached, the adapter reads /v1/models (the served models, recorded
in run.json and checked against ``--model``) and asks the server what it supports with three tiny
requests (:meth:`OpenAIBackend.probe`): a prompt as a list of token ids, ``ignore_eos`` with
``min_tokens`` (vLLM/SGLang extensions; OpenAI's own API answers 400 "Unrecognized request argument"),
and ``stream_options.include_usage`` (prompt and completion tokens from the server's usage chunk). What it
supports it uses; ``token_ids=`` and ``ignore_eos=`` say it instead of asking. A server that cannot force
the output length generates until EOS: its short outputs are flagged and keep their timings.
``return_token_ids=true`` asks vLLM for the token ids of each chunk. The model is ``served_model`` or the
first id of /v1/models.

Tokens per chunk: the number of ``token_ids`` of the choice when the server sends them, else one per
chunk with non-empty text (a server that packs several tokens into one chunk is then under-counted:
the usage's completion_tokens stays exact, and the runner compares the two).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvbench.common.envs import Recipe
from kvbench.common.redact import scrub

from ..base import Backend
from ..capabilities import Capabilities, PrefixCache, ServedModel
from ..options import Option
from ..shared.openai_chunks import read_completion_chunk
from ..streaming import sse_json, sse_payloads, stream_sse
from ..types import EngineStartError, KVInUse, KVPool, RequestResult, ServerSpec

PROBE_DEADLINE_S = 30.0  # one probe request, from connect to its last byte
PROBE_MAX_BYTES = 1 << 20  # a 2-token answer is a few hundred bytes
NEEDS_URL = "the openai backend benchmarks a running server: give it a url (-b openai:url=http://host:port)"


@dataclass(frozen=True)
class AttachedServedModel(ServedModel):
    """What /v1/models listed when the adapter attached, and what :meth:`OpenAIBackend.probe` found."""

    def models(self, backend: OpenAIBackend) -> list[str] | None:
        return list(backend.models)

    def support(self, backend: OpenAIBackend) -> dict[str, bool | str]:
        return dict(backend.probed)


class OpenAIBackend(Backend):
    engine = "openai"
    default_version = "v1"  # the API; the server's own version is whatever /version says, if it has one
    #: The options this adapter reads (-b openai:KEY=VALUE); checked by BackendConfig.parse, listed by `kvbench backends`.
    option_specs = (
        Option("served_model", str, None, "the model name requests use", default_text="the first of /v1/models"),
        Option("token_ids", bool, None, "the server takes prompts as token ids", default_text="asked of the server"),
        Option("ignore_eos", bool, None, "the server honours ignore_eos (exact output lengths)",
               default_text="asked of the server"),
        Option("return_token_ids", bool, False, "ask for the token ids (vLLM's return_token_ids)"),
        Option("probe", bool, True, "ask the server what it supports (three 2-token requests) before the cells"),
    )
    accepts_token_ids = False
    attach_only = NEEDS_URL
    health_path = "/v1/models"
    capabilities = Capabilities(
        prefix_cache=PrefixCache(
            report="usage.prompt_tokens_details.cached_tokens per request, where the server sends it"),
        served_model=AttachedServedModel())

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepts_token_ids = bool(self.options.get("token_ids", False))
        self.forces_output_length = bool(self.options.get("ignore_eos", False))
        self.stream_usage = True
        self.model = ""
        self.models: list[str] = []  # what /v1/models lists
        self.probed: dict[str, bool | str] = {}

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        return Recipe("openai", version, (), venv=False)  # nothing to install

    def command(self, spec: ServerSpec):
        raise EngineStartError(NEEDS_URL)

    def start(self, spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
        raise EngineStartError(NEEDS_URL)

    def attach(self, spec: ServerSpec, url: str, timeout_s: float = 30.0) -> None:
        super().attach(spec, url, timeout_s)
        try:
            data = self.http.get(self.base_url + "/v1/models").json().get("data") or []
            self.models = [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id")]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise EngineStartError(f"{self.base_url}/v1/models: {exc}") from None
        self.model = str(self.options.get("served_model") or "") or (self.models[0] if self.models else "")
        if not self.model:
            raise EngineStartError(f"{self.base_url}/v1/models lists no model: give openai:served_model=NAME")
        if self.options.get("probe", True):
            self.probe()

    def probe(self) -> None:
        """Ask the server, with requests of one or two output tokens, what it supports: usage in the stream,
        prompts as token ids, ignore_eos; an option given (token_ids=, ignore_eos=) is used as given."""
        ok, usage = self._try({"prompt": "Hello", "stream_options": {"include_usage": True}})
        if not ok:  # a server that refuses stream_options altogether
            ok, usage = self._try({"prompt": "Hello"})
            if not ok:
                raise EngineStartError(f"{self.base_url}/v1/completions refused a 2-token request: {usage}")
        self.stream_usage = isinstance(usage, dict)
        self.probed["stream usage"] = self.stream_usage
        extra = {"stream_options": {"include_usage": True}} if self.stream_usage else {}
        if self.options.get("token_ids") is None:
            ids = list(range(100, 108))  # ids below any vocabulary's size; only whether a list is taken matters
            ok, usage = self._try({"prompt": ids, **extra})
            self.accepts_token_ids = ok and (not isinstance(usage, dict) or usage.get("prompt_tokens") == len(ids))
            self.probed["token ids"] = self.accepts_token_ids
        if self.options.get("ignore_eos") is None:
            ok, _ = self._try({"prompt": "Hello", "ignore_eos": True, "min_tokens": 2, **extra})
            self.forces_output_length = ok
            self.probed["ignore_eos"] = ok

    def _try(self, body: dict) -> tuple[bool, dict | str | None]:
        """(accepted, the usage chunk or None; the error text when refused) of one streamed 2-token request.
        Its whole answer within the run's --request-timeout (:data:`PROBE_DEADLINE_S` where none was given;
        httpx's timeout is per read: a server dripping a byte at a time held it for ever) and
        :data:`PROBE_MAX_BYTES`."""
        body = {"model": self.model, "max_tokens": 2, "temperature": 0.0, "stream": True, **body}
        deadline_s = self.request_timeout_s or PROBE_DEADLINE_S
        deadline = time.monotonic() + deadline_s
        try:
            with self.http.stream("POST", self.base_url + "/v1/completions", json=body,
                                  timeout=deadline_s) as response:
                pieces, size = [], 0
                for piece in response.iter_bytes():
                    pieces.append(piece)
                    size += len(piece)
                    if time.monotonic() > deadline or size > PROBE_MAX_BYTES:
                        return False, (f"no whole answer within {deadline_s:g} s and "
                                       f"{PROBE_MAX_BYTES // 1024} KiB")
                answer = b"".join(pieces)
                if response.status_code >= 400:
                    return False, f"HTTP {response.status_code}: {scrub(answer.decode(errors='replace'))[:300]}"
                usage = None
                for data in sse_payloads(answer):
                    if data.strip() in (b"", b"[DONE]"):
                        continue
                    event = sse_json(data)
                    if "error" in event:
                        return False, scrub(str(event["error"]))[:300]
                    usage = event.get("usage") or usage
                return True, usage
        except Exception as exc:  # noqa: BLE001 - whatever the server answered, it is not "supported"
            return False, scrub(f"{type(exc).__name__}: {exc}")

    def reported_version(self) -> str | None:
        try:  # vLLM and SGLang answer /version; others do not: then the version is unknown
            return str(self.http.get(self.base_url + "/version").json()["version"])
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return None

    async def stream(self, client, prompt) -> RequestResult:
        n = prompt.output_tokens
        body = {"model": self.model, "prompt": prompt.token_ids if self.accepts_token_ids else prompt.text,
                "max_tokens": n, "temperature": 0.0, "stream": True}
        if self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        if self.forces_output_length:
            body.update(ignore_eos=True, min_tokens=n)
        if self.options.get("return_token_ids", False):
            body["return_token_ids"] = True
        result = await stream_sse(client, self.base_url + "/v1/completions", body, prompt, self._read_event)
        if result.error is None and result.output_tokens_reported is None and self.stream_usage:
            result.error = "stream ended without a usage chunk (does the server honour stream_options.include_usage?)"
        return result

    @staticmethod
    def _read_event(event: dict, now: float, result: RequestResult) -> None:
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            message = (error.get("message") if isinstance(error, dict) else None) or json.dumps(error)
            result.error = scrub(str(message))[:500]  # before the cut: no half key
            return
        read_completion_chunk(event, now, result)

    def kv_pool(self) -> KVPool | None:
        return None  # not measured: the OpenAI API exposes no KV figure

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        return None
