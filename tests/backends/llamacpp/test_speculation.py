"""llama-server's speculative decoding as the adapter reads it, from what a real llama-server 0.3.36 wrote
(tests/data/speculation/): a request's last /completion stream event (``timings.draft_n`` /
``draft_n_accepted``, with the draft-simple and the ngram-simple drafter) read by the adapter's own
``stream`` over a scripted server, and /metrics' ``llamacpp:spec_decode_num_*`` counters read by its
Speculation capability (backends/llamacpp/speculation.py). Against a running server:
test_speculation_engines.py."""
import asyncio
import json

from pathlib import Path

import httpx
import pytest

from kvbench.backends.llamacpp.adapter import LlamaCppBackend
from kvbench.backends.llamacpp.speculation import SPECULATION
from kvbench.backends.streaming import open_client
from kvbench.backends.types import EngineStartError, SpeculationCounters
from kvbench.common.models import ModelFiles
from kvbench.workloads.prompts import Prompt

from tests.helpers import DATA

FIXTURES = DATA / "speculation"
PROMPT = Prompt("copy-0", tuple(range(1, 47)), "", 24)  # the fixtures' request: 46 prompt tokens, 24 generated


def final_event(name: str) -> dict:
    return json.loads((FIXTURES / f"llamacpp_final_event_{name}.json").read_text())


def sse_body(final: dict) -> bytes:
    """The stream llama-server writes for the fixtures' request: token events with the running
    ``tokens_predicted`` (several tokens an event, as accepted drafts arrive together), then its final event."""
    events = [{"content": "x", "tokens": [7] * n, "stop": False, "tokens_predicted": upto}
              for n, upto in ((1, 1), (4, 5), (3, 8), (6, 14), (10, 24))]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in [*events, final])


def stream_through_adapter(final: dict):
    """``LlamaCppBackend.stream`` against a server that answers /completion with :func:`sse_body`."""
    body = sse_body(final)
    asked = {}

    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        asked["path"] = head.split(b" ")[1]
        asked["body"] = json.loads(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    async def go():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        backend = LlamaCppBackend(LlamaCppBackend.default_version, FIXTURES)
        backend.spec = type("Spec", (), {"prefix_caching": None})()
        backend.base_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, open_client(1, 10.0) as client:
            return await backend.stream(client, PROMPT)

    result = asyncio.run(go())
    assert asked["path"] == b"/completion" and asked["body"]["prompt"] == list(PROMPT.token_ids)
    return result


@pytest.mark.parametrize("name, drafted, accepted, drafter", [("draft", 23, 16, "draft-simple"),
                                                               ("ngram", 8, 5, "ngram-simple")])
def test_the_last_event_says_what_the_request_drafted(name, drafted, accepted, drafter):
    final = final_event(name)
    assert final["generation_settings"]["speculative.types"] == f"none,{drafter}"  # the fixture is what it says
    result = stream_through_adapter(final)
    assert result.error is None
    assert (result.spec_draft_tokens, result.spec_accepted_tokens) == (drafted, accepted)
    assert sum(result.chunk_tokens) == result.output_tokens_reported == 24
    assert result.prompt_tokens_reported == 46 and result.prompt_tokens_cached == 0
    assert result.engine_details["timings"]["draft_n"] == drafted


def test_a_request_that_drafted_nothing_reports_nothing():
    """llama-server sends draft_n only where it drafted for the request (a server without a drafter, or n-gram
    lookup that found nothing): the request's figures stay None, never 0 made up."""
    final = final_event("ngram")
    del final["timings"]["draft_n"], final["timings"]["draft_n_accepted"]
    result = stream_through_adapter(final)
    assert result.error is None and sum(result.chunk_tokens) == 24
    assert result.spec_draft_tokens is None and result.spec_accepted_tokens is None


def metrics_client(status: int, text: str) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(status, text=text)))


def test_the_metrics_page_is_read_into_the_counters():
    backend = LlamaCppBackend(LlamaCppBackend.default_version, FIXTURES)
    backend.base_url = "http://llama.test"
    page = (FIXTURES / "llamacpp_metrics_draft.txt").read_text()
    with metrics_client(200, page) as client:
        c = SPECULATION.counters(backend, client)
    assert isinstance(c, SpeculationCounters)
    # the same request as llamacpp_final_event_draft.json: 23 drafted, 16 accepted, in 7 verification steps
    assert (c.draft_tokens, c.accepted_tokens, c.drafts) == (23, 16, 7)
    assert "llamacpp:spec_decode_num_draft_tokens_total" in c.source
    # the per-position counters are not the totals: dropping the totals leaves nothing to read
    totals = {"llamacpp:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_accepted_tokens_total"}
    without = "\n".join(line for line in page.splitlines() if line.split(" ")[0] not in totals)
    with metrics_client(200, without) as client:
        assert SPECULATION.counters(backend, client) is None
    with metrics_client(404, "") as client:  # started without --metrics
        assert SPECULATION.counters(backend, client) is None


def test_the_flags_behind_each_method(tmp_path):
    backend = LlamaCppBackend(LlamaCppBackend.default_version, FIXTURES)
    args = SPECULATION.server_args
    assert args(backend, "none", None, None) == [] and args(backend, "", 4, None) == []
    assert args(backend, "ngram", None, None) == ["--spec-type", "ngram-simple"]
    assert args(backend, "ngram", 8, None) == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "8"]
    assert args(backend, "draft", 5, "/m/q4.gguf") == ["--spec-type", "draft-simple", "--model-draft", "/m/q4.gguf",
                                                      "--spec-draft-n-max", "5"]
    with pytest.raises(EngineStartError, match="no speculative decoding"):
        args(backend, "eagle", None, "/m/head.gguf")
    gguf = tmp_path / "d.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert SPECULATION.draft_problem(gguf) is None
    assert "not a GGUF file" in SPECULATION.draft_problem(FIXTURES / "llamacpp_metrics_draft.txt")
    assert "no such file" in SPECULATION.draft_problem(tmp_path / "missing.gguf")


@pytest.mark.parametrize("options, served", [
    ({}, "own"), ({"speculative": "ngram"}, "own"), ({"gguf": "/m/other.gguf"}, "/m/other.gguf"),
    # the default draft: the model's own GGUF drafts for the converted one, which gguf=converted serves plainly
    ({"speculative": "draft"}, "converted"), ({"gguf": "converted"}, "converted"),
    ({"speculative": "draft", "gguf": "converted"}, "converted"),
    ({"speculative": "draft", "draft_model": "/m/d.gguf"}, "own")])
def test_the_served_gguf_of_each_setting(options, served, tmp_path, monkeypatch):
    from dataclasses import replace

    from kvbench.backends.llamacpp.adapter import converted_gguf
    from kvbench.backends.llamacpp.speculation import drafter

    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    model = ModelFiles("smollm2", tmp_path / "hf", tmp_path / "own.q4_1.gguf", "ab" * 32, None)
    backend = LlamaCppBackend(LlamaCppBackend.default_version, FIXTURES, options=options)
    # None: the converter's GGUF of the HF folder, made once where converted_gguf says
    assert backend.served_gguf(model) == {"own": model.gguf_path, "converted": None}.get(served, Path(served))
    assert converted_gguf(model) == tmp_path / "models" / ("ab" * 8) / "smollm2.gguf"
    if options.get("speculative") == "draft":  # the default draft is the model's own GGUF, gguf=converted or not
        assert drafter(options, model)[1] == Path(options.get("draft_model") or model.gguf_path)
    with pytest.raises(EngineStartError, match="no GGUF of its own"):
        drafter({"speculative": "draft"}, replace(model, gguf_path=None))
