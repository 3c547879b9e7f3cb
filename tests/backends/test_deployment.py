"""A deployment: several replicas of one engine as one backend (backends/deployment.py), its rows per
replica and in total, its timeline per replica, and its report.

The non-engine tests attach the real vLLM adapter to fake vLLM replicas (tests/fakes/replica_server.py:
a real vLLM 0.32.0 /metrics page whose pool, KV usage and queue are each replica's own). The engine tests
attach two real vLLM CPU servers (the pools and the KV boundary summed), and two real llama.cpp servers,
each pair as one deployment.
"""
import io
import json

import pandas as pd
import pytest
from rich.console import Console

from kvbench import reports
from kvbench.backends.deployment import Deployment
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.common.redact import redact_text
from kvbench.compare.runs import load_side
from kvbench.run.backend_config import BackendConfig, ConfigError
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import column_dtypes, load_cells
from kvbench.store.schema import SCHEMA_VERSION, CellRow, migrate_row
from kvbench.workloads import Workload
from tests.fakes.replica_server import FakeReplica
from tests.fakes.testkit import prompt, run, spec

# 48 prompt + 16 output tokens: 4 blocks of 16 tokens on replica A, 2 blocks of 32 on replica B
WORKLOAD = Workload(name="deploy", seed=5, prompt_tokens=[48], output_tokens=16, concurrency=[4], rounds=2,
                    warmup_requests=0)


def replicas():
    """Replica A: a small pool (9 blocks of 16 tokens) running one request at a time, so it queues;
    replica B: 33 blocks of 32 tokens, four at a time. Each token takes 20 ms: requests last ~0.3 s, several
    polls at 10 Hz."""
    return (FakeReplica(num_gpu_blocks=9, block_size=16, max_running=1, token_delay_s=0.02),
            FakeReplica(num_gpu_blocks=33, block_size=32, max_running=4, token_delay_s=0.02))


def run_deployment(tmp_path, backend: str, workload=WORKLOAD):
    opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse(backend)],
                      results_dir=tmp_path, run_id="deploy")
    return Runner(opts, Console(file=io.StringIO(), width=200)).run()


@pytest.fixture(scope="module")
def round_robin(tmp_path_factory, smollm2):
    a, b = replicas()
    with a, b:
        run_dir = run_deployment(tmp_path_factory.mktemp("runs"), f"vllm:url={a.url},url={b.url}")
    return run_dir, a, b


def test_config_takes_repeated_urls_and_a_gateway(monkeypatch):
    cfg = BackendConfig.parse("vllm:url=http://10.0.0.1:8000,url=http://u:pw@10.0.0.2:8000")
    assert cfg.urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"] and cfg.url == cfg.urls[0]
    assert cfg.deployment and cfg.gateway is None and cfg.label == "vllm@10.0.0.1:8000+10.0.0.2:8000"
    assert cfg.credentials.get_secret_value() == "u:pw"  # one set, sent to every replica
    assert "pw" not in cfg.model_dump_json()
    gw = BackendConfig.parse("vllm:gateway=http://lb:80,url=http://10.0.0.1:8000,url=http://10.0.0.2:8000")
    assert gw.gateway == "http://lb:80" and gw.label == "vllm@lb:80+2-replicas" and gw.deployment
    one = BackendConfig.parse("vllm:url=http://10.0.0.1:8000")
    assert not one.deployment and one.urls == [one.url] and one.label == "vllm@10.0.0.1:8000"
    assert not BackendConfig.parse("vllm").deployment
    for text, message in [("vllm:url=http://a:1,url=http://a:1", "given twice"),
                          ("vllm:url=http://a:1,url=https://a:1/v1", "share the host:port a:1"),
                          ("vllm:gateway=http://lb:1", "gateway .* needs the replicas"),
                          ("vllm:url=http://a:1,block_size=16,block_size=32", "'block_size' is given twice"),
                          ("vllm:url=http://u:SECRET1@a:1,url=http://v:SECRET2@b:1", "different credentials")]:
        with pytest.raises(ConfigError, match=message) as info:
            BackendConfig.parse(text)
        assert "SECRET" not in str(info.value)


def test_every_url_of_a_command_line_is_redacted():
    shown = redact_text("kvbench run -b vllm:url=http://u:SECRET1@a:1,url=http://v:SECRET2@b:1,"
                        "gateway=https://w:SECRET3@lb/x")
    assert "SECRET" not in shown and shown.count("***@") == 3


def test_requests_alternate_and_each_replica_reads_its_own_figures(tmp_path, smollm2):
    """The adapters themselves, without the runner: round-robin from the first replica, each replica polled
    through its own adapter, the totals the sums of one poll."""
    a, b = replicas()
    with a, b:
        dep = Deployment.of(VLLMBackend, "0.32.0", {}, [a.url, b.url])
        dep.attach(spec(tmp_path), None, timeout_s=5)
        dep.reset_cell()
        results = run(dep, [prompt(48, 16, f"r{i}") for i in range(4)])
        polls = dep.replica_polls(results)
        assert [r.engine_details["replica"] for r in results] == [f"127.0.0.1:{p}" for p in (a.port, b.port) * 2]
        assert len(a.served) == len(b.served) == 2
        pool = dep.kv_pool()
        assert (pool.tokens, pool.bytes) == (9 * 16 + 33 * 32, 2 * 200_000_000)
        assert [polls[f"127.0.0.1:{p}"].kv_pool.tokens for p in (a.port, b.port)] == [9 * 16, 33 * 32]
        assert polls[f"127.0.0.1:{a.port}"].request_ids == {"r0", "r2"}
        # one poll while a holds 1 request (4 blocks of 16) and b holds 2 (2 blocks of 32 each)
        with a.lock, b.lock:
            a.running, a.waiting, a.blocks_held = 1, 1, 4
            b.running, b.waiting, b.blocks_held = 2, 0, 4
        state = dep.poll(dep.http_client(2.0))
        assert (state.kv.tokens, state.queue["running"], state.queue["waiting"]) == (4 * 16 + 4 * 32, 3, 1)
        mine = dep.replica_polls()
        assert mine[f"127.0.0.1:{a.port}"].kv_samples[-1].kv_tokens_in_use == 64
        assert mine[f"127.0.0.1:{b.port}"].kv_samples[-1].kv_tokens_in_use == 128
        assert mine[f"127.0.0.1:{b.port}"].queue_samples[-1].running == 2
        b.stop()  # one replica gone: its poll fails, the other's is still taken, the total is not known
        state = dep.poll(dep.http_client(2.0))
        assert state.kv is None and mine[f"127.0.0.1:{b.port}"].poll_errors == 1
        assert len(mine[f"127.0.0.1:{a.port}"].kv_samples) == 2
        dep.stop()


def test_rows_per_replica_and_the_deployments_total(round_robin):
    run_dir, a, b = round_robin
    cells = load_cells(run_dir)
    la, lb = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    assert list(cells.replica) == ["", la, lb], cells[["cell_id", "status", "error"]]
    assert (cells.status == "ok").all(), cells[["cell_id", "status", "error", "flags"]].to_string()
    total, ra, rb = (cells.iloc[i] for i in range(3))
    assert ra.cell_id == f"{total.cell_id}@{la}" and (cells.replicas == 2).all()
    assert total.backend == ra.backend == rb.backend == f"vllm@{la}+{lb}"
    # requests alternate: each replica served half, and the total counts them all
    every = pd.read_json(run_dir / "requests.jsonl", lines=True)  # warm-up requests too
    assert [d["replica"] for d in every.engine_details].count(la) == len(a.served)  # as each replica saw them
    assert [d["replica"] for d in every.engine_details].count(lb) == len(b.served)
    reqs = every[~every.warmup]
    # dealt in turn; the send time is stamped after a connection the request had to open, so a replica's first
    # request may go out after the next one's: half each, not the order by send time
    served = [d["replica"] for d in reqs.engine_details]
    assert sorted(served) == sorted([la, lb] * 4) and len(reqs) == 8
    assert (ra.n_requests, rb.n_requests, total.n_requests) == (4, 4, 8)
    # each replica's pool is its own; the deployment's is the sum, and so are the sequences it holds
    assert (ra.kv_pool_tokens_engine, rb.kv_pool_tokens_engine) == (9 * 16, 33 * 32)
    assert total.kv_pool_tokens_engine == 9 * 16 + 33 * 32
    assert (ra.kv_pool_sequences_predicted, rb.kv_pool_sequences_predicted) == (8 // 4, 32 // 2)
    assert total.kv_pool_sequences_predicted == 2 + 16
    assert total.kv_pool_bytes_predicted == pytest.approx(ra.kv_pool_bytes_predicted + rb.kv_pool_bytes_predicted)
    # KV in use: A runs one request at a time (4 blocks of 16 tokens); B all it is sent (2 blocks of 32
    # each). Round-robin ignores speed: the closed loop's workers come back from fast B and are sent to
    # slow A in turn, so A holds more in flight than B and queues them
    assert total.max_in_flight == 4 and ra.max_in_flight >= 2 and ra.max_in_flight + rb.max_in_flight >= 4
    assert ra.kv_in_use_peak_tokens == 64 and ra.requests_running_peak == 1
    assert rb.kv_in_use_peak_tokens == 64 * rb.requests_running_peak and rb.requests_running_peak >= 1
    assert ra.requests_waiting_peak == ra.max_in_flight - 1 and rb.requests_waiting_peak == 0
    assert total.queued_first_replica == la and total.queued_first_s == ra.queued_first_s > 0
    assert pd.isna(rb.queued_first_s)


def test_the_timeline_has_each_replicas_samples_and_totals_that_are_their_sums(round_robin):
    run_dir, a, b = round_robin
    cells = load_cells(run_dir)
    timeline = pd.read_csv(run_dir / "timelines" / f"{cells.cell_id.iloc[0]}.csv")
    timeline["replica"] = timeline.replica.fillna("")
    kv = timeline[timeline.series == "kv"]
    parts = {r: part.kv_tokens_in_use.tolist() for r, part in kv.groupby("replica")}
    la, lb = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    assert set(parts) == {"", la, lb} and len(parts[""]) == len(parts[la]) == len(parts[lb]) > 5
    assert parts[""] == [x + y for x, y in zip(parts[la], parts[lb])]  # poll by poll
    assert max(parts[la]) == 64 and max(parts[lb]) == 64 * cells.requests_running_peak.iloc[2]
    queue = timeline[(timeline.series == "queue") & (timeline.replica == la)]
    assert queue.requests_waiting.max() == cells.requests_waiting_peak.iloc[1] >= 1
    assert (timeline[(timeline.series == "queue") & (timeline.replica == lb)].requests_waiting == 0).all()


def test_the_report_shows_replicas_and_total_and_compare_reads_totals_only(round_robin, tmp_path):
    run_dir, a, b = round_robin
    md, page, text = reports.write([run_dir], output=tmp_path / "report.md", plots=False)
    la, lb = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    kv_section = text.split("## KV cache")[1].split("\n## ")[0]
    rows = [line for line in kv_section.splitlines() if line.startswith("| vllm@")]
    assert len(rows) == 3
    assert "| total (2 replicas) |" in rows[0] and f"| {la} |" in rows[1] and f"| {lb} |" in rows[2]
    assert "| 144 |" in rows[1] and "| 1,056 |" in rows[2] and "| 1,200 |" in rows[0]  # pool tokens
    boundary = text.split("## The KV boundary")[1].split("\n## ")[0]
    lines = [line for line in boundary.splitlines() if line.startswith("| vllm@")]
    assert "| 18 |" in lines[0] and "| 2 |" in lines[1] and "| 16 |" in lines[2]  # sequences the pools hold
    # each replica against the requests it was sent at once, the total against the cell's concurrency (4 of 18)
    a_at_once = load_cells(run_dir).max_in_flight.iloc[1]
    assert "| within |" in lines[0] and "| within |" in lines[2]
    assert ("| beyond: must queue or preempt |" in lines[1]) == (a_at_once > 2)
    assert f"replica {la} queued first" in text
    html = page.read_text()
    assert f"replica {la} queued first" in html and html.count(f"<td>{la}</td>") >= 3
    side = load_side("baseline", [run_dir])
    assert list(side.cells.replica) == [""] and len(side.cells) == 1


def test_one_set_of_credentials_reaches_every_replica_and_no_file(tmp_path, smollm2):
    """The userinfo of the second url is the backend's credentials: every replica (and its /metrics) is
    sent them, and neither the password nor the user reaches any file of the run (run.json's command too)."""
    import base64

    token = "Basic " + base64.b64encode(b"alice:PLANTEDpw").decode()
    a, b = (FakeReplica(require_auth=token, token_delay_s=0.005) for _ in range(2))
    with a, b:
        backend = f"vllm:url={a.url},url=http://alice:PLANTEDpw@127.0.0.1:{b.port}"
        opts = RunOptions(model="smollm2", workload=WORKLOAD.model_copy(update={"rounds": 1}),
                          backends=[BackendConfig.parse(backend)], results_dir=tmp_path, run_id="secret",
                          command=["kvbench", "run", "-b", backend])
        run_dir = Runner(opts, Console(file=io.StringIO(), width=200)).run()
    assert set(a.auth_seen) == set(b.auth_seen) == {token} and a.served and b.served
    assert (load_cells(run_dir).status == "ok").all()
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"PLANTEDpw" not in data and b"alice" not in data, path
    assert "http://***@127.0.0.1" in json.loads((run_dir / "run.json").read_text())["command"]


def test_recompute_rebuilds_the_total_and_keeps_the_replica_rows(round_robin):
    """The requests are under the total's cell id: a recompute rebuilds the total's figures from all of
    them (unchanged here) and keeps each replica row's, saying so."""
    from kvbench.store.recompute import recompute

    run_dir, a, b = round_robin
    result = recompute(run_dir)
    assert result.cells_recomputed == 1 and result.changes == []
    assert len(result.warnings) == 2 and all("no requests in requests.jsonl; figures kept" in w
                                             for w in result.warnings)


def test_through_a_gateway_replicas_are_read_and_every_request_goes_to_the_gateway(tmp_path, smollm2):
    a, b = replicas()
    gateway = FakeReplica(token_delay_s=0.02)  # stands for a load balancer in front of them
    wl = WORKLOAD.model_copy(update={"concurrency": [2], "rounds": 1})
    with a, b, gateway:
        run_dir = run_deployment(tmp_path, f"vllm:gateway={gateway.url},url={a.url},url={b.url}", wl)
    reqs = pd.read_json(run_dir / "requests.jsonl", lines=True)  # warm-up requests too
    assert len(gateway.served) == len(reqs) >= 2 and not a.served and not b.served
    cells = load_cells(run_dir)
    total, ra, rb = (cells.iloc[i] for i in range(3))
    assert (cells.status == "ok").all() and total.backend == f"vllm@127.0.0.1:{gateway.port}+2-replicas"
    assert total.n_ok == 2 and ra.n_requests == rb.n_requests == 0 and pd.isna(ra.ttft_s_p50)
    assert (ra.kv_pool_tokens_engine, rb.kv_pool_tokens_engine, total.kv_pool_sequences_predicted) == (144, 1056, 18)
    assert {d["replica"] for d in reqs.engine_details} == {"gateway"}


def test_schema_columns_and_migration():
    dtypes = column_dtypes(CellRow)
    assert dtypes["replica"] == dtypes["queued_first_replica"] == "object"
    assert dtypes["replicas"] == "Int64" and dtypes["queued_first_s"] == "float64"
    row = CellRow(run_id="r", cell_id="c", backend="b", engine="e", engine_version="1", model="m", workload="w",
                  prompt_tokens=8, output_tokens=4, concurrency=1, kv_dtype="f16", status="ok").model_dump()
    for name in ("replica", "replicas", "queued_first_s", "queued_first_replica"):
        del row[name]
    row["schema_version"] = SCHEMA_VERSION - 1
    out = migrate_row(row, CellRow)
    assert out["replica"] == "" and out["replicas"] is None and out["queued_first_s"] is None
    assert json.loads(CellRow.model_validate(out).model_dump_json())["schema_version"] == SCHEMA_VERSION
