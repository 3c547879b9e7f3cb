"""The streaming client's event splitters (SSE for TGI, NDJSON for Ollama), fed a 1,024-token stream as the
socket hands it over: reads of ~1 KiB that cut events at arbitrary places.

The splitters are closures inside backends.streaming.stream_sse / stream_ndjson; they are taken out by
running those functions once over a stand-in for the transport (``_stream``), so the code measured is
the code the timed path runs, with the real adapters' event handlers.
"""
import asyncio
import json

import pytest

from kvbench.backends import streaming
from kvbench.backends.ollama.adapter import OllamaBackend
from kvbench.backends.tgi.adapter import TGIBackend
from kvbench.backends.types import RequestResult
from kvbench.workloads.prompts import Prompt

TOKENS = 1024
READ = 1024  # bytes per socket read


def _tgi_body() -> bytes:
    events = []
    for i in range(1, TOKENS + 1):
        last = i == TOKENS
        events.append({"index": i, "token": {"id": 1000 + i, "text": f" w{i}", "logprob": -0.25, "special": False},
                       "generated_text": "x" if last else None,
                       "details": {"finish_reason": "length", "generated_tokens": TOKENS, "seed": None,
                                   "input_length": 8} if last else None})
    return b"".join(b"data:" + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)


def _ollama_body() -> bytes:
    lines = [{"model": "m", "created_at": "2026-01-01T00:00:00.000000Z", "response": f" w{i}", "done": False}
             for i in range(1, TOKENS + 1)]
    lines.append({"model": "m", "created_at": "2026-01-01T00:00:00.000000Z", "response": "", "done": True,
                  "done_reason": "length", "prompt_eval_count": 8, "eval_count": TOKENS, "total_duration": 1,
                  "load_duration": 0, "prompt_eval_duration": 1, "eval_duration": 1})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _splitter(stream_fn, handle, monkeypatch):
    captured = {}

    async def fake_stream(client, url, body, prompt, split_events, *more, **named):  # any later parameters
        captured["split"] = split_events
        result = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, 0.0)
        return result, streaming.new_stream_state(result)

    monkeypatch.setattr(streaming, "_stream", fake_stream)
    prompt = Prompt("r", (1,) * 8, "x", TOKENS)
    asyncio.run(stream_fn(None, "http://127.0.0.1:1/x", {}, prompt, handle))
    monkeypatch.undo()
    return captured["split"]


def _feed(split, body: bytes) -> RequestResult:
    result = RequestResult("r", 8, TOKENS, 0.0)
    state = streaming.new_stream_state(result)  # what _stream gives the splitter
    for i, start in enumerate(range(0, len(body), READ)):
        split(body[start:start + READ], float(i), state)
    return result


@pytest.mark.parametrize("engine", ["tgi_sse", "ollama_ndjson"])
def test_split_events(benchmark, monkeypatch, engine):
    if engine == "tgi_sse":
        split, body = _splitter(streaming.stream_sse, TGIBackend._read_event, monkeypatch), _tgi_body()
    else:
        split, body = _splitter(streaming.stream_ndjson, OllamaBackend._read_event, monkeypatch), _ollama_body()
    result = benchmark(_feed, split, body)
    assert sum(result.chunk_tokens) == TOKENS and result.output_tokens_reported == TOKENS
