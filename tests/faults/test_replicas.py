"""The fault matrix: replicas and servers that stop answering and come back (issue 22).

A deployment of two OpenAI-compatible fakes (``openai:url=A,url=B``; tests/fakes/misbehaving_server.py
for the one that hangs) through the whole runner: a hung replica is taken out of rotation after a few
timeouts, its turns go to the other, it is probed and put back when it answers, and the outage is in the
rows and run.json. A single server that stalls 20 s and recovers runs its last cells (the runner probes a
wedged engine before each later cell). Request timeouts are 1-2 s so that the file stays short.
"""
import io
import json
import time
from datetime import datetime

from rich.console import Console

from kvbench.backends import deployment
from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load, load_cells, load_run_info
from kvbench.workloads import Workload

from tests.fakes.misbehaving_server import FakeMisbehaving
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.replica_server import FakeReplica
from tests.fakes.testkit import spec

TIMEOUT_S = 1.0
# 2 cells (16- and 24-token prompts), 2 workers, 12 requests each
WORKLOAD = Workload(name="replicas", seed=3, prompt_tokens=[16, 24], output_tokens=8, concurrency=[2], rounds=6,
                    warmup_requests=0)


def run(tmp_path, backend: str, workload=WORKLOAD, request_timeout_s=TIMEOUT_S, **options):
    console = io.StringIO()
    opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse(backend)],
                      results_dir=tmp_path, run_id="run", request_timeout_s=request_timeout_s, estimate=False,
                      **options)
    t0 = time.monotonic()
    run_dir = Runner(opts, Console(file=console, width=200)).run()
    return run_dir, time.monotonic() - t0, console.getvalue()


def label(server) -> str:
    return f"127.0.0.1:{server.port}"


def totals(run_dir):
    cells = load_cells(run_dir)
    return cells[cells.replica == ""].reset_index(drop=True), cells[cells.replica != ""]


def test_a_hung_replica_is_taken_out_of_rotation_and_costs_a_few_timeouts(tmp_path, smollm2):
    with FakeMisbehaving("hang") as hung, FakeOpenAI() as good:
        run_dir, took, console = run(tmp_path, f"openai:url={hung.url},url={good.url},probe=false")
        sent_to_hung = hung.completions
    cells, per_replica = totals(run_dir)
    requests = load(run_dir, what="requests")
    measured = requests[~requests.warmup]
    assert len(measured) == 24 and "Traceback" not in console
    failed = measured[measured.error.notna()]
    print(f"\nhung replica: {len(failed)} request timeouts paid of the 12 round-robin routed to it, "
          f"{sent_to_hung} completions sent to it (probes included), run {took:.1f} s")
    # round-robin would have sent it 12 requests, each paying the timeout: it got OUT_AFTER plus the other
    # worker's request in flight, then none; the probes (one every 2 s, each timed out) are all it saw after
    assert deployment.OUT_AFTER <= len(failed) <= deployment.OUT_AFTER + 1, failed[["request_id", "error"]]
    assert failed.error.str.startswith(f"replica {label(hung)}").all(), failed.error.tolist()
    assert failed.error.str.contains("timed out after 1 s").all()
    assert sent_to_hung <= len(failed) + took / deployment.PROBE_EVERY_S + 1, (sent_to_hung, took)
    # two rounds of timeouts (2 workers, 3 to go out), where round-robin paid 6 (12 requests on 2 workers)
    assert took < 6 * TIMEOUT_S + 20, took
    # every other request was answered by the replica in rotation; neither cell is "wedged"
    assert (measured[measured.error.isna()].engine_details.map(lambda d: d["replica"]) == label(good)).all()
    assert list(cells.n_ok) == [12 - len(failed), 12] and (cells.status == "flagged").all()
    assert not cells.error.fillna("").str.contains("stopped answering").any()
    # the rows say which replica was out, and for how long
    first, second = (" ".join(f) for f in cells["flags"])
    assert f"replica {label(hung)} out of rotation for" in first and "3 requests in a row timed out" in first
    assert "still out at the cell's end" in first and f"replica {label(hung)} out of rotation for" in second
    hung_rows = per_replica[per_replica.replica == label(hung)]
    assert hung_rows["flags"].map(lambda f: any("out of rotation" in x for x in f)).all()
    outages = load_run_info(run_dir)["replica_outages"]
    [(key, records)] = outages.items()
    assert key.startswith("openai@") and len(records) == 1
    [outage] = records
    assert outage["replica"] == label(hung) and outage["back_at"] is None and outage["probes"] >= 1
    assert outage["reason"] == "3 requests in a row timed out" and outage["out_at"]


def test_a_replica_back_after_a_stall_is_put_back_by_a_probe(tmp_path, smollm2):
    """A stalls for 3 s from its first request, then serves again: out after its timeouts, back after
    the first probe that finds it answering; the cells after its return are served by both replicas again."""
    wl = WORKLOAD.model_copy(update={"prompt_tokens": [16, 24, 32, 40], "rounds": 8})
    with FakeMisbehaving("hang", fault_for_s=3.0, token_delay_s=0.02) as stalled, \
            FakeOpenAI(token_delay_s=0.02) as good:
        run_dir, took, console = run(tmp_path, f"openai:url={stalled.url},url={good.url},probe=false", wl)
    [outage] = load_run_info(run_dir)["replica_outages"].popitem()[1]
    assert outage["replica"] == label(stalled) and outage["put_back_by"] == "a probe"
    # taken out after two rounds of 1 s timeouts, back at the first probe after the 3 s stall (every 2 s)
    assert 0.5 < outage["out_s"] < 3.0 + deployment.PROBE_EVERY_S + deployment.PROBE_TIMEOUT_S + 1, outage
    cells, _ = totals(run_dir)
    measured = load(run_dir, what="requests")
    measured = measured[~measured.warmup]
    assert measured.error.notna().sum() <= deployment.OUT_AFTER + 1
    # the return's time depends on when the probe ran (on CI's busy cores, a cell later than on a quiet
    # machine): the cells that started after it are whole again, and the workload leaves at least one
    back_unix = datetime.fromisoformat(outage["back_at"]).timestamp()
    after = cells[cells.t_cell_start_unix > back_unix]
    assert len(after) >= 1 and (after.status == "ok").all(), cells[["cell_id", "status", "flags"]]
    last = measured[measured.cell_id == cells.cell_id.iloc[-1]]
    served = last.engine_details.map(lambda d: d["replica"]).value_counts()
    assert last.error.isna().all() and served.get(label(stalled), 0) >= 4 and served.get(label(good), 0) >= 4
    flags = " ".join(" ".join(f) for f in cells["flags"])
    assert f"back by a probe after {outage['out_s']:.1f} s" in flags


def test_when_every_replica_is_out_the_wedge_rule_applies(tmp_path, smollm2):
    with FakeMisbehaving("hang") as a, FakeMisbehaving("hang") as b:
        run_dir, took, console = run(tmp_path, f"openai:url={a.url},url={b.url},probe=false")
        sent = a.completions + b.completions
    cells, _ = totals(run_dir)
    assert (cells.status == "failed").all()
    # the first cell's requests time out; the second's are not sent (a probe before it finds no answer)
    assert cells.error.iloc[1].startswith("wedged: the engine stopped answering"), cells.error.tolist()
    # a few timeouts (each replica's 3, then the wedge rule's), not the 12 of the first cell and 12 more
    assert sent <= 2 * (deployment.OUT_AFTER + 1) + 2 + 1 + 2, sent
    outages = load_run_info(run_dir)["replica_outages"].popitem()[1]
    assert {o["replica"] for o in outages} == {label(a), label(b)}


def test_a_server_back_after_a_10_s_stall_runs_its_last_cells(tmp_path, smollm2):
    """One server whose completions all hang for 10 s (five request timeouts) from the first measured request: the streak trips
    in the first cell, each later cell probes it once (1 s: half the 2 s request timeout) and fails
    unsent while it hangs; once it answers, the remaining cells run, the first of them saying why."""
    wl = Workload(name="stall", seed=3, prompt_tokens=[16], output_tokens=8, concurrency=[2], rounds=2,
                  warmup_requests=1, repeats=16)
    with FakeMisbehaving("hang", fault_after=1, fault_for_s=10.0) as server:
        run_dir, took, console = run(tmp_path, f"openai:url={server.url},probe=false", wl, request_timeout_s=2.0)
        hit = server.faulted
    cells = load_cells(run_dir)
    print(f"\n10 s stall: cells {' '.join(cells.status)}; {hit} completions hung; "
          f"run {took:.1f} s")
    assert len(cells) == 16 and "Traceback" not in console
    status = list(cells.status)
    first_ok = status.index("ok") - 1  # the flagged one before the first plain "ok"
    assert cells["flags"].iloc[first_ok][0].startswith("the engine had stopped answering"), cells["flags"].iloc[first_ok]
    assert status[0] == "failed" and set(status[1:first_ok]) == {"failed"} and first_ok >= 5, status
    assert cells.error.iloc[1:first_ok].str.startswith("wedged: the engine stopped answering").all()
    assert set(status[first_ok + 1:]) == {"ok"} and (cells.n_ok.iloc[first_ok:] == 4).all()
    # each probe that found it hung cost 1 s; one answered after the stall
    probes = load(run_dir, what="requests")
    probes = probes[probes.cell_id.str.endswith("_reprobe")]
    assert len(probes) == first_ok and probes.error.iloc[:-1].str.startswith("timed out after 1 s").all()
    assert probes.error.iloc[-1] is None or probes.error.isna().iloc[-1]
    # the hung requests: the first cell's up to the trip, and the probes
    assert hit <= 4 + len(probes) - 1, hit
    # the stall, not a request timeout per request (16 cells x 4 requests x 2 s / 2 workers = 64 s)
    assert 10 <= took < 10 + 30, took
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"


def test_a_replica_out_of_rotation_is_not_polled(tmp_path, smollm2):
    """Its KV and queue are not asked for while it is out (a hung one would hold every poll of the others
    for the poller's timeout): the deployment's total is not known meanwhile, the other's samples go on."""
    from kvbench.backends.vllm.adapter import VLLMBackend

    a, b = FakeReplica(), FakeReplica()
    with a, b:
        dep = deployment.Deployment.of(VLLMBackend, "0.32.0", {}, [a.url, b.url])
        dep.attach(spec(tmp_path), None, timeout_s=5)
        dep.reset_cell()
        dep._routed.update({f"r{i}": label(b) for i in range(deployment.OUT_AFTER)})  # its requests, timed out
        wheres = [dep.timed_out(f"r{i}") for i in range(deployment.OUT_AFTER)]
        assert wheres == [f"replica {label(b)}"] * 2 + [f"replica {label(b)} (out of rotation)"]
        assert dep.in_rotation() == 1 and [o["replica"] for o in dep.outages] == [label(b)]
        b.stop()  # polled, it would fail now
        state = dep.poll(dep.http_client(2.0))
        polls = dep.replica_polls()
        assert state.kv is None and polls[label(b)].poll_errors == 0 and not polls[label(b)].kv_samples
        assert len(polls[label(a)].kv_samples) == 1
        assert polls[label(b)].outages[0]["back_at"] is None and polls[label(b)].outages[0]["seconds_in_cell"] >= 0
        dep.stop()
