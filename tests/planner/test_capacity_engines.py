"""Issue 21 item 6: the engines' own capacity equals the planner's, for the embedded model and every
validation family (real engines: llama.cpp once per model, vLLM once per KV layout it sees).

- vLLM, started through its adapter with ``--kv-cache-memory-bytes B --max-model-len L``: the blocks its pool
  has (/metrics cache_config_info) and its log line "CPU KV cache size: N tokens, Maximum concurrency for L
  tokens per request: X.XXx" (v1/core/kv_cache_utils.py update_kv_cache_capacity: X = num_blocks / the
  blocks one request at L takes, every group; N = int(X x L)) against :func:`kvbench.planner.capacity.capacity`
  of the same deployment (device cpu, bf16, the same L and B); the requests at L vLLM serves at once (its
  blocks less the null block, over the blocks per request) against ``plan``'s max concurrency for a GPU of B
  bytes with no weights, overhead or margin.
- llama.cpp, started with ``-c L x S -np S``: its ``llama_kv_cache: size = ... (N cells, L layers, S/S seqs)``
  lines (``-lv 4``) against the rules' cells (n_ctx padded to 256, each slot's cells padded to 256, the window
  cache of SWA models), the planner's sequences in that pool, ``plan``'s -c/-np advice and its max
  concurrency for a budget of the KV bytes llama.cpp logged.

The families are built here on a fresh machine (kvbench.run.validate.prepare, cached under
$KVBENCH_HOME/families, about 40 s once).
"""
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.backends.llamacpp.adapter import LlamaCppBackend, parse_kv_log
from kvbench.backends.types import ServerSpec
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.kv.units import GIB, MIB
from kvbench.planner import PlanInput, plan, resolve_model, setup
from kvbench.planner.capacity import capacity
from kvbench.run.validate import families, prepare

from tests.helpers import engine_env

pytestmark = pytest.mark.engine

MODELS = ["smollm2", *(f.name for f in families())]

# vLLM: a limit that is no multiple of its block (128 on a CPU, 16 for MLA there), so whole blocks and the
# int() of its token figure matter; 57 blocks (3 x 19: the full-attention and MLA requests at 300 tokens take
# 3 and 19 blocks) and half a block more, so the budget's floor and the null block both change the answers.
VLLM_LIMIT = 300
VLLM_BLOCKS = 57
# llama.cpp: 3 slots of 900 tokens: -c 2700, n_ctx padded to 2816, 938 cells a slot padded to 1024; the window
# cache (64-token windows + a 512-token ubatch) padded to 768, under the slot's 1024
LLAMA_LIMIT, LLAMA_SLOTS = 900, 3

VLLM_LINE = re.compile(r"KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for (?P<limit>[\d,]+) "
                       r"tokens per request: (?P<x>[\d.]+)x")

# vLLM sizes what one request takes by its admission cap (v1/kv_cache_interface.py, 0.32.0): a sliding group
# cdiv(min(sliding_window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1 blocks
# (SlidingWindowSpec.max_admission_blocks_per_request), a chunked group
# cdiv(min(attention_chunk_size + max_in_flight_tokens, max_model_len), block_size)
# (ChunkedLocalAttentionSpec); max_in_flight_tokens is max_num_batched_tokens on a CPU (no async scheduling).
# The planner counts it too (VLLMKV.admission_blocks), not the blocks held past the window (VLLMKV.held_blocks).
VLLM_WINDOW_FAMILIES = {"window_mistral", "hybrid_gemma2", "hybrid_gemma3", "sinks_gptoss", "chunked_llama4"}


# A vLLM start costs 20-40 s of a 2-core machine (two interpreters importing torch and vLLM), so vLLM starts
# once per KV layout it sees. With a budget of 57 of its own blocks and a half, a model whose layers all
# keep every token (one KV cache group) gives the embedded model's figures whatever its page size (57 blocks
# of 128 tokens, 3 per request at 300), and the gpt-oss family is the gemma-2 one with sinks, which are weights:
# test_vllm_twins_have_their_twins_capacity holds the planner to that, and `kvbench validate --families`
# measures each family's bytes per block in vLLM. Empty this to start vLLM for every family (+7 starts).
VLLM_TWINS = {"gqa_llama": "smollm2", "gqa_falcon_new": "smollm2", "moe_qwen3": "smollm2", "mqa_falcon": "smollm2",
              "mha_gpt2": "smollm2", "mla_minicpm3": "smollm2",  # full attention: pages differ, blocks do not
              "sinks_gptoss": "hybrid_gemma2"}  # 2 sliding (64) + 2 full layers of 2 KV heads x 64


class PlannerDiffers(AssertionError):
    """A capacity figure of the planner's that is not the engine's (what the known mismatches xfail on)."""


def differing(engine: dict, planner: dict) -> dict:
    return {k: (engine[k], planner[k]) for k in engine if engine[k] != planner[k]}


@pytest.fixture(scope="module")
def served(smollm2):
    """Every model the tests start, by name: the embedded model and the validation families (built here once)."""
    engine_env("hf")
    built, errors = prepare(families(), smollm2.hf_dir)
    assert not errors, errors
    return {"smollm2": smollm2, **{m.name: m for m in built}}


def planned(name: str, served: dict, **kw) -> PlanInput:
    """The deployment as a user plans it: the embedded model by name, a family by its folder; no weights."""
    model = resolve_model(name if name == "smollm2" else str(served[name].hf_dir), weights_bytes=0)
    return PlanInput(model=model, overhead_gib=0, overhead_source="none", margin=0, **kw)


def gpu_of(budget: int) -> str:
    """A --gpu size of exactly ``budget`` bytes (a power-of-two fraction of a GiB reads back exactly)."""
    text = f"{budget / GIB!r}GiB"
    assert "e" not in text
    return text


VLLM_PARAMS = [pytest.param(n, id=n) for n in MODELS if n not in VLLM_TWINS]


def vllm_planned(name: str, served: dict) -> tuple[PlanInput, int]:
    """The vLLM deployment planned for ``name`` on a GPU of exactly the KV budget the test starts vLLM with."""
    p = planned(name, served, engine="vllm", kv_dtype="bf16", device="cpu", max_model_len=VLLM_LIMIT)
    per_block = int(setup(p).rules.bytes_per_block(setup(p).question(batch=1)))
    budget = VLLM_BLOCKS * per_block + per_block // 2
    return replace(p, gpu=gpu_of(budget)), budget


def test_vllm_twins_have_their_twins_capacity(served):
    for twin, started in VLLM_TWINS.items():
        a, b = (capacity(setup(vllm_planned(n, served)[0])) for n in (twin, started))
        assert a == b, (twin, started)


def started_pool(backend, spec: ServerSpec, log: Path, timeout_s: float):
    """The pool ``backend`` reports once started for ``spec`` (its log at ``log``), the server stopped after."""
    try:
        backend.start(spec, log, timeout_s)
        return backend.kv_pool()
    finally:
        backend.stop()


def two_at_a_time(starts: dict) -> dict:
    """{name: the pool of ``starts[name]()``, or the exception it raised}, two starts at once: a start is mostly
    one interpreter importing (two pool-only vLLM starts took 35 s together here against 65 s one after
    the other), and these read only the pool and the log."""
    def result(start):
        try:
            return start()
        except Exception as exc:  # noqa: BLE001 - the test of that model raises it
            return exc
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(starts, pool.map(result, starts.values())))


def pool_of(results: dict, name: str):
    found = results[name]
    if isinstance(found, Exception):
        raise found
    return found


@pytest.fixture(scope="module")
def vllm_pools(served, tmp_path_factory) -> tuple[dict, Path]:
    """vLLM started once per KV layout for the budget the planner's GPU has: ({name: its pool}, the logs' folder)."""
    logs, env = tmp_path_factory.mktemp("vllm-capacity"), engine_env("vllm")

    def start(name):
        budget = vllm_planned(name, served)[1]
        backend = VLLMBackend(VLLMBackend.default_version, env,  # one process: 20 s a start instead of 38
                              {"kv_cache_memory_bytes": budget, "single_process": True})
        spec = ServerSpec(model=served[name], max_context=VLLM_LIMIT, max_concurrency=1, kv_dtype="bf16")
        return lambda: started_pool(backend, spec, logs / f"vllm-{name}.log", 300)
    return two_at_a_time({p.values[0]: start(p.values[0]) for p in VLLM_PARAMS}), logs


@pytest.fixture(scope="module")
def llama_pools(served, tmp_path_factory) -> tuple[dict, Path]:
    """llama.cpp started once per model with LLAMA_SLOTS slots of LLAMA_LIMIT: ({name: its pool}, the logs' folder)."""
    logs, env = tmp_path_factory.mktemp("llamacpp-capacity"), engine_env("llamacpp")

    def start(name):
        backend = LlamaCppBackend(LlamaCppBackend.default_version, env, {})
        spec = ServerSpec(model=served[name], max_context=LLAMA_LIMIT, max_concurrency=LLAMA_SLOTS, kv_dtype="f16")
        return lambda: started_pool(backend, spec, logs / f"llamacpp-{name}.log", 120)
    return two_at_a_time({name: start(name) for name in MODELS}), logs


@pytest.mark.parametrize("name", VLLM_PARAMS)
def test_vllm_pool_and_concurrency_equal_the_planners(name, served, vllm_pools):
    p, budget = vllm_planned(name, served)
    s, out = setup(p), plan(p, with_levers=False)
    cap = capacity(s)
    assert s.usable == budget and out["verdict"]["word"] == "FITS"

    results, logs = vllm_pools
    log = logs / f"vllm-{name}.log"
    pool = pool_of(results, name)
    m = VLLM_LINE.search(log.read_text(errors="replace"))
    assert m and pool, f"no capacity line or no pool in {log}"
    blocks, x = pool.details["num_gpu_blocks"], m["x"]
    # the blocks one request at the limit takes in vLLM: the one whole number its concurrency figure rounds from
    per_request = [k for k in range(1, blocks + 1) if f"{blocks / k:.2f}" == x]
    assert len(per_request) == 1, (blocks, x, per_request)

    # the pool: its blocks of the budget, their size, its tokens, the limit
    engine = {"blocks": blocks, "block_size": pool.details["block_size"], "pool_tokens": pool.tokens,
              "limit": int(m["limit"].replace(",", ""))}
    planner = {"blocks": cap.blocks, "block_size": cap.block_size, "pool_tokens": cap.pool_tokens, "limit": cap.limit}
    assert not differing(engine, planner), differing(engine, planner)
    # what it holds at the limit: vLLM's logged figures, and the requests it serves at once (null block aside)
    engine = {"Maximum concurrency": x, "KV cache size tokens": int(m["tokens"].replace(",", "")),
              "blocks per request": per_request[0], "sequences in pool": (blocks - 1) // per_request[0],
              "plan max concurrency": (blocks - 1) // per_request[0]}
    planner = {"Maximum concurrency": f"{cap.requests_at_limit:.2f}", "KV cache size tokens": cap.tokens_at_limit,
               "blocks per request": cap.blocks_per_request, "sequences in pool": cap.sequences,
               "plan max concurrency": out["max_batch"]}
    if differing(engine, planner):
        raise PlannerDiffers(differing(engine, planner))


@pytest.mark.parametrize("name", MODELS)
def test_llamacpp_cells_and_slots_equal_the_planners(name, served, llama_pools):
    p = planned(name, served, engine="llamacpp", kv_dtype="f16", max_model_len=LLAMA_LIMIT, batch=LLAMA_SLOTS)
    s = setup(p)
    cap, out = capacity(s), plan(p, with_levers=False)

    results, logs = llama_pools
    log = logs / f"llamacpp-{name}.log"
    pool = pool_of(results, name)
    text = log.read_text(errors="replace")
    caches = parse_kv_log(text)  # the full-attention cache first, then a window cache (llama_kv_cache_iswa)
    assert caches and pool, f"no llama_kv_cache line in {log}"
    argv = text.splitlines()[0]
    full, window = caches[0], (caches[1] if len(caches) > 1 else None)
    stored = s.rules.stored(s.question())
    kinds = [layer.kind for layer in stored.kv_layers]

    engine = {"-c/-np": re.search(r" (-c \d+ -np \d+)", argv)[1], "streams": {c["streams"] for c in caches},
              "seqs": {c["seqs"] for c in caches}, "cells": full["cells"] * full["streams"],
              "window cells": window["cells"] * window["streams"] if window else 0,
              "layers": full["layers"], "window layers": window["layers"] if window else 0,
              "sequences in pool": full["seqs"], "plan max concurrency": full["seqs"]}
    # plan's max concurrency for a budget of the KV bytes llama.cpp logged (MiB to 2 decimals: 0.005 MiB each up)
    budget = math.ceil((sum(c["mib"] for c in caches) + 0.005 * len(caches)) * MIB)
    at_budget = plan(replace(p, gpu=gpu_of(budget)), with_levers=False)
    planner = {"-c/-np": out["limit_flag"], "streams": {LLAMA_SLOTS}, "seqs": {LLAMA_SLOTS},
               "cells": cap.pool_tokens, "window cells": cap.window_tokens,
               "layers": kinds.count("full"), "window layers": len(kinds) - kinds.count("full"),
               "sequences in pool": cap.sequences, "plan max concurrency": at_budget["max_batch"]}
    assert not differing(engine, planner), differing(engine, planner)
    assert pool.tokens == cap.pool_tokens  # what the runner reads as the pool
