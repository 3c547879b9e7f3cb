"""The chunks of an OpenAI-compatible ``/v1/completions`` stream, as every server that speaks it sends them
(OpenAI's API, vLLM, llama-server, SGLang)."""
from __future__ import annotations

from ..types import RequestResult


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
        details = usage.get("prompt_tokens_details")  # OpenAI's: which prompt tokens the prefix cache served
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            result.prompt_tokens_cached = details["cached_tokens"]
