"""kvbench's fake of SGLang (tests/fakes/sglang_server.py) against SGLang's own wire format.

SGLang's own client cannot drive it here: ``import sglang`` (RuntimeEndpoint, sglang.lang) runs
``sglang/__init__.py``, which imports sglang.srt.utils and with it torch, and the wheel depends on CUDA-only
packages (sglang-kernel, flashinfer, ...): it does not install beside kvbench without them. So the
OpenAI-compatible endpoint is driven by the official ``openai`` client and every reply validated strictly
against its types (keys they do not model must be SGLang's own, from srt/entrypoints/openai/protocol.py),
and the native endpoints (/generate, /server_info, /metrics) are checked against schemas written from SGLang
0.5.23's source (cited in the fake's docstring): the keys and types of each event, the SSE framing, the
request the adapter sends against api/v1/api_types.py's SamplingParams."""
import json

import httpx
import openai
import pydantic
import pytest
from openai.types import Completion, Model
from prometheus_client.parser import text_string_to_metric_families

from kvbench.backends.sglang.adapter import SGLangBackend
from tests.fakes.sglang_server import SAMPLING_FIELDS, FakeSGLang
from tests.fakes.testkit import prompt, run, spec
from tests.backends.test_fake_conformance import unknown_keys

# Keys SGLang sends that the OpenAI types do not model (protocol.py CompletionResponseStreamChoice.matched_stop,
# UsageInfo.reasoning_tokens, ModelCard.root/parent/max_model_len).
SGLANG_EXTENSIONS = {"CompletionChoice": {"matched_stop"}, "CompletionUsage": {"reasoning_tokens"},
                     "Model": {"root", "parent", "max_model_len"}}
# srt/managers/tokenizer_manager.py _handle_batch_output: meta_info of a generation (metrics' time stats and
# logprobs only when asked for)
META_INFO = {"id": str, "finish_reason": (dict, type(None)), "prompt_tokens": int, "weight_version": str,
             "num_retractions": int, "reasoning_tokens": int, "completion_tokens": int, "cached_tokens": int}


def strict_problems(data: dict, cls: type[pydantic.BaseModel]) -> list[str]:
    try:
        cls.model_validate_json(json.dumps(data), strict=True)
        errors = []
    except pydantic.ValidationError as exc:
        errors = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return errors + unknown_keys(data, cls, unmodelled=SGLANG_EXTENSIONS)


def raw_events(url: str, body: dict) -> list:
    with httpx.stream("POST", url, json=body, timeout=10) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


@pytest.fixture
def fake():
    with FakeSGLang(served_model_name="smollm2", context_length=4096, token_delay_s=0) as f:
        yield f


def test_completions_stream_parses_in_the_official_client(fake):
    with openai.OpenAI(base_url=fake.url + "/v1", api_key="none", timeout=10, max_retries=0) as client:
        chunks = list(client.completions.create(model="smollm2", prompt=list(range(10)), max_tokens=5, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        (model,) = client.models.list().data
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * 4 + ["length"]
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (10, 5)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == " w1 w2 w3 w4 w5"
    assert isinstance(model, Model) and (model.id, model.owned_by) == ("smollm2", "sglang")
    assert model.model_extra["max_model_len"] == 4096


def test_completions_replies_are_strictly_the_official_types(fake):
    events = raw_events(fake.url + "/v1/completions", {"model": "smollm2", "prompt": [1, 2, 3], "max_tokens": 3,
                                                       "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    for i, event in enumerate(events[:-1]):
        event = json.loads(json.dumps(event))
        for choice in event["choices"]:
            if choice["finish_reason"] is None:
                choice["finish_reason"] = "length"  # null until the last chunk, as OpenAI's own streams
        assert strict_problems(event, Completion) == [], i
    assert set(events[0]) == {"id", "object", "created", "model", "choices", "usage"} and events[0]["usage"] is None
    assert set(events[-2]) == {"id", "object", "created", "model", "choices", "usage"}  # exclude_none: no sglext
    whole = httpx.post(fake.url + "/v1/completions", json={"model": "smollm2", "prompt": "a b", "max_tokens": 2}).json()
    assert strict_problems(whole, Completion) == []
    raw = httpx.get(fake.url + "/v1/models").json()
    assert raw["object"] == "list" and strict_problems(raw["data"][0], Model) == []


def test_generate_stream_is_sglangs_native_format(fake):
    body = {"input_ids": list(range(7)), "stream": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0}}
    events = raw_events(fake.url + "/generate", body)
    assert events[-1] == "[DONE]" and len(events) == 5
    for i, event in enumerate(events[:-1], 1):
        assert set(event) == {"text", "output_ids", "meta_info"}
        meta = event["meta_info"]
        assert set(meta) == set(META_INFO) and all(isinstance(meta[k], t) for k, t in META_INFO.items()), meta
        assert len(event["output_ids"]) == meta["completion_tokens"] == i  # cumulative
        assert isinstance(event["text"], str) and meta["prompt_tokens"] == 7
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * 3 + [{"type": "length", "length": 4}]
    assert len({e["meta_info"]["id"] for e in events[:-1]}) == 1
    # without ignore_eos a matched EOS ends it: FINISH_MATCHED_TOKEN
    fake.eos_after = 2
    stopped = raw_events(fake.url + "/generate", {**body, "sampling_params": {"max_new_tokens": 4}})
    assert stopped[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    whole = httpx.post(fake.url + "/generate", json={**body, "stream": False}).json()
    assert set(whole) == {"text", "output_ids", "meta_info"} and whole["meta_info"]["completion_tokens"] == 4


def test_generate_rejects_what_sglang_rejects(fake):
    bad = httpx.post(fake.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert bad.status_code == 400
    assert bad.json()["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`")
    events = raw_events(fake.url + "/generate", {"input_ids": list(range(4096)), "stream": True,
                                                 "sampling_params": {"max_new_tokens": 1}})
    assert events == [{"error": {"message": "The input (4096 tokens) is longer than the model's context length "
                                            "(4096 tokens).", "type": "invalid_request_error", "code": 400,
                                 "retryable": False}}, "[DONE]"]
    # unknown top-level keys are ignored (GenerateRequest: "unknown keys ignored")
    assert len(raw_events(fake.url + "/generate", {"input_ids": [1], "stream": True, "extra_thing": 1,
                                                   "sampling_params": {"max_new_tokens": 1}})) == 2


def test_the_adapters_request_is_a_valid_generate_request(fake, tmp_path):
    backend = SGLangBackend("0.5.23", tmp_path, {})
    backend.attach(spec(tmp_path), fake.url, timeout_s=5)
    (r,) = run(backend, [prompt(12, 3)])
    assert r.error is None
    sent = fake.last_request
    assert isinstance(sent["input_ids"], list) and all(isinstance(i, int) for i in sent["input_ids"])
    assert sent["stream"] is True and set(sent["sampling_params"]) <= set(SAMPLING_FIELDS)
    types = {"max_new_tokens": int, "ignore_eos": bool, "temperature": float}
    assert all(isinstance(sent["sampling_params"][k], t) for k, t in types.items())
    backend.stop()


def test_server_info_model_info_and_flush_cache(fake):
    info = httpx.get(fake.url + "/server_info").json()
    assert isinstance(info["max_total_num_tokens"], int) and info["version"] == "0.5.23" and info["status"] == "ready"
    for key in ("page_size", "mem_fraction_static", "context_length", "kv_cache_dtype", "launch_command",
                "internal_states", "max_req_input_len", "startup_time", "frontend"):
        assert key in info, key
    assert httpx.get(fake.url + "/get_server_info").json() == info
    assert httpx.get(fake.url + "/model_info").json()["is_generation"] is True
    assert httpx.get(fake.url + "/health").status_code == 200 == httpx.get(fake.url + "/health_generate").status_code
    assert httpx.post(fake.url + "/flush_cache").text.startswith("Cache flushed.\nPlease check backend logs")


def test_metrics_are_prometheus_client_families_with_sglangs_labels(fake):
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(fake.url + "/metrics").text)}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:num_used_tokens",
                 "sglang:kv_used_tokens", "sglang:max_total_num_tokens"):
        assert families[name].type == "gauge", name
        (sample,) = families[name].samples
        assert set(sample.labels) == {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
        assert sample.labels["engine_type"] == "unified" and sample.labels["model_name"] == "smollm2"
    assert families["sglang:num_retracted_requests"].type == "counter"
    assert "sglang:num_retracted_requests_total" in {s.name for s in families["sglang:num_retracted_requests"].samples}
    # the MFU counters (labelled, so shown once incremented) and the passes by mode, as 0.5.23's collector names them
    assert families["sglang:cuda_graph_passes"].type == families["sglang:estimated_read_bytes_per_gpu"].type == "counter"
    assert families["sglang:estimated_write_bytes_per_gpu"].type == "counter"
