"""The third fault matrix's wire formats (docs/fault-matrix.md, "Wire formats"): every framing the SSE
standard (WHATWG HTML, "server-sent events", event-stream interpretation) allows, checked against the
openai client's own SSE decoder; a request deadline from connect to the last byte; usage counts that are
no count; invalid UTF-8 in token text; an HTML page served as text/event-stream."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from kvbench.backends import streaming
from kvbench.backends.openai.adapter import OpenAIBackend
from kvbench.backends.streaming import open_client, stream_sse
from kvbench.backends.types import RequestResult
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.load import LoadPoint, LoadSettings, run_async
from kvbench.load import run as load_run
from kvbench.workloads.prompts import Prompt
from tests.backends.test_streaming import CHUNKED_HEAD, _serve, chunk, run_sse

PROMPT = Prompt("r0", (1, 2, 3), "", 4)


def events_of(body: bytes, reads: list[int]) -> tuple[list, RequestResult]:
    """The JSON events kvbench's SSE splitter hands the adapter for ``body`` cut into reads of these sizes,
    and the request's result (the splitter taken out of stream_sse as the harness benchmark does)."""
    captured = {}

    async def fake_stream(client, url, body_, prompt, split_events, *more, **named):
        captured["split"] = split_events
        result = RequestResult("r", 3, 4, 0.0)
        return result, streaming.new_stream_state(result)

    seen = []
    original = streaming._stream
    streaming._stream = fake_stream
    try:
        asyncio.run(stream_sse(None, "http://127.0.0.1:1/x", {}, PROMPT, lambda e, now, r: seen.append(e)))
    finally:
        streaming._stream = original
    result = RequestResult("r", 3, 4, 0.0)
    state = streaming.new_stream_state(result)
    at = 0
    for i, size in enumerate(reads):
        if at >= len(body):
            break
        captured["split"](body[at:at + size], float(i), state)
        at += size
    if at < len(body):
        captured["split"](body[at:], float(len(reads)), state)
    return seen, result


def openai_events(body: bytes, reads: list[int]) -> list:
    """The same body through the openai client's SSE decoder (its data joined as the standard says), JSON
    events only ([DONE] and empty data skipped, as kvbench does)."""
    decoder = pytest.importorskip("openai._streaming").SSEDecoder()
    pieces, at = [], 0
    for size in reads:
        pieces.append(body[at:at + size])
        at += size
    pieces.append(body[at:])
    out = []
    for sse in decoder.iter_bytes(iter(p for p in pieces if p)):
        if sse.data.strip() in ("", "[DONE]"):
            continue
        out.append(json.loads(sse.data))
    return out


E1 = {"choices": [{"text": "a", "index": 0}]}
E2 = {"choices": [{"text": "b", "index": 0}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
J1, J2 = json.dumps(E1).encode(), json.dumps(E2, indent=1).encode()  # J2 spans lines when split at "\n"

# framing -> a body holding E1 then E2 then [DONE], framed that way
FRAMINGS = {
    "lf": b"data: " + J1 + b"\n\ndata: " + json.dumps(E2).encode() + b"\n\ndata: [DONE]\n\n",
    "crlf": b"data: " + J1 + b"\r\n\r\ndata: " + json.dumps(E2).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n",
    "cr": b"data: " + J1 + b"\r\rdata: " + json.dumps(E2).encode() + b"\r\rdata: [DONE]\r\r",
    "no_space": b"data:" + J1 + b"\n\ndata:" + json.dumps(E2).encode() + b"\n\ndata:[DONE]\n\n",
    "comments_and_fields": (b": keep-alive\n\nevent: completion\nid: 7\nretry: 1000\ndata: " + J1 + b"\n\n"
                            b":another comment\ndata: " + json.dumps(E2).encode() + b"\nid: 8\n\n: end\n"
                            b"data: [DONE]\n\n"),
    "multi_line_data": (b"data: " + J1 + b"\n\n" + b"".join(b"data: " + part + b"\n" for part in J2.split(b"\n"))
                        + b"\ndata: [DONE]\n\n"),
    "multi_line_crlf_mixed": (b"data: " + J1 + b"\r\n\n" + b"".join(b"data:" + part + b"\r" for part in J2.split(b"\n"))
                              + b"\r\ndata: [DONE]\n\n"),
    "bom": b"\xef\xbb\xbfdata: " + J1 + b"\n\ndata: " + json.dumps(E2).encode() + b"\n\ndata: [DONE]\n\n",
    "empty_data_line_in_event": b"data: " + J1 + b"\ndata\n\ndata: " + json.dumps(E2).encode() + b"\n\n",
}


@pytest.mark.parametrize("framing", list(FRAMINGS))
def test_every_sse_framing_gives_the_events_the_standard_and_the_openai_client_give(framing):
    body = FRAMINGS[framing]
    if framing == "bom":  # the standard drops a leading BOM; the openai client does not (its first field is "\ufeffdata")
        expected = [E1, E2]
    else:
        expected = openai_events(body, [len(body)])
        assert expected == [E1, E2], expected  # the reference itself reads both events
    rng = random.Random(framing)
    for trial in range(60):  # every read boundary matters: CRLF cut between reads, a field cut mid-name
        reads = [len(body)] if trial == 0 else [1] * len(body) if trial == 1 else \
            [rng.randint(1, 12) for _ in range(len(body))]
        seen, _ = events_of(body, reads)
        assert seen == expected, (reads, seen)
        if framing != "bom":
            assert openai_events(body, reads) == expected


def test_sse_framings_through_a_real_socket_count_tokens_and_usage():
    for framing in ("crlf", "cr", "multi_line_data", "comments_and_fields"):
        body = FRAMINGS[framing]
        r = run_sse([CHUNKED_HEAD + chunk(body) + b"0\r\n\r\n"], handle=VLLMBackend._read_event)
        assert r.error is None, (framing, r.error)
        assert r.chunk_tokens == [1, 1] and r.output_tokens_reported == 2 and r.prompt_tokens_reported == 3


def test_an_event_without_its_blank_line_at_the_end_is_cut_off_as_the_standard_says():
    body = b"data: " + J1 + b"\n\ndata: " + json.dumps(E2).encode() + b"\n"  # last event never ended
    seen, _ = events_of(body, [len(body)])
    assert seen == [E1] == openai_events(body, [len(body)])
    r = run_sse([CHUNKED_HEAD + chunk(body) + b"0\r\n\r\n"])
    assert r.error is not None and r.error.startswith("stream cut off inside an event: b'data:")


def test_an_html_page_served_as_an_event_stream_says_what_came():
    page = b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head>\n<body>Sign in to continue</body></html>\n"
    r = run_sse([CHUNKED_HEAD + chunk(page) + b"0\r\n\r\n"])
    assert r.error == "HTTP 200 text/event-stream but the body held no server-sent event: it began '<!DOCTYPE html>'"


def test_invalid_utf8_in_token_text_is_read_replaced_and_counted():
    bad = b'data: {"choices": [{"text": "\xff\xfe caf\xc3", "index": 0}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
    good = b'data: {"choices": [{"text": "ok", "index": 0}]}\n\n'
    seen = []

    def handle(event, now, result):
        seen.append(event)
        OpenAIBackend._read_event(event, now, result)
    r = run_sse([CHUNKED_HEAD + chunk(bad + good + usage + b"data: [DONE]\n\n") + b"0\r\n\r\n"], handle=handle)
    assert r.error is None and r.chunk_tokens == [1, 1] and r.output_tokens_reported == 2
    assert seen[0]["choices"][0]["text"] == "\ufffd\ufffd caf\ufffd"  # replaced, as a decoder with errors="replace"
    assert r.engine_details["events_not_utf8"] == 1


def _serve_many(bodies: list[bytes], client_fn):
    async def handler(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            request = json.loads(await reader.readexactly(length))
            body = bodies[int(str(request["prompt"]).rpartition("-")[2])]
            writer.write(CHUNKED_HEAD + chunk(body) + b"0\r\n\r\n")
            await writer.drain()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        async with server:
            return await client_fn(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    return run_async(main())


def _body(usage: dict) -> bytes:
    return (b'data: {"choices": [{"text": "a", "index": 0}]}\n\ndata: {"choices": [{"text": "b", "index": 0}]}\n\n'
            b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")


@pytest.mark.parametrize("bad_usage, said", [
    ({"prompt_tokens": 3, "completion_tokens": "2"}, "output token count '2' (str)"),
    ({"prompt_tokens": "3", "completion_tokens": 2}, "prompt token count '3' (str)"),
    ({"prompt_tokens": 3, "completion_tokens": 2.0}, "output token count 2.0 (float)"),
    ({"prompt_tokens": 3, "completion_tokens": 2**63}, f"output token count {2**63} (int)"),
    ({"prompt_tokens": 3, "completion_tokens": -1}, "output token count -1 (int)"),
    ({"prompt_tokens": 3, "completion_tokens": True}, "output token count True (bool)"),
    ({"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2**64}},
     None),  # the adapter itself reads only an int: a huge one is still no count
])
def test_a_usage_count_that_is_no_count_fails_only_that_request(bad_usage, said):
    good = _body({"prompt_tokens": 3, "completion_tokens": 2})
    bodies = [good, _body(bad_usage), good, good]

    async def client_fn(url):
        backend = OpenAIBackend("v1", None, {})
        backend.base_url, backend.model, backend.stream_usage = url, "m", True
        prompts = [Prompt(f"r{i}", (1, 2, 3), f"p-{i}", 2) for i in range(4)]
        return (await load_run(backend, prompts, LoadPoint("concurrent", 1), LoadSettings(10.0))).results
    results = _serve_many(bodies, client_fn)
    by_id = {r.request_id: r for r in results}
    assert len(results) == 4
    for rid in ("r0", "r2", "r3"):  # the cell's other requests are whole
        assert by_id[rid].error is None and by_id[rid].output_tokens_reported == 2
    bad = by_id["r1"]
    if said is None:
        assert bad.error is None and bad.prompt_tokens_cached is None
        return
    assert bad.error == f"bad response: the engine's {said}: not a token count"
    assert bad.chunk_tokens == [1, 1]  # its timings stay
    for name in ("prompt_tokens_reported", "output_tokens_reported", "prompt_tokens_cached"):
        value = getattr(bad, name)
        assert value is None or type(value) is int


# --- a deadline from connect to the last byte ---------------------------------------------------------

@pytest.mark.parametrize("script", [
    pytest.param([2.5, CHUNKED_HEAD], id="first_byte_late"),
    pytest.param([CHUNKED_HEAD] + [chunk(b": drip\n"), 0.2] * 15, id="drip_of_comments"),
    pytest.param([CHUNKED_HEAD] + [chunk(b"x"), 0.2] * 15, id="drip_inside_a_line"),
])
def test_the_request_deadline_holds_from_connect_to_the_last_byte(script):
    async def client_fn(url):
        backend = OpenAIBackend("v1", None, {})
        backend.base_url, backend.model = url.removesuffix("/v1/completions"), "m"
        t0 = time.perf_counter()
        out = await load_run(backend, [PROMPT], LoadPoint("concurrent", 1), LoadSettings(1.0))
        return out.results, time.perf_counter() - t0
    (result,), took = run_async(_serve(script, client_fn))
    assert result.error == "timed out after 1 s"
    assert took < 2.0


def test_the_openai_probe_has_a_total_deadline(monkeypatch):
    """The attach probe (httpx) used a per-read timeout only: a server dripping a comment every 0.2 s held it
    for ever. It now gives up after its deadline."""
    import kvbench.backends.openai.adapter as adapter
    monkeypatch.setattr(adapter, "PROBE_DEADLINE_S", 1.0)
    script = [CHUNKED_HEAD] + [chunk(b": drip\n"), 0.2] * 20

    async def client_fn(url):
        backend = OpenAIBackend("v1", None, {})
        backend.base_url, backend.model = url.removesuffix("/v1/completions"), "m"
        t0 = time.perf_counter()
        ok, why = await asyncio.to_thread(backend._try, {"prompt": "Hello"})
        return ok, why, time.perf_counter() - t0
    ok, why, took = run_async(_serve(script, client_fn))
    assert not ok and "no whole answer within 1 s" in why
    assert took < 2.5
