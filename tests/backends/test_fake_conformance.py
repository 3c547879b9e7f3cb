"""kvbench's fakes of Ollama and TGI, driven by the engines' official clients: the ``ollama`` package and
huggingface_hub's ``InferenceClient`` (TGI's client now: the old ``text-generation`` package requires
huggingface-hub < 1.0 and cannot be installed beside kvbench). A fake whose replies drift from the real wire
format fails here: a reply the official client cannot parse, a field it requires missing or of the wrong
type, or a key the official types do not know (the clients themselves ignore unknown keys, so a renamed
field would otherwise pass as "absent")."""
import hashlib
import json
import typing

import gguf
import httpx
import ollama
import pydantic
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as TGIValidationError

from tests.fakes.ollama_server import FakeOllama
from tests.fakes.tgi_server import FakeTGI

# --- Ollama --------------------------------------------------------------------------------------------

# Keys real Ollama sends that the Python client's types do not model (api/types.go ListModelResponse.Name).
OLLAMA_UNMODELLED = {"ListResponse.Model": {"name"}}


def _model_in(annotation):
    """The pydantic model inside an annotation such as Optional[Sequence[Model]], or None."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if found := _model_in(arg):
            return found
    return None


def unknown_keys(data: dict, cls: type[pydantic.BaseModel], path: str = "",
                 unmodelled: dict[str, set[str]] = OLLAMA_UNMODELLED) -> list[str]:
    """Keys of ``data`` that ``cls`` (an official client type) has no field for, recursively, except those
    ``unmodelled`` allows for a class (by its qualified name)."""
    fields = {(f.alias or name): f for name, f in cls.model_fields.items()}
    allowed = unmodelled.get(cls.__qualname__, set())
    out = []
    for key, value in data.items():
        if key not in fields:
            if key not in allowed:
                out.append(path + key)
            continue
        sub = _model_in(fields[key].annotation)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if sub and isinstance(item, dict):
                out += unknown_keys(item, sub, f"{path}{key}.", unmodelled)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(30)
    w.add_head_count(9)
    w.add_head_count_kv(3)
    w.add_embedding_length(576)
    w.add_context_length(8192)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def ollama_fake(tmp_path, tiny_gguf):
    with FakeOllama(models_dir=tmp_path / "models", log_file=open(tmp_path / "fake.log", "w"), token_delay_s=0) as f:
        client = ollama.Client(host=f.url, timeout=10)
        digest = client.create_blob(tiny_gguf)
        assert digest == "sha256:" + hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
        yield f, client, digest
        client.close()


def test_ollama_import_and_listing_parse_in_the_official_client(ollama_fake):
    fake, client, digest = ollama_fake
    progress = list(client.create("m1", files={"tiny.gguf": digest}, stream=True))
    assert all(isinstance(p, ollama.ProgressResponse) for p in progress) and progress[-1].status == "success"
    assert client.create("m2", files={"tiny.gguf": digest}, stream=False).status == "success"
    listed = client.list()
    assert {m.model for m in listed.models} == {"m1:latest", "m2:latest"}
    assert all(m.size > 0 and m.modified_at and m.details.format == "gguf" for m in listed.models)
    assert unknown_keys(httpx.get(fake.url + "/api/tags").json(), ollama.ListResponse) == []


def test_ollama_show_ps_and_version_parse_in_the_official_client(ollama_fake):
    fake, client, digest = ollama_fake
    client.create("m", files={"tiny.gguf": digest}, stream=False)
    shown = client.show("m")
    assert shown.modelinfo["llama.attention.head_count_kv"] == 3 and shown.modified_at is not None
    assert unknown_keys(httpx.post(fake.url + "/api/show", json={"model": "m"}).json(), ollama.ShowResponse) == []
    assert client.ps().models == []
    loaded = client.generate("m", "", keep_alive=-1, options={"num_ctx": 512})  # an empty prompt loads it
    assert loaded.done and loaded.done_reason == "load"
    (running,) = client.ps().models
    assert (running.name, running.model, running.context_length) == ("m:latest", "m:latest", 512)
    assert running.size > 0 and running.size_vram == 0 and running.expires_at is not None
    assert unknown_keys(httpx.get(fake.url + "/api/ps").json(), ollama.ProcessResponse) == []
    version = client._request_raw("GET", "/api/version").json()  # the client has no version call
    assert set(version) == {"version"} and version["version"].count(".") == 2


def test_ollama_generate_stream_parses_in_the_official_client(ollama_fake):
    fake, client, digest = ollama_fake
    client.create("m", files={"tiny.gguf": digest}, stream=False)
    parts = list(client.generate("m", " a b c d", raw=True, stream=True, keep_alive=-1,
                                 options={"num_ctx": 512, "num_predict": 6, "temperature": 0}))
    assert all(isinstance(p, ollama.GenerateResponse) for p in parts)
    *tokens, final = parts
    assert [p.done for p in tokens] == [False] * 6 and all(p.response for p in tokens)
    assert final.done and final.done_reason == "length" and final.response == ""
    assert (final.prompt_eval_count, final.eval_count) == (4, 6)
    assert all(isinstance(getattr(final, k), int) for k in ("total_duration", "load_duration",
                                                           "prompt_eval_duration", "eval_duration"))
    with httpx.stream("POST", fake.url + "/api/generate", json={"model": "m", "prompt": " a", "raw": True,
                                                                "options": {"num_predict": 2}}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert all(unknown_keys(json.loads(line), ollama.GenerateResponse) == [] for line in lines)


def test_ollama_errors_are_the_official_clients_response_errors(ollama_fake):
    fake, client, digest = ollama_fake
    with pytest.raises(ollama.ResponseError) as missing:
        list(client.generate("nope", " a", stream=True))
    assert missing.value.status_code == 404 and "not found" in missing.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.show("nope")
    assert unknown.value.status_code == 404
    fake.error_after = 2
    client.create("m", files={"tiny.gguf": digest}, stream=False)
    with pytest.raises(ollama.ResponseError, match="error was encountered while running the model"):
        list(client.generate("m", " a b", stream=True, options={"num_predict": 5}))


# --- TGI -----------------------------------------------------------------------------------------------

# router/src/lib.rs ``Info``: the fields and their JSON types (None: the value may be null).
TGI_INFO = {"model_id": str, "model_sha": (str, None), "model_pipeline_tag": (str, None),
            "max_concurrent_requests": int, "max_best_of": int, "max_stop_sequences": int,
            "max_input_tokens": int, "max_total_tokens": int, "validation_workers": int,
            "max_client_batch_size": int, "router": str, "version": str, "sha": (str, None),
            "docker_label": (str, None)}


def _types(annotation) -> tuple:
    return tuple(a for a in typing.get_args(annotation) if a is not type(None)) or (annotation,)


def problems(obj, path: str = "") -> list[str]:
    """Against huggingface_hub's TGI types (dataclasses generated from TGI's OpenAPI spec): a required
    field missing or of the wrong type, or a key the spec does not have (the client keeps those as extras)."""
    out = [f"{path}{k}: not in the spec" for k in set(obj) - set(obj.__dataclass_fields__)]
    hints = typing.get_type_hints(type(obj))
    for name, f in obj.__dataclass_fields__.items():
        value, annotation = getattr(obj, name), hints[name]
        optional = type(None) in typing.get_args(annotation)
        if value is None:
            if not optional:
                out.append(f"{path}{name}: required, missing")
            continue
        types = _types(annotation)
        if hasattr(value, "__dataclass_fields__"):
            out += problems(value, f"{path}{name}.")
        elif typing.get_origin(types[0]) is typing.Literal or str(types[0]).startswith("typing.Literal"):
            if value not in typing.get_args(types[0]):
                out.append(f"{path}{name}: {value!r} not one of {typing.get_args(types[0])}")
        elif all(isinstance(t, type) for t in types) and not isinstance(value, types):
            if not (float in types and isinstance(value, int)):
                out.append(f"{path}{name}: {type(value).__name__}, not {types}")
    return out


@pytest.fixture
def tgi_client(monkeypatch):
    # huggingface_hub refuses every request in offline mode, even to a local server; the tests set it
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)

    def make(fake):
        return InferenceClient(model=fake.url, provider="hf-inference", timeout=10)
    return make


def test_tgi_info_has_the_routers_fields(tgi_client):
    with FakeTGI() as fake:
        fake.sha = "0123456789abcdef0123"
        info = tgi_client(fake).get_endpoint_info()
    assert set(info) == set(TGI_INFO)
    for key, kind in TGI_INFO.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        assert (info[key] is None and None in kinds) or isinstance(info[key], tuple(k for k in kinds if k)), key


def test_tgi_stream_with_details_parses_in_the_official_client(tgi_client):
    with FakeTGI(token_delay_s=0) as fake:
        client = tgi_client(fake)  # held: the stream closes with the client
        events = list(client.text_generation("a b c d e", max_new_tokens=5, stream=True, details=True))
    assert len(events) == 5 and [e.index for e in events] == [1, 2, 3, 4, 5]
    for e in events:
        assert problems(e) == [], problems(e)
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    last = events[-1]
    assert last.details.finish_reason == "length" and last.details.generated_tokens == 5
    assert last.details.input_length == 6  # five words and the BOS the client did not turn off
    assert last.generated_text == "".join(e.token.text for e in events)


def test_tgi_eos_and_error_events_as_the_official_client_reads_them(tgi_client):
    with FakeTGI(token_delay_s=0, eos_after=3) as fake:
        client = tgi_client(fake)
        events = list(client.text_generation("a b", max_new_tokens=8, stream=True, details=True))
    assert events[-1].token.special and events[-1].details.finish_reason == "eos_token"
    assert all(problems(e) == [] for e in events)
    with FakeTGI(max_input_tokens=10, max_total_tokens=12) as fake:
        with pytest.raises(TGIValidationError, match="must be <= 12"):
            client = tgi_client(fake)
            list(client.text_generation("a b c d e f", max_new_tokens=8, stream=True, details=True))
