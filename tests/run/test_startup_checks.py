"""Issue 35 item 4: every GPU run is one more check of `kvbench plan`. Each engine's own startup figures, read from
its log by its adapter's parser, beside the plan of the same deployment, in run.json (``startup_checks``) and the
report. Canned logs: the public startup logs of tests/data/startup_logs/ (each quoted from its source) and a
published CPU run's own logs; the GPU comes from NVML's name and total as a run reads them. No figure here is made
up except the fake SGLang server's pool (tests/fakes/sglang_server.py) in the run through the runner."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from kvbench.backends import REGISTRY
from kvbench.kv.units import GIB, MIB
from kvbench.planner import gpu, gpu_catalog, gpu_of_device, resolve_model
from kvbench.reports import build
from kvbench.run import startup_checks as sc
from kvbench.selfcheck import startup_logs as sl
from kvbench.store.readers import load_run_info
from kvbench.store.writer import RunWriter

from tests.helpers import REPO
from tests.synth import make_run

PUBLISHED_CPU = REPO / "results" / "published" / "20261130-194844-cpu-default"
CORPUS = {e["file"]: e for e in sl.corpus()}
# What each [logged] figure of a corpus file is among the parser's figures (GiB and MiB as the logs print them)
LOGGED = {"kv_gib": (("kv_budget_bytes", "kv_pool_bytes"), GIB), "tokens": (("pool_tokens",), 1),
          "concurrency": (("concurrency",), 1), "blocks": (("blocks",), 1), "weights_gib": (("weights_bytes",), GIB),
          "cuda_total_gib": (("cuda_total_bytes",), GIB), "non_torch_gib": (("term: non-torch memory",), GIB),
          "activation_gib": (("term: profile peak",), GIB), "kv_mib": (("kv_pool_bytes",), MIB),
          "compute_mib": (("term: compute buffer",), MIB), "avail_after_load_gib": (("avail_after_load_bytes",), GIB),
          "one_request_gib": (("one_request_bytes",), GIB), "cudagraph_estimate_gib": (("term: CUDA graphs",), GIB),
          "preload_gib": (("term: before loading",), GIB), "avail_before_load_gib": (("avail_before_load_bytes",), GIB),
          "free_at_load_mib": (("free_at_load_bytes",), MIB),
          # a draft model's own KV cache: after the log's draft mark, or the only cache of a quote of its context alone
          "draft_kv_mib": (("draft_kv_pool_bytes", "kv_pool_bytes"), MIB)}
# Figures the corpus's fit reads off debug lines a run does not record (kvbench.selfcheck.startup_fit)
FIT_ONLY = {"cudagraph_first_mib", "cudagraph_per_graph_mib"}
# Figures a corpus file logs that are worked out from its lines, not printed as such (the parser cannot read them)
DERIVED = {("vllm-10517-llama3.1-8b-3090-20k.toml", "activation_gib"): "peak_torch_memory less the weights",
           ("vllm-10517-llama3.1-8b-3090-29k.toml", "activation_gib"): "peak_torch_memory less the weights"}


def parsed(entry: dict) -> dict:
    return REGISTRY[entry["engine"]].startup_figures_from_log(entry["lines"]) or {}


def figure(figures: dict, key: str):
    if key.startswith("term: "):
        return (figures.get("terms") or {}).get(key.removeprefix("term: "))
    return figures.get(key)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_each_engines_parser_reads_the_corpus_logs_as_quoted(name):
    """Every figure a corpus file says its lines print, the engine's own parser (the one `kvbench run` uses)
    reads from those lines."""
    entry, found = CORPUS[name], parsed(CORPUS[name])
    for key, value in entry.get("logged", {}).items():
        if key == "refusal":
            assert found.get("refusal", "").startswith(value), (key, found.get("refusal"))
            continue
        if (name, key) in DERIVED or key in FIT_ONLY:
            continue
        keys, unit = LOGGED[key]
        got = next((figure(found, k) for k in keys if figure(found, k) is not None), None)
        assert got is not None and abs(got / unit - value) < 0.0051, (key, value, got and got / unit)
    assert not entry.get("logged") or found.get("lines"), "the lines read are recorded with the figures"


def test_the_parsers_read_a_published_cpu_runs_own_logs():
    vllm = REGISTRY["vllm"].startup_figures_from_log((PUBLISHED_CPU / "logs" / "vllm-0.32.0.log").read_text())
    assert (vllm["device"], vllm["pool_tokens"], vllm["concurrency"], vllm["concurrency_limit"]) == ("cpu", 32896,
                                                                                                     4.02, 8192)
    assert vllm["kv_budget_bytes"] == 0.71 * GIB and "weights_bytes" not in vllm  # its CPU runner prints none
    llama = REGISTRY["llamacpp"].startup_figures_from_log((PUBLISHED_CPU / "logs" / "llamacpp-0.3.36.log").read_text())
    assert (llama["device"], llama["pool_tokens"], llama["kv_pool_bytes"]) == ("cpu", 32768, 720 * MIB)
    assert llama["terms"] == {"compute buffer": 21.51 * MIB, "output buffer": 0.75 * MIB}  # 4 slots x 49,152 x 4 B
    assert llama["weights_bytes"] == round(92.10 * MIB)
    assert REGISTRY["hf"].startup_figures_from_log("anything") is None  # an engine without a parser says nothing


@pytest.mark.parametrize("nvml, planned", [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"), ("Tesla V100-SXM2-16GB", "V100-16GB")])
def test_the_gpu_nvml_names_is_the_planners(nvml, planned):
    assert gpu_of_device(nvml, gpu(planned).bytes) == planned


def test_a_card_the_planner_does_not_list_is_planned_by_its_size():
    assert gpu_of_device("NVIDIA GeForce RTX 5070", 12227 * MIB) == "11.940430GiB"  # nvidia-smi of shkhln/libc6-shim#14
    assert gpu_of_device("NVIDIA H100 80GB HBM3", 40 * GIB) == "40.000000GiB"  # a MIG slice: not the whole card


def start_of(entry: dict, started: bool = True) -> sc.Start:
    """A corpus log's deployment as a run would know it: NVML's name and total of its GPU."""
    settings = dict(entry.get("settings", {}))
    limit = settings.pop("max_model_len", None) or settings.pop("n_ctx", None)
    kv = settings.pop("kv_cache_dtype", "auto")
    settings.pop("enforce_eager", None)
    g = gpu(entry["gpu"])
    return sc.Start(entry["engine"], entry["engine_version"], entry["model"], max(1, entry.get("tp", 1)), limit,
                    {"engine_options": settings, "kv_dtype": kv, "device": "gpu"}, g.name, g.bytes, started)


def _replannable(e: dict) -> bool:
    """A run plans the deployment as NVML shows it: a GPU kvbench lists, linked as its kind usually is (a run
    cannot see whether an A100 80GB pair is SXM or PCIe; the corpus says so where its source does)."""
    if not ("pool" in e["checks"] and e.get("model") and e.get("gpu")) or e["gpu"] not in gpu_catalog():
        return False
    return e.get("tp", 1) == 1 or e.get("interconnect") in (None, "unknown", gpu(e["gpu"]).interconnect)


REPLANNED = sorted(n for n, e in CORPUS.items() if _replannable(e))


@pytest.mark.parametrize("name", REPLANNED)
def test_a_runs_check_of_a_corpus_log_is_the_corpus_replan(name):
    """What a run would record for the deployment of each re-plannable corpus log (its lines through the engine's
    parser, the plan through the same startup rule) is the corpus check's own "after" figure."""
    entry = CORPUS[name]
    refused = "refusal" in entry["checks"]
    check = sc.startup_check(parsed(entry), start_of(entry, started=not refused), lambda _: sl._model(entry))
    after = next(r for r in sl.rows_for(entry) if r.check in ("KV pool", "pool tokens"))
    if after.check == "pool tokens":  # an engine that logs its pool in tokens only (TGI)
        d = check["off_by"]["pool_tokens"]
        assert (d["planned"], d["logged"]) == (after.planned, entry["logged"]["tokens"]) and d["ok"] == after.ok
        return
    key = "kv_pool_bytes" if "kv_pool_bytes" in check["off_by"] else "kv_budget_bytes"
    d = check["off_by"][key]
    assert round(d["planned"] / GIB, 2) == after.planned and round(d["logged"] / GIB, 2) == entry["logged"]["kv_gib"]
    assert d["ok"] == after.ok
    if refused:  # the refusal's words where the quote has them; else a failed start, not judged
        words = "refusal" in entry["logged"] or entry["logged"]["kv_gib"] <= 0
        assert check["off_by"]["refusal"] == {"logged": "refused" if words else "failed to start", "planned": "refused",
                                              "ok": True if words else None}


def test_h100_llama3_8b_and_an_h100_gpt_oss_start_are_within_tolerance():
    ok = sc.startup_check(parsed(CORPUS["vllm-10511-llama3-8b-h100-tp1.toml"]),
                          start_of(CORPUS["vllm-10511-llama3-8b-h100-tp1.toml"]), resolve_model)
    assert ok["verdict"] == "plan within tolerance" and ok["deployment"]["gpu_planned"] == "H100-80GB"
    assert ok["planned"]["rule"] == "vLLM's startup rule" and ok["planned"]["klass"] == "vllm v0 dense"
    assert ok["off_by"]["term: non-torch memory"]["ok"] and ok["off_by"]["cuda_total_bytes"]["ok"]
    entry = CORPUS["vllm-27508-gpt-oss-120b-h100-util095.toml"]
    off = sc.startup_check(parsed(entry), start_of(entry, started=False), lambda _: sl._model(entry))
    # V1's profile peak is the larger of the forward and the sampler, not their sum (gpu_model_runner.py
    # profile_run): at 1,024 batched tokens the gpt-oss-120b budget is planned 0.15 GiB over the 1.71 GiB logged
    # (it was +40 % while the two were added); its class (MoE) stays unverified
    # the MoE forward is the fused-MoE kernels' workspaces and V1's sampler the sort path of a pip install: planned
    # with the constants fitted on the whole corpus, it is a class whose error the verdict states (unverified)
    assert off["off_by"]["kv_budget_bytes"]["logged"] == 1.71 * GIB
    assert off["planned"]["verified"] is False and off["off_by"]["refusal"]["logged"] == "failed to start"


def published_start(engine: str, settings: dict) -> sc.Start:
    info = load_run_info(PUBLISHED_CPU)
    version = info["engine_versions"][f"{engine}-{dict((b['engine'], b['version']) for b in info['backends'])[engine]}"]
    return sc.Start(engine, version, "smollm2", 1, info["model"]["max_context"], settings)


def test_a_cpu_start_is_checked_where_its_engine_logs_its_pool():
    """The published CPU run's vLLM (a 757,923,840-byte budget, --max-num-seqs 4, its first line) and llama.cpp
    (-c 32768 -np 4) starts: the plan of the same budget and slots is what each logged."""
    log = (PUBLISHED_CPU / "logs" / "vllm-0.32.0.log").read_text()
    assert "--kv-cache-memory-bytes 757923840" in log.splitlines()[0]
    vllm = sc.startup_check(REGISTRY["vllm"].startup_figures_from_log(log), published_start("vllm", {
        "engine_options": {"max_num_seqs": 4}, "kv_budget_bytes": 757923840, "kv_dtype": "bf16", "device": "cpu"}))
    assert vllm["deployment"]["device"] == "cpu" and vllm["verdict"] == "plan within tolerance"
    assert (vllm["planned"]["pool_tokens"], vllm["planned"]["blocks"], round(vllm["planned"]["concurrency"], 2)) == (
        32896, 257, 4.02)
    llama = sc.startup_check(REGISTRY["llamacpp"].startup_figures_from_log(
        (PUBLISHED_CPU / "logs" / "llamacpp-0.3.36.log").read_text()),
        published_start("llamacpp", {"batch": 4, "kv_dtype": "f16", "device": "cpu"}))
    assert llama["off_by"]["kv_pool_bytes"] == {"logged": 720 * MIB, "planned": 720 * MIB, "error_pct": 0.0, "ok": True}
    assert llama["verdict"] == "plan within tolerance"
    # a CPU start whose engine logs no pool is not checked; nor one whose log says nothing
    assert sc.startup_check({"weights_bytes": 1.0, "device": "cpu"}, published_start("vllm", {"device": "cpu"})) is None
    assert sc.startup_check(None, published_start("vllm", {})) is None


def test_a_drafted_start_is_the_targets_and_the_drafts_kv_is_kept_apart():
    """The published speculation run's llama-server (q8_0 target, the Q4_1 GGUF drafting with its own f16 cache):
    the figures are the target's (its 256.63 MiB of weights, its 26.89 MiB q8_0 cache), not those of the draft
    loaded after it, whose cache is ``draft_kv_pool_bytes``."""
    run = REPO / "results" / "published" / "20261206-speculation-kv-quant-cpu"
    figures = REGISTRY["llamacpp"].startup_figures_from_log(
        (run / "logs" / "llamacpp-0.3.36+speculative=draft_kv-q8_0.log").read_text())
    assert (figures["weights_bytes"], figures["kv_pool_bytes"]) == (round(256.63 * MIB), round(26.89 * MIB))
    assert figures["draft_kv_pool_bytes"] == round(50.62 * MIB) and figures["pool_tokens"] == 2304
    assert any("loading draft model" not in line and "50.62 MiB" in line for line in figures["lines"])


@pytest.mark.parametrize("device, logged, planned, ok", [
    ("cpu", 53078917.0, 28200960.0, False),  # a CPU pool half the size is off, however few GiB that is
    ("gpu", 53078917.0, 28200960.0, True),  # on a GPU 0.5 GiB is within a budget's own movement
    ("cpu", 0.01 * GIB, 14745600.0, True),  # vLLM's "0.01 GiB": within the two decimals it is printed to
    ("cpu", 720 * MIB, 760 * MIB, False), ("gpu", 40 * GIB, 41 * GIB, True), ("gpu", 40 * GIB, 43 * GIB, False),
])
def test_the_tolerance_is_five_percent_with_a_gpus_slack_or_a_printed_figures(device, logged, planned, ok):
    assert sc.off_by({"kv_pool_bytes": logged}, {"kv_pool_bytes": planned}, device=device)["kv_pool_bytes"]["ok"] is ok


def with_checks(run: Path, checks: dict) -> Path:
    RunWriter(run, mode="resume").update_run_info(startup_checks=checks)
    return run


def test_the_report_shows_each_start_beside_the_plan(tmp_path):
    h100 = CORPUS["vllm-10511-llama3-8b-h100-tp1.toml"]
    refused = CORPUS["vllm-10517-llama3.1-8b-3090-29k.toml"]
    checks = {"vllm-0.6.5": sc.startup_check(parsed(h100), start_of(h100), resolve_model),
              "vllm-0.6.4 (29k)": sc.startup_check(parsed(refused), start_of(refused, started=False), resolve_model)}
    run = with_checks(make_run(tmp_path, "gpu", repeats=1, n_requests=2), json.loads(json.dumps(checks)))
    report = build([run])
    ids = [s.id for s in report.sections]
    assert "startup" in ids and ids.index("startup") == ids.index("boundary") + 1
    table = report.sections[ids.index("startup")].table
    first, second = table.iloc[0], table.iloc[1]
    assert (first["on"], first["KV"], first["logged"]) == ("1 x H100-80GB", "memory", "53.29 GiB")
    assert sl.close(float(first["planned"].split()[0]), 53.29)  # the plan within the corpus's tolerance
    assert first["planned by"] == "vLLM's startup rule (vllm v0 dense, unverified)" and first["start"] == "started / plan: starts"
    assert second["concurrency logged"] == "0.82x of 29,000" and second["start"] == "refused / plan: refused"
    assert second["logged"] == "2.89 GiB" and second["planned"].endswith(" GiB")
    from kvbench.reports import markdown
    text = markdown.render(report, tmp_path)
    assert "The engines' startup figures beside the plan" in text and "53.29 GiB" in text
    # a run without checks (every run before this one) has no such section
    assert "startup" not in [s.id for s in build([make_run(tmp_path / "old", "cpu", repeats=1, n_requests=2)]).sections]


def test_a_check_that_could_not_be_made_says_why_in_the_report(tmp_path):
    run = with_checks(make_run(tmp_path, "gpu", repeats=1, n_requests=2),
                      {"sglang-0.5.23": {"error": "PlanError: unknown model"}})
    row = next(s for s in build([run]).sections if s.id == "startup").table
    assert row.iloc[0]["verdict"] == "not checked: PlanError: unknown model"


# --- through the runner: a started SGLang (the fake's launch log) on a GPU NVML names -------------------

def test_a_gpu_run_records_the_engines_startup_figures_beside_the_plan(tmp_path, monkeypatch, smollm2):
    from kvbench.common.hardware import NVML
    from kvbench.run.backend_config import BackendConfig
    from kvbench.run.runner import Runner, RunOptions
    from kvbench.workloads import Workload

    from tests.backends.sglang.test_adapter import env_with_stand_in
    from tests.fakes.fake_nvml import FakeDevice, FakeNVML

    env = env_with_stand_in(tmp_path)
    monkeypatch.setattr("kvbench.run.start.ensure_env", lambda recipe, log=None: env)
    monkeypatch.setenv("KVBENCH_GPU", "1")
    monkeypatch.setenv("FAKE_SGLANG_TOKEN_DELAY_S", "0.001")
    workload = Workload(name="sgl", seed=3, prompt_tokens=[48], output_tokens=8, concurrency=[2], rounds=1,
                        warmup_requests=0)
    opts = RunOptions(model="smollm2", workload=workload, backends=[BackendConfig.parse("sglang")],
                      results_dir=tmp_path / "runs", run_id="gpu", estimate=False)
    runner = Runner(opts, Console(file=io.StringIO(), width=200))
    runner.nvml = NVML(module=FakeNVML([FakeDevice("NVIDIA H200")]))
    run_dir = runner.run()
    check = load_run_info(run_dir)["startup_checks"]["sglang-0.5.23"]
    limit = check["deployment"]["max_model_len"]
    given = 2 * limit  # sized: --max-total-tokens for 2 sequences at the server's limit
    assert limit == 48 + 8 and check["engine"]["pool_tokens"] == given
    assert check["engine"]["weights_bytes"] == 0.26 * GIB  # the fake's "Load weight end. ... mem usage=0.26 GB"
    assert check["deployment"]["gpu_planned"] == "H200" and check["deployment"]["gpu_name"] == "NVIDIA H200"
    assert check["planned"]["pool_tokens"] == given and f"capped at the {given} tokens it was given" in check[
        "planned"]["rule"]
    assert check["off_by"]["pool_tokens"]["ok"] and check["off_by"]["refusal"]["logged"] == "started"
    assert check["planned"]["requests_at_limit"] == 2 and "line" not in check["planned"]
    table = build([run_dir]).sections
    assert "startup" in [s.id for s in table]
    shutil.rmtree(run_dir)
