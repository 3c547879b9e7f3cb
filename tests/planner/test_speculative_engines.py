"""Issue 51: a drafter's KV as the real engines allocate it, against the planner (kvbench.run.validate
speculative_checks, what `kvbench validate --speculative` runs), the embedded model drafting for itself.

- vLLM (CPU, one process): the drafter's layers join the target's KV cache group, so a block holds their pages
  too: on the same KV budget the pool's blocks fall from 115 to 57 (the drafter the target's size). The test
  starts it with the drafter only; `kvbench validate --speculative` also starts it without.
- llama.cpp: the draft model (the embedded Q4_1 GGUF) gets a context of its own with the target's cells and
  slots, its cache f16 by default: its llama_kv_cache line equals the planner's draft KV.
"""
import pytest

from kvbench.run.validate import speculative_checks

from tests.helpers import engine_env

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_the_drafters_kv_is_the_planners(engine, smollm2, tmp_path):
    rows = speculative_checks(engine, engine_env(engine), smollm2, tmp_path, without=False)
    assert rows and all(r.ok for r in rows), [r.row() for r in rows]
