"""A deployment of two real llama.cpp replicas as one backend (the fakes' cases: tests/backends/test_deployment.py).

Tests that start a real engine live in modules named *_engines.py: tests/conftest.py runs them on one xdist
worker, one after another."""

import io
import math

import pytest
from rich.console import Console

from kvbench import reports
from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load
from kvbench.workloads import Workload


@pytest.mark.engine
def test_two_real_llamacpp_replicas_as_one_deployment(tmp_path_factory, smollm2):
    """Two real llama.cpp servers (~200 MB each) started by their adapter, attached as one llamacpp
    deployment: requests alternate, each replica's KV in use comes from its own /slots, and the report shows
    each replica and the total. (An attached llama.cpp reports no pool: its pool is in a log kvbench does not
    read; the vLLM test below checks the pools' sum.)"""
    from kvbench.backends.llamacpp.adapter import LlamaCppBackend
    from kvbench.backends.types import ServerSpec
    from tests.helpers import engine_env

    env = engine_env("llamacpp")
    servers = [LlamaCppBackend(LlamaCppBackend.default_version, env) for _ in range(2)]
    try:
        for i, server in enumerate(servers):
            server.start(ServerSpec(model=smollm2, max_context=512, max_concurrency=2, kv_dtype="auto"),
                         tmp_path_factory.mktemp("external") / f"llama{i}.log", 120)
        wl = Workload(name="deploy", seed=5, prompt_tokens=[64], output_tokens=32, concurrency=[4], rounds=1,
                      warmup_requests=2)
        root = tmp_path_factory.mktemp("runs")
        opts = RunOptions(model="smollm2", workload=wl, results_dir=root, run_id="deploy", start_timeout_s=120,
                          request_timeout_s=120, backends=[BackendConfig.parse(
                              f"llamacpp:url={servers[0].base_url},url={servers[1].base_url}")])
        run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
        assert all(s.alive() for s in servers)  # attached: left running
    finally:
        for server in servers:
            server.stop()
    cells = load(run_dir)
    labels = [s.base_url.split("//")[1] for s in servers]
    assert list(cells.replica) == ["", *labels]
    assert (cells.status == "ok").all(), cells[["cell_id", "status", "error", "flags"]].to_string()
    total, r0, r1 = (cells.iloc[i] for i in range(3))
    assert (r0.n_ok, r1.n_ok, total.n_ok) == (2, 2, 4)
    # each replica held up to its two requests of 64 prompt + up to 31 fed-back tokens; the total is at
    # least the larger replica's and at most their sum
    for r in (r0, r1):
        assert 64 <= r.kv_in_use_peak_tokens <= 2 * (64 + 32 - 1)
    assert max(r0.kv_in_use_peak_tokens, r1.kv_in_use_peak_tokens) <= total.kv_in_use_peak_tokens \
        <= r0.kv_in_use_peak_tokens + r1.kv_in_use_peak_tokens
    assert math.isclose(total.kv_in_use_peak_bytes, total.kv_in_use_peak_tokens * 2 * 30 * 3 * 64 * 2)
    reqs = load(run_dir, what="requests")
    # dealt in turn, half each (the send time follows a connection opened for it: not the dealing order)
    served = [d["replica"] for d in reqs[reqs.counted].engine_details]
    assert sorted(served) == sorted(labels * 2)
    _, _, text = reports.write([run_dir], output=run_dir / "report.md", plots=False)
    kv_section = text.split("## KV cache")[1].split("\n## ")[0]
    rows = [line for line in kv_section.splitlines() if line.startswith("| llamacpp@")]
    assert "| total (2 replicas) |" in rows[0] and f"| {labels[0]} |" in rows[1] and f"| {labels[1]} |" in rows[2]
    for row, cell in zip(rows, (total, r0, r1)):
        assert f"| {cell.kv_in_use_peak_bytes / 2**20:,.2f} MiB |" in row  # KV in use, each its own
