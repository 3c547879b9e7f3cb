"""vLLM's own bytes a step (backends/vllm/step_bytes.py) from a real 0.32.0 server's /metrics, started with
--enable-mfu-metrics on the embedded model and sent two requests (73-token prompts, 16 and 8 tokens): the
counters are read, summed over engines, and a cell's figure is their rise over the steps it took. An engine
without the estimate leaves the columns empty and says nothing of them."""
import pytest

from kvbench.backends.prometheus import metric_samples
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.backends.vllm.step_bytes import READ, STEPS, WRITE, read_step_bytes
from kvbench.run.decode_bound import engine_step_bytes_columns
from kvbench.store.schema import CellRow

from tests.helpers import DATA

PAGES = DATA / "step_bytes"


def page(name):
    return read_step_bytes(metric_samples((PAGES / name).read_text(), (READ, WRITE, STEPS)))


def row():
    return CellRow(run_id="r", cell_id="c", backend="b", engine="vllm", engine_version="0.32.0", model="smollm2",
                   workload="w", prompt_tokens=73, output_tokens=16, concurrency=1, kv_dtype="bf16", status="ok")


def test_the_counters_of_a_real_page_and_a_cells_bytes_a_step():
    before, after = page("vllm_metrics_mfu_before.txt"), page("vllm_metrics_mfu.txt")
    assert (before.read_bytes, before.write_bytes, before.steps) == (0.0, 0.0, 0.0)
    assert (after.read_bytes, after.write_bytes, after.steps) == (7.106429952e9, 7.3967616e7, 24.0)
    r = row()
    engine_step_bytes_columns(r, before, after)
    assert r.engine_step_read_bytes == pytest.approx(7.106429952e9 / 24)  # ~296 MB: the bf16 weights and the KV
    assert r.engine_step_write_bytes == pytest.approx(7.3967616e7 / 24)
    assert r.engine_step_bytes_source.endswith(": 24 steps over the cell") and READ in r.engine_step_bytes_source


def test_no_estimate_and_no_step_are_told_apart():
    r = row()
    engine_step_bytes_columns(r, None, None)  # an engine that keeps none
    assert (r.engine_step_read_bytes, r.engine_step_bytes_source) == (None, None)
    same = page("vllm_metrics_mfu_before.txt")
    engine_step_bytes_columns(r, same, same)
    assert r.engine_step_read_bytes is None and r.engine_step_bytes_source.startswith("not measured: no step")
    engine_step_bytes_columns(r, same, None)
    assert r.engine_step_bytes_source == "not read: a read failed"
    # a page without the counters (a server started without --enable-mfu-metrics)
    assert read_step_bytes(metric_samples("vllm:num_requests_running 0\n")) is None


@pytest.mark.parametrize("version, flagged", [("0.32.0", True), ("0.33.1", True), ("0.31.2", False)])
def test_the_flag_only_where_the_version_has_it(version, flagged, tmp_path):
    backend = VLLMBackend(version, tmp_path)
    assert backend.capabilities.step_bytes.server_args(backend) == (["--enable-mfu-metrics"] if flagged else [])


def test_a_disagreement_with_kvbenchs_bytes_is_flagged():
    before, after = page("vllm_metrics_mfu_before.txt"), page("vllm_metrics_mfu.txt")
    close, far = row(), row()
    close.decode_step_bytes = 7.106429952e9 / 24 * 1.04  # within 5 %: no flag
    engine_step_bytes_columns(close, before, after)
    assert not close.flags
    far.decode_step_bytes = 7.106429952e9 / 24 * 0.91  # the embedded model's checkpoint and its KV: 9 % fewer
    engine_step_bytes_columns(far, before, after)
    assert far.flags == ["decode bytes disagree: kvbench reads 256.97 MiB a decode step, the engine's own estimate "
                         "282.38 MiB a step (its prefill steps among them): 0.91 x"] and far.status == "ok"
