"""The capability groups: what an adapter that leaves a group out gets, and what each engine declares."""
from pathlib import Path

import pytest

from kvbench.backends import REGISTRY
from kvbench.backends.capabilities import (
    Capabilities,
    KVQuantisation,
    MemoryWall,
    PrefixCache,
    ServedModel,
    Telemetry,
)
from kvbench.backends.types import EngineStartError


@pytest.mark.parametrize("engine", sorted(REGISTRY))
def test_every_engine_declares_each_group_as_its_type(engine):
    caps = REGISTRY[engine].capabilities
    assert isinstance(caps, Capabilities)
    for group, kind in (("prefix_cache", PrefixCache), ("kv_quantisation", KVQuantisation),
                        ("telemetry", Telemetry), ("served_model", ServedModel), ("memory_wall", MemoryWall)):
        assert isinstance(getattr(caps, group), kind), group


def test_a_group_left_out_does_nothing_and_says_so():
    backend = REGISTRY["hf"]("1", Path("/nonexistent"))  # declares KV quantisation only
    caps = backend.capabilities
    with pytest.raises(EngineStartError, match="the hf adapter cannot reset a prefix cache"):
        caps.prefix_cache.empty(backend)
    assert caps.prefix_cache.counters(backend, backend.http) is None
    assert not (caps.prefix_cache.switchable or caps.prefix_cache.reset or caps.prefix_cache.isolation_field)
    assert caps.served_model.models(backend) is None and caps.served_model.support(backend) == {}
    assert caps.memory_wall.record(backend) is None and caps.memory_wall.guard_restarts(backend) == []
    assert caps.telemetry.prometheus_metrics == {}
    assert caps.kv_quantisation.top_logprobs_max == 20 and caps.kv_quantisation.prompt_logprobs_source == ""
    backend.stop()


def test_what_the_engines_declare():
    caps = {engine: cls.capabilities for engine, cls in REGISTRY.items()}
    assert {e for e, c in caps.items() if c.prefix_cache.switchable} == {"vllm", "llamacpp", "sglang"}
    assert {e for e, c in caps.items() if c.prefix_cache.reset} == {"vllm", "llamacpp", "sglang"}
    assert {e: c.prefix_cache.isolation_field for e, c in caps.items() if c.prefix_cache.isolation_field} == {
        "vllm": "cache_salt"}
    assert {e: c.kv_quantisation.top_logprobs_max for e, c in caps.items() if c.kv_quantisation.top_logprobs_max} == {
        "hf": 20, "vllm": 20, "llamacpp": 20}
    assert {e for e, c in caps.items() if c.telemetry.prometheus_metrics} == {"vllm", "llamacpp", "sglang"}
