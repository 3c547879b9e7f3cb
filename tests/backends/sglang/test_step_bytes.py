"""SGLang's own bytes a pass (backends/sglang/step_bytes.py), read from the fake's /metrics (SGLang 0.5.23's
counters and formulas, tests/fakes/sglang_server.py) on a real public config (Llama 3.1 8B): the flag from the
version whose source was read, the counters summed over passes of every mode, and the figure against
kvbench's: equal at one sequence in flight less the activations, about S x the weights at S, flagged."""
import shutil

import httpx
import pytest

from kvbench.backends.prometheus import metric_samples
from kvbench.backends.sglang.adapter import SGLangBackend
from kvbench.backends.sglang.step_bytes import STEP_BYTES, read_step_bytes
from kvbench.run.decode_bound import engine_step_bytes_columns
from kvbench.store.schema import CellRow
from tests.fakes.sglang_server import FakeSGLang, mfu_constants
from tests.fakes.testkit import prompt, run, spec
from tests.helpers import DATA

LLAMA_8B_WEIGHTS = (4096 * 128 * (32 + 2 * 8) + 4096 * 128 * 32 + 3 * 4096 * 14336) * 2 * 32  # bf16, no embeddings
LLAMA_8B_KV = 2 * 32 * 8 * 128 * 2  # bytes a token


@pytest.mark.parametrize("version, flagged", [("0.5.23", True), ("0.5.23.post1", True), ("0.6.0", True),
                                              ("0.5.22", False), ("0.4.10", False)])
def test_the_flag_only_from_the_version_whose_source_was_read(version, flagged, tmp_path):
    backend = SGLangBackend(version, tmp_path, {})
    assert backend.capabilities.step_bytes is STEP_BYTES
    assert STEP_BYTES.server_args(backend) == (["--enable-mfu-metrics"] if flagged else [])


def test_a_page_before_its_first_pass_and_one_without_the_estimate():
    empty = read_step_bytes(metric_samples(""))
    assert (empty.read_bytes, empty.write_bytes, empty.steps) == (0.0, 0.0, 0.0)
    passes_only = 'sglang:cuda_graph_passes_total{mode="decode_none",tp_rank="0"} 12.0\n'
    assert read_step_bytes(metric_samples(passes_only)) is None  # a server started without --enable-mfu-metrics


def test_sglangs_constants_on_a_real_config(tmp_path):
    shutil.copy(DATA / "configs" / "llama-3.1-8b.json", tmp_path / "config.json")
    c = mfu_constants(str(tmp_path), "auto")
    assert c["weights"] == LLAMA_8B_WEIGHTS == 13_958_643_712 and c["kv"] == LLAMA_8B_KV
    assert mfu_constants(str(tmp_path), "float32")["weights"] == 2 * LLAMA_8B_WEIGHTS
    assert mfu_constants(str(tmp_path / "absent"), "auto") is None


def row(concurrency):
    return CellRow(run_id="r", cell_id="c", backend="sglang", engine="sglang", engine_version="0.5.23",
                   model="llama-3.1-8b", workload="w", prompt_tokens=64, output_tokens=8,
                   concurrency=concurrency, kv_dtype="auto", status="ok")


@pytest.fixture
def fake(tmp_path):
    """The fake with --enable-mfu-metrics on Llama 3.1 8B's config, attached; and SGLang's constants."""
    shutil.copy(DATA / "configs" / "llama-3.1-8b.json", tmp_path / "config.json")
    constants = mfu_constants(str(tmp_path), "auto")
    with FakeSGLang(model_path=str(tmp_path), token_delay_s=0.004, mfu=constants) as server:
        backend = SGLangBackend("0.5.23", tmp_path, {})
        backend.attach(spec(tmp_path), server.url, timeout_s=5)
        yield backend, constants


def counters(backend):
    with httpx.Client(timeout=5) as client:
        return STEP_BYTES.counters(backend, client)


def test_a_cell_of_one_sequence_reads_the_fakes_counters(fake):
    backend, c = fake
    before = counters(backend)
    (r,) = run(backend, [prompt(64, 8)])
    assert r.error is None
    after = counters(backend)
    prefill = 64 * (c["weights"] + c["act"] + c["attn_act"])
    decode = sum(c["weights"] + c["act"] + c["q"] + (64 + i - 1) * c["kv"] for i in range(2, 9))
    assert after.read_bytes - before.read_bytes == pytest.approx(prefill + decode)
    assert after.write_bytes - before.write_bytes == pytest.approx(
        (64 + 7) * (c["kv"] + c["act"] + c["ffn_act"]))
    assert after.steps - before.steps == 8  # one prefill pass and seven decode passes
    cell = row(1)
    cell.decode_step_bytes = LLAMA_8B_WEIGHTS + 68 * LLAMA_8B_KV  # kvbench: the weights once, the mean context's KV
    engine_step_bytes_columns(cell, before, after)
    assert cell.engine_step_read_bytes == pytest.approx((prefill + decode) / 8)
    assert "weights counted once per token decoded" in cell.engine_step_bytes_source
    assert cell.engine_step_bytes_source.endswith(": 8 steps over the cell")
    # the prefill pass's 64 tokens of weights are in the average: the flag says so, with the ratio
    assert cell.flags and cell.flags[0].startswith("decode bytes disagree") and "prefill" in cell.flags[0]


def test_at_four_in_flight_sglang_counts_the_weights_a_token(fake):
    """Decode alone (a one-token prompt): SGLang's figure a pass is about S x the weights, kvbench's once."""
    backend, _ = fake
    before = counters(backend)
    results = run(backend, [prompt(1, 40, f"r{k}") for k in range(4)], concurrency=4)
    assert all(r.error is None for r in results)
    after = counters(backend)
    per_pass = (after.read_bytes - before.read_bytes) / (after.steps - before.steps)
    # 4 x 40 tokens in 4 prefill passes and about 39 decode passes of four (the fake's pass takes one token of
    # each request in turn: a request that comes round again before the others opens the next)
    assert 2.5 * LLAMA_8B_WEIGHTS < per_pass < 4.5 * LLAMA_8B_WEIGHTS
    cell = row(4)
    cell.decode_step_bytes = LLAMA_8B_WEIGHTS + 4 * 21 * LLAMA_8B_KV
    engine_step_bytes_columns(cell, before, after)
    assert cell.flags and cell.decode_step_bytes / cell.engine_step_read_bytes < 0.7
