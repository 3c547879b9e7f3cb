"""kvbench's fake of an OpenAI-compatible server (tests/fakes/openai_server.py, vLLM's dialect), driven by the
official ``openai`` Python client, as tests/backends/test_fake_conformance.py drives the Ollama and TGI fakes by theirs.

The client itself is lenient: it builds its types without validating them and keeps unknown keys as extras,
so a fake whose replies drift (a field renamed, a number sent as a string) would still "parse". Each reply
is therefore also validated strictly against the client's own types (``openai.types``), and every key they do
not model must be one of vLLM's documented extensions (below)."""
import json

import httpx
import openai
import pydantic
import pytest
from openai.types import Completion, CompletionUsage, Model

from tests.fakes.openai_server import FakeOpenAI
from tests.backends.test_fake_conformance import unknown_keys

# Keys vLLM sends that the OpenAI types do not model (vllm/entrypoints/openai/completion/protocol.py
# CompletionResponseStreamChoice, CompletionStreamResponse; vllm/entrypoints/serve/engine/protocol.py ModelCard).
VLLM_EXTENSIONS = {"Completion": {"metrics"}, "CompletionChoice": {"stop_reason", "token_ids", "prompt_token_ids"},
                   "Model": {"root", "parent", "max_model_len", "permission"}}


def strict_problems(data: dict, cls: type[pydantic.BaseModel]) -> list[str]:
    """What is wrong with ``data`` as ``cls``: strict validation errors (no coercion) and unknown keys."""
    try:
        cls.model_validate_json(json.dumps(data), strict=True)
        errors = []
    except pydantic.ValidationError as exc:
        errors = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return errors + unknown_keys(data, cls, unmodelled=VLLM_EXTENSIONS)


def raw_events(fake: FakeOpenAI, body: dict) -> list:
    """The SSE ``data:`` payloads of one streamed completion as sent, the ``[DONE]`` sentinel included."""
    with httpx.stream("POST", fake.url + "/v1/completions", json=body, timeout=10) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):]) for line in lines]


def stream_problems(events: list) -> list[str]:
    """Every event of a stream against ``openai.types.Completion``. The SDK shares that type with the
    non-streamed reply, whose ``finish_reason`` is never null; in a stream (OpenAI's own too) it is null
    until the last content chunk, so a null there is checked as null and the rest strictly."""
    out = []
    for i, event in enumerate(events):
        event = json.loads(json.dumps(event))
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("finish_reason") is None:
                choice["finish_reason"] = "length"  # the only relaxation: a null finish_reason mid-stream
        out += [f"event {i}: {p}" for p in strict_problems(event, Completion)]
    return out


@pytest.fixture
def client():
    made = []

    def make(fake: FakeOpenAI, api_key: str = "sk-none") -> openai.OpenAI:
        c = openai.OpenAI(base_url=fake.url + "/v1", api_key=api_key, timeout=10, max_retries=0)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def test_models_list_parses_in_the_official_client(client):
    with FakeOpenAI(model="smollm2", max_model_len=4096) as fake:
        (model,) = client(fake).models.list().data
        raw = httpx.get(fake.url + "/v1/models").json()
    assert isinstance(model, Model) and (model.id, model.object, model.owned_by) == ("smollm2", "model", "vllm")
    assert isinstance(model.created, int) and model.model_extra["max_model_len"] == 4096
    assert raw["object"] == "list" and len(raw["data"]) == 1
    assert strict_problems(raw["data"][0], Model) == []


def test_a_streamed_completion_with_usage_parses_in_the_official_client(client):
    with FakeOpenAI(token_delay_s=0) as fake:
        chunks = list(client(fake).completions.create(model="smollm2", prompt="a b c d", max_tokens=5, stream=True,
                                                      stream_options={"include_usage": True}))
        sent = fake.last_request
        events = raw_events(fake, {**sent})
    # what the official client sent is what the fake read
    assert (sent["model"], sent["prompt"], sent["max_tokens"], sent["stream"]) == ("smollm2", "a b c d", 5, True)
    assert sent["stream_options"] == {"include_usage": True}
    # five content chunks, one token each, then the usage chunk: no choices, the counts
    assert all(isinstance(c, Completion) and c.object == "text_completion" for c in chunks)
    *content, final = chunks
    assert len(content) == 5 and all(len(c.choices) == 1 and c.usage is None for c in content)
    assert [c.choices[0].index for c in content] == [0] * 5 and all(c.choices[0].text for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * 4 + ["length"]
    assert len({c.id for c in chunks}) == 1 and {c.model for c in chunks} == {"smollm2"}
    assert final.choices == [] and isinstance(final.usage, CompletionUsage)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.total_tokens) == (4, 5, 9)
    # the wire: the same events, each valid as the client's type, then [DONE]
    assert events[-1] == "[DONE]" and len(events) == len(chunks) + 1
    assert stream_problems(events[:-1]) == []
    assert events[-2]["choices"] == [] and set(events[-2]["usage"]) <= set(CompletionUsage.model_fields)


def test_without_include_usage_the_stream_has_no_usage_chunk(client):
    with FakeOpenAI(token_delay_s=0) as fake:
        chunks = list(client(fake).completions.create(model="smollm2", prompt="a b", max_tokens=3, stream=True))
    assert len(chunks) == 3 and all(len(c.choices) == 1 and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_token_id_prompts_and_vllm_extensions_as_the_official_client_reads_them(client):
    """kvbench's requests: the prompt as token ids, ignore_eos and return_token_ids (vLLM's extra body
    fields, sent with the client's ``extra_body``), several tokens a chunk, a stop before max_tokens."""
    with FakeOpenAI(token_delay_s=0, tokens_per_chunk=2, eos_after=3) as fake:
        c = client(fake)
        ids = list(range(7))
        stopped = list(c.completions.create(model="smollm2", prompt=ids, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
        full = list(c.completions.create(model="smollm2", prompt=ids, max_tokens=8, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True, "return_token_ids": True}))
        assert fake.last_request["prompt"] == ids and fake.last_request["ignore_eos"] is True
        events = raw_events(fake, fake.last_request)
    assert [ch.choices[0].finish_reason for ch in stopped[:-1]] == [None, "stop"]  # 2 + 1 tokens, then eos
    assert (stopped[-1].usage.prompt_tokens, stopped[-1].usage.completion_tokens) == (7, 3)
    content = full[:-1]
    assert [ch.choices[0].finish_reason for ch in content] == [None, None, None, "length"]
    assert [ch.choices[0].model_extra["token_ids"] for ch in content] == [[1000, 1001], [1002, 1003], [1004, 1005],
                                                                          [1006, 1007]]
    assert full[-1].usage.completion_tokens == 8
    assert stream_problems(events[:-1]) == [] and events[-1] == "[DONE]"


def test_errors_are_the_official_clients_exceptions(client):
    with FakeOpenAI(max_model_len=16) as fake:
        c = client(fake)
        with pytest.raises(openai.NotFoundError) as missing:
            list(c.completions.create(model="nope", prompt="a", max_tokens=2, stream=True))
        with pytest.raises(openai.BadRequestError) as too_long:
            list(c.completions.create(model="smollm2", prompt="a b c d", max_tokens=20, stream=True))
    assert missing.value.status_code == 404 and missing.value.body["type"] == "NotFoundError"
    assert missing.value.message == "Error code: 404 - The model `nope` does not exist."  # read from error.message
    assert too_long.value.status_code == 400
    assert "maximum context length is 16 tokens. However, you requested 24 tokens" in too_long.value.body["message"]


def test_an_api_key_is_sent_and_a_wrong_one_refused_as_openai_does(client):
    with FakeOpenAI(token_delay_s=0, require_auth="Bearer sk-right") as fake:
        with pytest.raises(openai.AuthenticationError) as refused:
            client(fake, api_key="sk-wrong").models.list()
        (model,) = client(fake, api_key="sk-right").models.list().data
        chunks = list(client(fake, api_key="sk-right").completions.create(model="smollm2", prompt="a", max_tokens=2,
                                                                          stream=True))
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert refused.value.body["message"] == "Incorrect API key provided"
    assert model.id == "smollm2" and len(chunks) == 2
    assert fake.auth_seen == ["Bearer sk-wrong", "Bearer sk-right", "Bearer sk-right"]


def test_a_server_of_another_dialect_refuses_vllm_extensions_and_id_prompts_as_the_client_reads_it(client):
    with FakeOpenAI(vllm_extensions=False, token_id_prompts=False) as fake:
        c = client(fake)
        with pytest.raises(openai.BadRequestError) as extension:
            list(c.completions.create(model="smollm2", prompt="a", max_tokens=2, stream=True,
                                      extra_body={"ignore_eos": True, "min_tokens": 2}))
        with pytest.raises(openai.BadRequestError) as ids:
            list(c.completions.create(model="smollm2", prompt=[1, 2, 3], max_tokens=2, stream=True))
        # what it does take still parses: a text prompt with usage in the stream
        events = list(c.completions.create(model="smollm2", prompt="a b", max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}))
    assert extension.value.status_code == 400 and extension.value.body["type"] == "invalid_request_error"
    assert extension.value.body["message"] == "Unrecognized request argument supplied: ignore_eos"
    assert ids.value.status_code == 400 and ids.value.body["param"] == "prompt"
    assert events[-1].usage.completion_tokens == 2 and events[-1].usage.prompt_tokens == 2
