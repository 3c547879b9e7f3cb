"""Closed-loop load: ``concurrency`` workers, each sending its next request as soon as the last one ends."""
from __future__ import annotations

import asyncio
import time

from backends.base import Backend, RequestResult
from backends.streaming import TRANSPORT_ERRORS, open_client


async def _one(backend: Backend, client, prompt, timeout_s: float) -> RequestResult:
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(backend.stream(client, prompt), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        error = f"timed out after {timeout_s:.0f} s"
    except TRANSPORT_ERRORS as exc:
        error = f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # malformed stream
        error = f"bad response: {exc}"
    result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, t0)
    result.error, result.t_done = error, time.perf_counter()
    return result


async def run_closed_loop(backend: Backend, prompts: list, concurrency: int, timeout_s: float,
                          on_done=None) -> list[RequestResult]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    async with open_client(concurrency, timeout_s) as client:
        async def worker():
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                result = await _one(backend, client, prompt, timeout_s)
                results.append(result)
                if on_done:
                    on_done(result)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results
