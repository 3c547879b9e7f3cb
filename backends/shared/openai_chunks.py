"""The chunks of an OpenAI-compatible ``/v1/completions`` stream, as every server that speaks it sends them
(OpenAI's API, vLLM, llama-server, SGLang)."""
from __future__ import annotations

import json

from kvbench.common.redact import scrub

from ..types import RequestResult


def read_completion_chunk(event: dict, now: float, result: RequestResult, read_choice_extra=None) -> None:
    """The choices and usage of one ``/v1/completions`` stream chunk (vLLM's too). Tokens in the chunk:
    its ``token_ids`` when the server sends them (vLLM with ``return_token_ids``), else one per non-empty
    text delta. ``read_choice_extra(choice, result)``, when given, is called for each choice that carries
    ``logprobs`` (vLLM's reader), in this one pass over the choices.

    An event without choices that carries ``error`` (vLLM's ErrorResponse, OpenAI's error object: neither
    has choices) fails the request with it, scrubbed of held keys before it is cut.

    This runs once per streamed event: RequestResult.add_chunk is inlined, the choices are walked once and
    vLLM calls it with no wrapper of its own (the client's ceiling, docs/harness-benchmarks.md: each call
    layer and each walk cost ~0.05-0.2 us a token)."""
    choices = event.get("choices")
    if not choices:
        if "error" in event:
            result.error = scrub(json.dumps(event["error"]))[:500]
    else:
        times, counts = result.chunk_times, result.chunk_tokens
        for choice in choices:
            ids = choice.get("token_ids")
            n_tokens = len(ids) if ids is not None else (1 if choice.get("text") else 0)
            if n_tokens:
                times.append(now)
                counts.append(n_tokens)
            if choice.get("finish_reason"):
                result.engine_details["finish_reason"] = choice["finish_reason"]
            if read_choice_extra is not None and choice.get("logprobs"):
                read_choice_extra(choice, result)
    usage = event.get("usage")
    if usage:
        result.prompt_tokens_reported = usage.get("prompt_tokens")
        result.output_tokens_reported = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")  # OpenAI's: which prompt tokens the prefix cache served
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            result.prompt_tokens_cached = details["cached_tokens"]
