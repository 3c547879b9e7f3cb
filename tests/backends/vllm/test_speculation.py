"""vLLM's speculative decoding as the adapter reads it (backends/vllm/speculation.py): the ``vllm:spec_decode_*``
counters of /metrics and the ``--speculative-config`` behind each method.

tests/data/speculation/vllm_metrics_ngram.txt is vLLM 0.32.0's own exposition: its SpecDecodingProm
(vllm/v1/spec_decode/metrics.py) made in the vllm-0.32.0 environment with the labels its loggers give
(``model_name``, ``engine``) for two engines (data parallel), 3 speculative tokens, observed with
SpecDecodingStats.observe_draft: engine 0 four drafts of 3 tokens accepting 3, 1, 0 and 2, engine 1 drafts of 3
and 2 tokens accepting all; then prometheus_client's generate_latest, the spec_decode lines kept. So the page
holds 6 drafts, 17 draft tokens and 11 accepted, beside the ``_created`` gauges and the per-position counters
that must not be added in."""
import json

import httpx

from kvbench.backends.types import SpeculationCounters
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.backends.vllm.speculation import DEFAULT_TOKENS, SPECULATION
from kvbench.run.speculation import counter_rise

from tests.helpers import DATA

PAGE = (DATA / "speculation" / "vllm_metrics_ngram.txt").read_text()


def backend() -> VLLMBackend:
    b = VLLMBackend(VLLMBackend.default_version, DATA)
    b.base_url = "http://vllm.test"
    return b


def read(page: str, status: int = 200) -> SpeculationCounters | None:
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(status, text=page))) as client:
        return SPECULATION.counters(backend(), client)


def test_the_counters_are_summed_over_engines():
    c = read(PAGE)
    assert (c.draft_tokens, c.accepted_tokens, c.drafts) == (17, 11, 6)
    assert c.source.startswith("vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total, "
                               "vllm:spec_decode_num_drafts_total")


def test_a_cell_is_the_rise_between_two_pages():
    """The page before the cell, with engine 1's counters still at 0: the cell drafted 5 and accepted 5 in 2
    steps (engine 1's whole share)."""
    before = PAGE
    for name, value in (("drafts_total", "2.0"), ("draft_tokens_total", "5.0"), ("accepted_tokens_total", "5.0")):
        before = before.replace(f'vllm:spec_decode_num_{name}{{engine="1",model_name="smollm2"}} {value}',
                                f'vllm:spec_decode_num_{name}{{engine="1",model_name="smollm2"}} 0.0')
    assert before != PAGE
    d = counter_rise(read(before), read(PAGE))
    assert (d.draft_tokens, d.accepted_tokens, d.drafts) == (5, 5, 2)


def test_a_server_without_a_drafter_exports_none():
    """vLLM registers the counters only with a speculative config (SpecDecodingProm: spec_decoding_enabled)."""
    plain = 'vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0\n'
    assert read(plain) is None
    per_position_only = "\n".join(line for line in PAGE.splitlines() if "per_pos" in line or line.startswith("#"))
    assert read(per_position_only) is None


def test_the_speculative_config_behind_each_method():
    """Each method as vLLM 0.32 names it (vllm/config/speculative.py: SpeculativeMethod has "ngram" and
    "draft_model", its EagleModelTypes "eagle"); vLLM has no default token count, kvbench passes one."""
    b = backend()
    args = SPECULATION.server_args
    assert args(b, "none", None, None) == []
    flag, config = args(b, "ngram", None, None)
    assert flag == "--speculative-config"
    assert json.loads(config) == {"method": "ngram", "num_speculative_tokens": DEFAULT_TOKENS}
    _, config = args(b, "draft", 5, "/m/smollm2")
    assert json.loads(config) == {"method": "draft_model", "num_speculative_tokens": 5, "model": "/m/smollm2"}
    _, config = args(b, "eagle", 2, "/m/eagle-head")
    assert json.loads(config) == {"method": "eagle", "num_speculative_tokens": 2, "model": "/m/eagle-head"}

