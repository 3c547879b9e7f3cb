import base64

import pytest

from kvbench.common.redact import redact_text, redact_url
from kvbench.run.backend_config import BackendConfig, ConfigError


def test_parse_engine_version_and_options():
    cfg = BackendConfig.parse("vllm@0.33.0:enforce_eager=false,block_size=16,extra_args=x")
    assert (cfg.engine, cfg.version, cfg.label) == ("vllm", "0.33.0", "vllm-0.33.0")
    assert cfg.options == {"enforce_eager": False, "block_size": 16, "extra_args": "x"}


def test_default_version_comes_from_the_adapter():
    from kvbench.backends.llamacpp.adapter import LlamaCppBackend
    assert BackendConfig.parse("llamacpp").version == LlamaCppBackend.default_version


def test_unknown_engine_lists_allowed():
    with pytest.raises(ConfigError, match="allowed: hf, llamacpp, ollama, openai, sglang, tgi, vllm"):
        BackendConfig.parse("trtllm")


def test_option_without_value():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        BackendConfig.parse("hf:threads")


# --- credentials: never in a dump, a label or an error; API keys only from an environment variable ------

def test_userinfo_is_split_out_of_the_url_and_never_dumped():
    cfg = BackendConfig.parse("openai:url=https://alice:s3cr%40t@api.example.com:8443/v1")
    assert cfg.url == "https://api.example.com:8443/v1"
    assert cfg.label == "openai@api.example.com:8443"
    assert cfg.credentials.get_secret_value() == "alice:s3cr@t"  # percent-decoded
    for shown in (repr(cfg), str(cfg), cfg.model_dump_json(), str(cfg.model_dump())):
        assert "s3cr" not in shown and "alice" not in shown
    assert cfg.auth_headers() == {"Authorization": "Basic " + base64.b64encode(b"alice:s3cr@t").decode()}
    assert BackendConfig.parse("openai:url=http://127.0.0.1:8000").auth_headers() == {}


def test_api_key_comes_from_the_environment_variable_named(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-abc")
    cfg = BackendConfig.parse("vllm:url=https://u:pw@h.example,api_key_env=MY_KEY")
    assert cfg.options == {"api_key_env": "MY_KEY"}  # the name is recorded, never the value
    assert cfg.auth_headers() == {"Authorization": "Bearer sk-abc"}  # the key wins over the userinfo
    assert "sk-abc" not in cfg.model_dump_json() + repr(cfg)
    monkeypatch.setenv("MY_KEY", "")
    with pytest.raises(ConfigError, match="environment variable MY_KEY is not set or empty"):
        cfg.auth_headers()
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(ConfigError, match="environment variable MY_KEY is not set or empty"):
        BackendConfig.parse("openai:url=http://h:1,api_key_env=MY_KEY")  # at parse time, before any run
    monkeypatch.setenv("MY_KEY", "a\nX-Injected: 1")
    with pytest.raises(ConfigError, match="line break"):
        cfg.auth_headers()


@pytest.mark.parametrize("text, message", [
    ("openai:url=http://h:1,api_key=sk-PLAIN", "option 'api_key' in .* would write a secret into the results: "
                                               ".*api_key_env=NAME"),
    ("tgi:url=http://h:1,token=sk-PLAIN", "option 'token'"),
    ("openai:url=http://h:1/?api_key=sk-PLAIN", "must not have a query .*api_key_env=NAME"),
    ("openai:url=http://h:1,api_key_env=sk-PLAIN", "must be the name of an environment variable"),
    ("openai:api_key_env=KEY", "api_key_env .* is for a server kvbench attaches to: give url="),
    ("openai:url=ftp://h:1", "must look like http://host:port or https://host"),
    ("openai:url=http://u:sk-PLAIN@h:port", "must look like http://host:port"),
    ("openai:url=http://h:1,ca_bundle=/etc/hostname", "ca_bundle .* is for an https url"),
    ("openai:url=https://h,ca_bundle=/no/such/ca.pem", "ca_bundle=/no/such/ca.pem .*: no such file"),
])
def test_bad_credentials_options_are_refused_without_echoing_a_secret(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        BackendConfig.parse(text)
    assert "PLAIN" not in str(info.value)


def test_ca_bundle_is_kept_as_a_path(tmp_path):
    bundle = tmp_path / "ca.pem"
    bundle.write_text("not checked here")
    cfg = BackendConfig.parse(f"openai:url=https://h.example,ca_bundle={bundle}")
    assert cfg.options == {"ca_bundle": str(bundle)}


def test_redact_url_and_text():
    assert redact_url("https://u:pw@h:8443/v1?api_key=k&n=2&access_token=t") == \
        "https://***@h:8443/v1?api_key=***&n=2&access_token=***"
    assert redact_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    command = ("kvbench run -b openai:url=http://user:pw1@127.0.0.1:9/x,api_key_env=K,max_num_batched_tokens=8,"
               "token=pw2 --url https://a:pw3@h")
    shown = redact_text(command)
    assert not any(s in shown for s in ("pw1", "pw2", "pw3"))
    assert shown == ("kvbench run -b openai:url=http://***@127.0.0.1:9/x,api_key_env=K,max_num_batched_tokens=8,"
                     "token=*** --url https://***@h")
