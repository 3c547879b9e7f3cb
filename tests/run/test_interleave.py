"""`kvbench run --interleave`: each repeat runs on every backend in turn, the order reversed on odd repeats
(AB BA AB), so that a machine's drift hits both sides of an A/B comparison alike."""
import io

from rich.console import Console

from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells, load_run_info
from kvbench.workloads import load

from tests.fakes.openai_server import FakeOpenAI


def test_interleaved_repeats_alternate_the_backends_abba(tmp_path, smollm2):
    with FakeOpenAI() as a, FakeOpenAI() as b:
        opts = RunOptions(model="smollm2", workload=load("smoke"), results_dir=tmp_path, run_id="ab", repeats=3,
                          backends=[BackendConfig.parse(f"openai:url={s.url}") for s in (a, b)], interleave=True)
        run_dir = Runner(opts, Console(file=io.StringIO())).run()
    cells = load_cells(run_dir)
    label = {f"openai@127.0.0.1:{a.port}": "A", f"openai@127.0.0.1:{b.port}": "B"}
    # the order rows were written in: per repeat, one backend's cells then the other's
    blocks = []
    for backend, repeat in zip(cells.backend.map(label), cells.repeat):
        if not blocks or blocks[-1] != (backend, repeat):
            blocks.append((backend, repeat))
    assert blocks == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2)]
    assert len(cells) == 2 * 3 * 4 and (cells.status == "ok").all()
    assert load_run_info(run_dir)["interleaved"] is True


def test_without_interleave_each_backend_runs_all_its_repeats_at_once(tmp_path, smollm2):
    with FakeOpenAI() as a, FakeOpenAI() as b:
        opts = RunOptions(model="smollm2", workload=load("smoke"), results_dir=tmp_path, run_id="ab", repeats=2,
                          backends=[BackendConfig.parse(f"openai:url={s.url}") for s in (a, b)])
        run_dir = Runner(opts, Console(file=io.StringIO())).run()
    cells = load_cells(run_dir)
    first = cells.backend.iloc[0]
    assert (cells.backend.iloc[:8] == first).all() and (cells.backend.iloc[8:] != first).all()
    assert load_run_info(run_dir)["interleaved"] is False
