"""The fourth fault matrix, B: what a server answers, kept as text and counts every writer takes. A version string
with a lone surrogate and a /metrics pool of 10^30 blocks (tests/fakes/replica_server.py, attached through the
real vLLM adapter), a run an earlier kvbench wrote with them, a 64 MiB engine log line, an event split over two
data lines inside a JSON string, and the capability probe held to --request-timeout
(docs/fault-matrix.md, "The fourth matrix, B")."""
from __future__ import annotations

import asyncio
import io
import json
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvbench.backends.openai.adapter import OpenAIBackend
from kvbench.backends.process import LOG_READ_BYTES, log_excerpt, read_log
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.load import run_async
from kvbench.common import outside
from kvbench.run.backend_config import BackendConfig
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells, load_run_info
from kvbench.workloads import Workload
from tests.backends.test_streaming import CHUNKED_HEAD, _serve, chunk, run_sse
from tests.fakes.openai_server import FakeOpenAI, OpenAIHandler
from tests.fakes.replica_server import FakeReplica
from tests.helpers import kvbench_here
from tests.synth import make_run

WORKLOAD = Workload(name="answers", seed=5, prompt_tokens=[48], output_tokens=4, concurrency=[1], rounds=1,
                    warmup_requests=0)


def run_against(tmp_path: Path, fake: FakeOpenAI, engine: str = "vllm", **options) -> Path:
    opts = RunOptions(model="smollm2", workload=WORKLOAD, backends=[BackendConfig.parse(f"{engine}:url={fake.url}")],
                      results_dir=tmp_path, run_id="run", estimate=False, **options)
    return Runner(opts, Console(file=io.StringIO(), width=200)).run()


def reads(run_dir: Path, out: Path) -> str:
    """kvbench report of the run: exit 0, report.md written and UTF-8; its text."""
    done = kvbench_here("report", run_dir, "-o", out, "--no-plots")
    assert done.returncode == 0, done.stdout + done.stderr
    return out.read_bytes().decode()


def test_a_version_with_a_lone_surrogate_is_kept_as_text_and_the_run_and_its_report_finish(tmp_path, smollm2):
    """/version answering {"version": "0.32.0\\ud800"} (valid JSON, not text UTF-8 can hold) failed the engine
    ("Error serializing to JSON: ... surrogates not allowed"); the version is now kept with U+FFFD."""
    with FakeReplica(version="0.32.0\ud800") as fake:
        run_dir = run_against(tmp_path, fake)
    cells = load_cells(run_dir)
    assert (cells.status == "ok").all(), cells.error.tolist()
    info = load_run_info(run_dir)
    assert info["status"] == "finished" and list(info["engine_versions"].values()) == ["0.32.0\ufffd"]
    assert "0.32.0\ufffd" in reads(run_dir, tmp_path / "report.md")


def test_a_pool_of_10_30_blocks_is_not_believed_and_the_run_and_its_report_finish(tmp_path, smollm2):
    """vllm:cache_config_info with num_gpu_blocks="1e30" crashed the run after its cells (an integer past 64 bits
    in cells.jsonl), and the report then refused the run; the pool is now "not believed", saying what came."""
    with FakeReplica(num_gpu_blocks=10**30) as fake:
        run_dir = run_against(tmp_path, fake)
    assert load_run_info(run_dir)["status"] == "finished"
    cells = load_cells(run_dir)
    assert (cells.status == "ok").all(), cells.error.tolist()
    assert cells.kv_pool_tokens_engine.isna().all() and cells.kv_pool_sequences_predicted.isna().all()
    assert cells.kv_pool_source.str.startswith("not believed: vllm:cache_config_info said "
                                               "128000000000000000000000000000000 tokens").all()
    reads(run_dir, tmp_path / "report.md")


def test_a_run_an_earlier_kvbench_wrote_with_such_answers_is_read_by_report(tmp_path):
    """A run an earlier kvbench kept them in: run.json with the version's "\\ud800" escape, cells.jsonl with a
    pool of 10^30 sequences. report read neither (a UnicodeEncodeError; "beyond a 64-bit integer"); it reads
    both now, the count as not measured and said in the report's header."""
    run = make_run(tmp_path, "old", prompts=(1024,), concurrency=(1,), repeats=1, n_requests=3)
    info = json.loads((run / "run.json").read_text())
    info["engine_versions"]["vllm-0.31.0"] = "0.31.0\ud800"
    (run / "run.json").write_text(json.dumps(info))  # json's escape, as kvbench wrote it
    assert "\\ud800" in (run / "run.json").read_text()
    lines = (run / "cells.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    row["kv_pool_sequences_predicted"] = 10**30
    row["error"] = "bad response: \udcff"
    lines[0] = json.dumps(row)
    (run / "cells.jsonl").write_text("\n".join(lines) + "\n")
    for parquet in run.glob("*.parquet"):
        parquet.unlink()
    text = reads(run, tmp_path / "report.md")
    assert "0.31.0\ufffd" in text
    assert re.search(r"cells.jsonl: 1 value\(s\) beyond a 64-bit integer read as not measured \(line 1: "
                     r"kv_pool_sequences_predicted 1e\+30\)", text), text[:3000]


def test_a_64_mib_log_line_is_cut_with_a_marker_before_it_reaches_a_record(tmp_path):
    """An engine's log with one line of 64 MiB (a dumped tensor, a binary blob): the whole line went into the
    failed rows' log tail and run.json; each line kept is now at most 2,000 characters, the cut said."""
    log = tmp_path / "engine.log"
    with log.open("wb") as f:
        f.write(b"INFO starting\nERROR " + b"x" * (64 << 20) + b"\nINFO after\n" + b"last line\n")
    excerpt = log_excerpt(log)
    assert len(excerpt) < 10_000
    assert re.search(r"ERROR x{100,}.* \[\.\.\. [\d,]+ characters cut\]", excerpt)
    assert excerpt.rstrip().endswith("last line")


def test_an_engines_log_is_read_for_its_figures_within_a_bound(tmp_path):
    """The adapters read an engine's log for their startup figures (llama.cpp's KV cache line, vLLM's weights):
    a log of 80 MiB was read whole, every time; now its first and last 16 MiB, the rest said."""
    log = tmp_path / "engine.log"
    with log.open("wb") as f:
        f.write(b"llama_kv_cache: size = 33.75 MiB\n" + b"x" * (80 << 20) + b"\nModel loading took 1.5 GiB\n")
    text = read_log(log)
    assert len(text) < 2 * LOG_READ_BYTES + 100 and "bytes of the log not read]" in text
    assert text.startswith("llama_kv_cache: size = 33.75 MiB") and text.endswith("Model loading took 1.5 GiB\n")
    small = tmp_path / "small.log"
    small.write_text("one\ntwo\n")
    assert read_log(small) == "one\ntwo\n" and read_log(tmp_path / "gone.log") == ""


def test_the_outside_text_helpers():
    assert outside.text("a\ud800b") == "a\ufffdb"
    assert outside.text("ok \U0001f600") == "ok \U0001f600"
    assert outside.text("x" * 10, limit=5) == "xxxxx" and outside.cut("y" * 100, 40) == "y" * 15 + " [... 85 characters cut]"
    assert outside.count(10**30, 2**40) is None and outside.count(1e3, 2**40) == 1000
    assert outside.count(float("nan"), 10) is None and outside.count(True, 10) is None and outside.count(-1, 10) is None


@pytest.mark.parametrize("limit", [5, 30, 31, 100])
def test_a_cut_text_is_within_its_limit(limit):
    assert len(outside.cut("z" * 1000, limit)) <= limit


class SplitInsideAString(OpenAIHandler):
    """Every event's data over two data lines, cut inside its first JSON string: joined by LF (the standard), the
    string holds a bare LF, which strict JSON refuses."""

    def _event(self, obj) -> None:
        text = json.dumps(obj)
        cut = text.index('"', text.index(':') + 1) + 2  # just inside the first string value
        self.chunk(b"data: " + text[:cut].encode() + b"\ndata: " + text[cut:].encode() + b"\n\n")


class SplitFake(FakeOpenAI):
    handler = SplitInsideAString


def test_an_event_split_inside_a_json_string_over_two_data_lines_is_read(tmp_path, smollm2):
    """Valid SSE (its data lines joined by LF), JSON with a bare LF in a string: the openai adapter's probe
    refused the server ("Invalid control character") and every cell failed; it is read now, LF kept."""
    event = {"id": "cmpl-1", "choices": [{"text": "ab", "index": 0}], "usage": {"prompt_tokens": 3,
                                                                                "completion_tokens": 1}}
    text = json.dumps(event)
    body = b"data: " + text[:10].encode() + b"\ndata: " + text[10:].encode() + b"\n\ndata: [DONE]\n\n"
    r = run_sse([CHUNKED_HEAD + chunk(body) + b"0\r\n\r\n"], handle=VLLMBackend._read_event)
    assert r.error is None and r.chunk_tokens == [1] and r.output_tokens_reported == 1
    with SplitFake(model="smollm2") as fake:
        run_dir = run_against(tmp_path, fake, engine="openai")
    cells = load_cells(run_dir)
    assert (cells.status == "ok").all() and (cells.n_failed == 0).all(), cells.error.tolist()


def test_a_stream_that_is_not_json_still_fails_its_request():
    body = b"data: {oops\ndata: more\n\ndata: [DONE]\n\n"
    with pytest.raises(ValueError):  # the parse error, which the load makes that request's failure
        run_sse([CHUNKED_HEAD + chunk(body) + b"0\r\n\r\n"], handle=VLLMBackend._read_event)


def test_the_capability_probe_waits_the_request_timeout_not_its_own():
    """The openai adapter's probe gave every server 30 s whatever --request-timeout said; it now waits the
    run's request timeout (set on the adapter before it attaches, bench/run/start.py)."""
    script = [CHUNKED_HEAD] + [chunk(b": drip\n"), 0.2] * 30

    async def client_fn(url):
        backend = OpenAIBackend("v1", None, {})
        backend.base_url, backend.model, backend.request_timeout_s = url.removesuffix("/v1/completions"), "m", 1.0
        t0 = time.perf_counter()
        ok, why = await asyncio.to_thread(backend._try, {"prompt": "Hello"})
        return ok, why, time.perf_counter() - t0
    ok, why, took = run_async(_serve(script, client_fn))
    assert not ok and "no whole answer within 1 s" in why and took < 2.5


def test_a_run_gives_its_request_timeout_to_the_probe(tmp_path, smollm2):
    """--request-timeout 1 against a server whose first token takes 3 s: the attach probe gives up after 1 s
    (it waited up to 30 s, and passed, each request then timing out)."""
    with FakeOpenAI(model="smollm2", first_token_delay_s=lambda prompt: 3.0) as fake:
        started = time.monotonic()
        run_dir = run_against(tmp_path, fake, engine="openai", request_timeout_s=1.0)
    cells = load_cells(run_dir)
    assert cells.error.str.contains("refused a 2-token request: ReadTimeout").all(), cells.error.tolist()
    assert time.monotonic() - started < 20


EVIL = "0.31.0\n\n# INJECTED heading\n\n[click me](http://evil.example) <script>alert(1)</script> | x | *bold*"


def test_markdown_in_a_servers_words_reaches_report_md_only_as_text(tmp_path):
    """A version, a served model's name, a failed cell's error and its log tail holding Markdown: report.md
    rendered a heading, a link, raw HTML (a <script>) and a log line of ``` ended its code block. Rendered
    now (markdown-it, CommonMark with raw HTML on, as a Markdown viewer would), each is text."""
    from markdown_it import MarkdownIt

    run = make_run(tmp_path, "evil", prompts=(1024,), concurrency=(1, 4), repeats=1, n_requests=3,
                   failed={("vllm-0.31.0", 1024, 4)})
    info = json.loads((run / "run.json").read_text())
    info["engine_versions"]["vllm-0.31.0"] = EVIL
    info["served_models"] = {"vllm-0.31.0": ["smollm2\n## served <img src=x onerror=alert(1)>"]}
    (run / "run.json").write_text(json.dumps(info))
    lines = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines()]
    for row in lines:
        if row["status"] == "failed":
            row["error"] = "bad response: <script>alert(2)</script> [x](http://evil.example/2)"
            row["log_tail"] = "```\n# LOG heading <script>alert(3)</script>\n```"
    (run / "cells.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    for parquet in run.glob("*.parquet"):
        parquet.unlink()
    text = reads(run, tmp_path / "report.md")
    assert "vllm-0.31.0 (`0.31.0 # INJECTED heading" in text
    html = MarkdownIt("commonmark", {"html": True}).enable("table").render(text)
    assert "<script>" not in html and 'href="http://evil' not in html  # no raw HTML, no link
    assert not re.search(r"<h\d>(INJECTED|served|LOG)", html) and "<img src=\"x\"" not in html
    assert "alert(2)" in html and "alert(3)" in html  # the words themselves are kept, as text
