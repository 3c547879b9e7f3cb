"""The streaming client (backends/streaming.py) against a scripted server: what bytes arrive, in what
pieces, and how the stream ends. Correctness only; speed and timing accuracy are selfcheck/client_bench.py's."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from functools import partial

import pytest

from kvbench.backends import streaming
from kvbench.backends.streaming import (
    TRANSPORT_ERRORS,
    configure_endpoint,
    forget_endpoint,
    open_client,
    origin,
    stream_ndjson,
    stream_sse,
)
from kvbench.backends.types import RequestResult
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.load import run_async
from kvbench.workloads.prompts import Prompt

PROMPT = Prompt("r0", (1, 2, 3), "", 4)


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def token_event(ids, finish=None) -> bytes:
    return sse({"choices": [{"index": 0, "text": "x", "token_ids": ids, "finish_reason": finish}]})


USAGE = sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
DONE = sse(b"[DONE]")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
CLOSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


async def _serve(script, client_fn):
    """Run a server that answers every request with ``script`` (a list of bytes to write, floats to sleep,
    and "close" to drop the connection), and ``client_fn(url)`` against it."""
    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        for step in script:
            if step == "close":
                writer.transport.abort()
                return
            if isinstance(step, float):
                await asyncio.sleep(step)
            else:
                writer.write(step)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await client_fn(f"http://127.0.0.1:{port}/v1/completions")


def run_sse(script, handle=VLLMBackend._read_event, reader=stream_sse) -> RequestResult:
    async def client_fn(url):
        async with open_client(2, 10.0) as client:
            return await reader(client, url, {"prompt": [1, 2, 3]}, PROMPT, handle)
    return run_async(_serve(script, client_fn))


def recording_handle():
    calls = []

    def handle(event, now, result):
        calls.append((event, now))
        VLLMBackend._read_event(event, now, result)
    return calls, handle


def test_whole_stream_chunked():
    body = b"".join(chunk(e) for e in (token_event([5]), token_event([6]), token_event([7]), token_event([8], "length"),
                                       USAGE, DONE)) + b"0\r\n\r\n"
    r = run_sse([CHUNKED_HEAD + body])
    assert r.error is None
    assert r.chunk_tokens == [1, 1, 1, 1]
    assert r.prompt_tokens_reported == 3 and r.output_tokens_reported == 4
    assert r.engine_details["finish_reason"] == "length"
    assert r.t_sent <= r.chunk_times[0] <= r.t_done


def test_event_split_across_reads_is_stamped_when_complete():
    event = token_event([5, 6])
    calls, handle = recording_handle()
    t_before = time.perf_counter()
    r = run_sse([CHUNKED_HEAD, chunk(event[:20]), 0.05, chunk(event[20:] + USAGE + DONE) + b"0\r\n\r\n"], handle)
    assert r.error is None
    assert len(calls) == 2 and calls[0][0]["choices"][0]["token_ids"] == [5, 6]
    # the event was completed by the second read, 50 ms after the first piece
    assert calls[0][1] - t_before >= 0.045
    assert r.chunk_tokens == [2]


def test_several_events_in_one_read_share_one_stamp():
    calls, handle = recording_handle()
    body = b"".join(chunk(e) for e in (token_event([1]), token_event([2]), token_event([3, 4], "length"), USAGE, DONE))
    r = run_sse([CHUNKED_HEAD + body + b"0\r\n\r\n"], handle)
    assert r.error is None and r.chunk_tokens == [1, 1, 2]
    assert len({now for _, now in calls}) == 1


def test_events_in_separate_reads_get_their_own_stamps():
    r = run_sse([CHUNKED_HEAD, chunk(token_event([1])), 0.03, chunk(token_event([2])), 0.03,
                 chunk(USAGE + DONE) + b"0\r\n\r\n"])
    assert r.error is None and r.chunk_tokens == [1, 1]
    assert r.chunk_times[1] - r.chunk_times[0] >= 0.025


def test_multi_token_chunk_and_done_is_not_an_event():
    calls, handle = recording_handle()
    r = run_sse([CHUNKED_HEAD + chunk(token_event([1, 2, 3, 4], "length") + USAGE + DONE) + b"0\r\n\r\n"], handle)
    assert r.error is None and r.chunk_tokens == [4]
    assert len(calls) == 2  # the tokens and the usage; [DONE] is not handed to the adapter


def test_crlf_lines_and_comments():
    body = b": keep-alive\r\n\r\n" + token_event([1]).replace(b"\n", b"\r\n") + USAGE + DONE
    r = run_sse([CHUNKED_HEAD + chunk(body) + b"0\r\n\r\n"])
    assert r.error is None and r.chunk_tokens == [1]


def test_non_200_reports_status_and_body():
    body = b'{"error": "model not found"}'
    r = run_sse([b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body)])
    assert r.error == 'HTTP 404: {"error": "model not found"}'
    assert r.chunk_times == [] and r.t_done is not None


def test_non_200_body_is_cut_to_500_chars():
    body = b"x" * 2000
    r = run_sse([b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2000\r\n\r\n" + body])
    assert r.error == "HTTP 500: " + "x" * 500


def _failed(script) -> str:
    """The error a cut-off stream ends with: raised (a transport error) or set on the result."""
    try:
        r = run_sse(script)
    except TRANSPORT_ERRORS as exc:
        return f"{type(exc).__name__}: {exc}"
    assert r.error, "a cut-off stream must not look complete"
    return r.error


def test_chunked_stream_cut_off_between_events():
    assert _failed([CHUNKED_HEAD, chunk(token_event([1])), 0.02, chunk(token_event([2])), 0.02, "close"])


def test_chunked_stream_cut_off_inside_a_chunk():
    assert _failed([CHUNKED_HEAD, chunk(token_event([1])), 0.02, b"200\r\n" + token_event([2])[:30], 0.02, "close"])


def test_close_delimited_stream_cut_off_between_events():
    # no chunked encoding, no length: only the missing final event tells a cut from an end
    error = _failed([CLOSE_HEAD, token_event([1]), 0.02, token_event([2]), 0.02, "close"])
    assert "final event" in error
    # the adapter names its engine's final event in that error
    named = partial(stream_sse, final_event="TGI's final event (details)")
    r = run_sse([CLOSE_HEAD, token_event([1]), 0.02, "close"], reader=named)
    assert r.error == "stream ended before TGI's final event (details) (connection closed early)"


def test_close_delimited_stream_cut_off_inside_an_event():
    error = _failed([CLOSE_HEAD, token_event([1]), 0.02, token_event([2])[:25], 0.02, "close"])
    assert "inside an event" in error


def test_close_delimited_stream_that_ends_properly_is_complete():
    r = run_sse([CLOSE_HEAD, token_event([1]), token_event([2], "length"), USAGE])  # no [DONE], but usage
    assert r.error is None and r.chunk_tokens == [1, 1] and r.output_tokens_reported == 4


def test_error_event_is_kept():
    r = run_sse([CHUNKED_HEAD + chunk(sse({"error": {"message": "boom"}})) + b"0\r\n\r\n"])
    assert "boom" in r.error


def test_ndjson_stream():
    lines = [{"response": "a", "done": False}, {"response": "b", "done": False},
             {"response": "", "done": True, "prompt_eval_count": 3, "eval_count": 2}]
    calls = []

    def handle(event, now, result):
        calls.append(event)
        if event.get("response"):
            result.add_chunk(now, 1)
        if event.get("done"):
            result.prompt_tokens_reported = event["prompt_eval_count"]
            result.output_tokens_reported = event["eval_count"]

    body = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
    r = run_sse([head, chunk(body[:10]), 0.02, chunk(body[10:-1]), chunk(b"\n") + b"0\r\n\r\n"], handle, stream_ndjson)
    assert r.error is None and calls == lines and r.chunk_tokens == [1, 1] and r.output_tokens_reported == 2

    # the last line without its newline still counts; a cut-off one does not
    calls.clear()
    ndjson_close_head = CLOSE_HEAD.replace(b"text/event-stream", b"application/x-ndjson")
    r = run_sse([ndjson_close_head, body[:-1]], handle, stream_ndjson)
    assert r.error is None and r.output_tokens_reported == 2
    calls.clear()
    r = run_sse([ndjson_close_head, body[:-15]], handle, stream_ndjson)
    assert r.error and "inside an event" in r.error


def test_connection_refused_is_a_transport_error():
    async def go():
        async with open_client(1, 5.0) as client:
            return await stream_sse(client, "http://127.0.0.1:9/v1/completions", {}, PROMPT, VLLMBackend._read_event)
    with pytest.raises(TRANSPORT_ERRORS):
        run_async(go())


def test_works_on_the_default_event_loop_too():
    """The runner may call asyncio.run (no uvloop): the client does not depend on uvloop."""
    body = CHUNKED_HEAD + chunk(token_event([1, 2], "length") + USAGE + DONE) + b"0\r\n\r\n"

    async def client_fn(url):
        async with open_client(1, 10.0) as client:
            return await stream_sse(client, url, {}, PROMPT, VLLMBackend._read_event)
    r = asyncio.run(_serve([body], client_fn))
    assert r.error is None and r.chunk_tokens == [2]


def test_a_keep_alive_connection_the_server_dropped_is_resent_once():
    """The second request goes out on the pooled connection, which the server closes without answering
    (an idle keep-alive connection expiring just then): the client resends it on a fresh connection."""
    body = b"".join(chunk(e) for e in (token_event([5, 6, 7, 8], "length"), USAGE, DONE)) + b"0\r\n\r\n"
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        for n in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            await reader.readexactly(length)
            if n == 1:  # the reused connection: drop it unanswered
                writer.transport.abort()
                return
            writer.write(CHUNKED_HEAD + body)
            await writer.drain()

    async def go():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        async with server, open_client(1, 10.0) as client:
            first = await stream_sse(client, url, {}, PROMPT, VLLMBackend._read_event)
            second = await stream_sse(client, url, {}, PROMPT, VLLMBackend._read_event)
        return first, second

    first, second = run_async(go())
    assert first.error is None and second.error is None
    assert second.chunk_tokens == [4] and second.output_tokens_reported == 4
    assert second.engine_details.get("resent_on_fresh_connection") and "resent_on_fresh_connection" not in first.engine_details
    assert len(connections) == 2


def _page(content_type: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (content_type, len(body), body)


def test_a_200_reply_that_is_not_a_stream_says_what_it_is():
    """A login wall or proxy page (text/html), or a JSON body of a server that ignored "stream": not read
    as events, and not called a stream cut off inside an event."""
    page = b"<html><body>Sign in to continue</body></html>"
    calls, handle = recording_handle()
    r = run_sse([_page(b"text/html; charset=utf-8", page)], handle)
    assert r.error == ("HTTP 200 but content-type text/html, not an event stream (text/event-stream): "
                       "<html><body>Sign in to continue</body></html>")
    assert calls == [] and r.chunk_times == []
    r = run_sse([_page(b"application/json", b'{"choices": []}')], handle)
    assert r.error.startswith("HTTP 200 but content-type application/json, not an event stream")
    # a close-delimited page (no length) too, and for the NDJSON reader
    r = run_sse([CLOSE_HEAD.replace(b"text/event-stream", b"text/html"), b"<html>", 0.02, "close"], handle, stream_ndjson)
    assert r.error == "HTTP 200 but content-type text/html, not a JSON-lines stream (application/x-ndjson): <html>"
    assert calls == []


def test_a_stream_without_a_content_type_is_still_read():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    r = run_sse([head + chunk(token_event([1, 2], "length") + USAGE + DONE) + b"0\r\n\r\n"])
    assert r.error is None and r.chunk_tokens == [2]


def test_origin_has_the_scheme_and_its_default_port():
    assert origin("https://api.example.com/v1") == ("https", "api.example.com", 443)
    assert origin("http://user:pw@127.0.0.1/v1") == ("http", "127.0.0.1", 80)
    assert origin("HTTPS://h:8443") == ("https", "h", 8443)


def test_headers_of_the_endpoint_and_basic_auth_from_the_url_are_sent():
    body = chunk(token_event([1], "length") + USAGE + DONE) + b"0\r\n\r\n"
    heads = []

    async def handler(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            heads.append(head.decode())
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            await reader.readexactly(length)
            writer.write(CHUNKED_HEAD + body)
            await writer.drain()

    async def go():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        async with server, open_client(1, 10.0) as client:
            configure_endpoint(base, {"Authorization": "Bearer k-123"})
            try:
                results = [await stream_sse(client, base + "/v1/completions", {}, PROMPT, VLLMBackend._read_event)]
            finally:
                forget_endpoint(base)
            for url in (f"http://bob:p%40ss@127.0.0.1:{port}/v1/completions", base + "/v1/completions"):
                results.append(await stream_sse(client, url, {}, PROMPT, VLLMBackend._read_event))
            pools = list(client.idle)
        return port, results, pools

    port, results, pools = run_async(go())
    assert all(r.error is None for r in results)
    assert pools == [("http", "127.0.0.1", port)]  # one pool per (scheme, host, port)
    assert "\r\nAuthorization: Bearer k-123\r\n" in heads[0]
    assert f"\r\nHost: 127.0.0.1:{port}\r\n" in heads[1] and "bob" not in heads[1].replace("Basic", "")
    assert f"\r\nAuthorization: Basic {base64.b64encode(b'bob:p@ss').decode()}\r\n" in heads[1]
    assert "Authorization" not in heads[2]  # forgotten: the next server on that origin gets no key


def test_a_header_that_would_split_the_request_is_refused():
    with pytest.raises(ValueError, match="line break"):
        configure_endpoint("http://127.0.0.1:1", {"Authorization": "Bearer a\r\nX-Injected: 1"})
    assert origin("http://127.0.0.1:1") not in streaming._ENDPOINTS


def test_the_send_time_is_after_the_connection_it_had_to_open(monkeypatch):
    """A connection that takes 0.3 s to open (a slow handshake, stood in by a sleep) is not the server's
    latency: the request's send time is stamped as its bytes go out, after it."""
    connect = streaming.Client._connect

    async def slow_connect(self, key, tls=None):
        await asyncio.sleep(0.3)
        return await connect(self, key, tls)

    monkeypatch.setattr(streaming.Client, "_connect", slow_connect)
    started = time.perf_counter()
    result = run_sse([CHUNKED_HEAD, chunk(token_event([5, 6, 7, 8], "length")), chunk(USAGE), chunk(DONE), b"0\r\n\r\n"])
    assert result.error is None and result.chunk_tokens == [4]
    assert result.t_sent - started >= 0.3 and result.chunk_times[0] - result.t_sent < 0.3
