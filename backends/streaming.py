"""The client side of a streamed request: one HTTP connection pool and two stream readers.

Adapters build the request body and read each event; these functions do the transport and stamp every
event's arrival time *before* it is parsed. ``client`` is whatever :func:`open_client` returns: adapters
pass it through and never use it directly, so the transport can change without touching them.
"""
from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager

import httpx

from .base import RequestResult

#: Exceptions a broken connection or a cut-off stream raises; the load generator turns them into a
#: failed request.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError,)


@asynccontextmanager
async def open_client(max_connections: int, timeout_s: float):
    limits = httpx.Limits(max_connections=max_connections + 4, max_keepalive_connections=max_connections + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        yield client


async def _stream(client, url: str, body: dict, prompt, handle, parse) -> RequestResult:
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
        else:
            async for line in response.aiter_lines():
                now = time.perf_counter()
                event = parse(line)
                if event is not None:
                    handle(event, now, result)
    result.t_done = time.perf_counter()
    return result


async def stream_sse(client, url: str, body: dict, prompt, handle) -> RequestResult:
    """POST ``body`` and read a server-sent-event stream; ``handle(event, arrival_time, result)`` reads
    each JSON event into the result."""
    return await _stream(client, url, body, prompt, handle, parse_sse_line)


async def stream_ndjson(client, url: str, body: dict, prompt, handle) -> RequestResult:
    """POST ``body`` and read a newline-delimited JSON stream (Ollama), one event per line."""
    return await _stream(client, url, body, prompt, handle, parse_ndjson_line)


def parse_sse_line(line: str) -> dict | None:
    """One ``data:`` line of a server-sent-event stream as JSON; None for anything else or [DONE]."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


def parse_ndjson_line(line: str) -> dict | None:
    line = line.strip()
    return json.loads(line) if line else None
