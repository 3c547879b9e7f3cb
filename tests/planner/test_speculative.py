"""kvbench plan --speculative: a drafter's weights and KV where each engine keeps it (issue 51), on real public
configs (tests/data/configs: Llama 3.1 8B with Llama 3.2 1B as its draft; DeepSeek-V3's MTP layer), with every
figure worked by hand from the configs, and the flags' refusals."""
import json

import pytest

from kvbench.planner import PlanInput, plan, resolve_model, setup
from tests.helpers import REPO as ROOT, kvbench_here

CONFIGS = ROOT / "tests" / "data" / "configs"
TARGET, DRAFT = str(CONFIGS / "llama-3.1-8b.json"), str(CONFIGS / "llama-3.2-1b.json")
# by hand: Llama 3.1 8B, 32 layers x 8 KV heads x 128 x (K + V) x 2 B; Llama 3.2 1B, 16 x 8 x 64 x 2 x 2 B
TARGET_PER_TOKEN, DRAFT_PER_TOKEN = 32 * 8 * 128 * 2 * 2, 16 * 8 * 64 * 2 * 2


def planned(engine, speculative="draft", draft=DRAFT, **kw):
    kw = {"gpu": "H100-80GB", "max_model_len": 8192, **kw}
    p = PlanInput(resolve_model(TARGET), engine=engine, speculative=speculative,
                  draft_model=resolve_model(draft) if draft else None, draft_label=draft or "", **kw)
    return p, plan(p, with_levers=False)


def test_hand_worked_per_token_figures():
    assert (TARGET_PER_TOKEN, DRAFT_PER_TOKEN) == (131_072, 32_768)


def test_vllm_blocks_hold_the_drafters_pages_and_its_weights_come_first():
    p, r = planned("vllm")
    s = setup(p)
    q = s.question(context=8192, batch=1)
    # one KV cache group: a block of 16 holds every layer's page, the drafter's 16 layers beside the target's 32
    assert s.rules.bytes_per_block(q) == 16 * TARGET_PER_TOKEN
    assert s.bytes_per_block(q) == 16 * (TARGET_PER_TOKEN + DRAFT_PER_TOKEN)
    spec = r["speculation"]
    assert spec["draft_kv_bytes_per_token"] == DRAFT_PER_TOKEN == spec["draft_kv_priced_per_token"]
    assert spec["target_kv_bytes_per_token"] == TARGET_PER_TOKEN and spec["draft_layers"] == 16
    assert spec["where"].startswith("the target's KV pool") and spec["unpriced_bytes_per_gpu"] == 0
    # the drafter's weights (1.24 B parameters x 2 B, its config's estimate) leave the pool less budget
    assert spec["draft_weights_bytes_per_gpu"] == resolve_model(DRAFT).weights.bytes
    alone = plan(PlanInput(resolve_model(TARGET), engine="vllm", gpu="H100-80GB", max_model_len=8192),
                 with_levers=False)["startup"]
    assert r["startup"]["kv_budget_bytes"] == pytest.approx(alone["kv_budget_bytes"] - spec["draft_weights_bytes_per_gpu"])
    # the pool's tokens: the budget over the larger block; without the drafter, the target's plan as before
    blocks = int(r["startup"]["kv_budget_bytes"] // (16 * (TARGET_PER_TOKEN + DRAFT_PER_TOKEN)))
    assert spec["with"]["pool_tokens"] == (blocks * 8192 // 512) and spec["without"]["pool_tokens"] == alone["pool_tokens"]
    assert spec["with"]["pool_tokens"] < 0.81 * spec["without"]["pool_tokens"]  # 131,072 / 163,840 and less budget
    terms = [row["term"] for row in r["ledger"]]
    assert terms[:4] == ["weights", "kv", "draft weights", "draft KV"]
    assert "--speculative-config" in spec["flag"] and '"draft_model"' in spec["flag"]


def test_llamacpp_draft_context_has_the_same_cells_in_its_own_dtype():
    _, r = planned("llamacpp")
    spec = r["speculation"]
    assert spec["draft_kv_bytes_per_gpu"] == DRAFT_PER_TOKEN * 8192  # -c 8192 -np 1: one stream of 8,192 cells
    assert spec["where"].startswith("its own context") and "--model-draft" in spec["flag"]
    draft_kv = next(row for row in r["ledger"] if row["term"] == "draft KV")
    assert draft_kv["bytes"] == DRAFT_PER_TOKEN * 8192
    # --cache-type-k-draft/-v-draft q8_0: 34 bytes per 32 values
    _, q8 = planned("llamacpp", engine_options={"draft_kv_dtype": "q8_0"})
    assert q8["speculation"]["draft_kv_bytes_per_gpu"] == 16 * 8 * 64 * 2 * 8192 * 34 // 32
    # 3 slots at the limit: every stream of the draft context too
    _, three = planned("llamacpp", batch=3, context=8192)
    assert three["speculation"]["draft_kv_bytes_per_gpu"] == DRAFT_PER_TOKEN * 8192 * 3


def test_sglang_prices_the_drafter_at_the_targets_layers_and_says_unverified():
    _, r = planned("sglang")
    spec = r["speculation"]
    assert spec["draft_kv_priced_per_token"] == TARGET_PER_TOKEN * 16 / 32  # cell_size x (1 + 16 / 32)
    assert spec["draft_kv_bytes_per_token"] == DRAFT_PER_TOKEN and not spec["verified"]
    assert "unverified" in spec["line"]
    # a drafter whose layers are wider than the target's: its own pool takes more than its price
    big = PlanInput(resolve_model(DRAFT), engine="sglang", gpu="H100-80GB", max_model_len=8192, speculative="draft",
                    draft_model=resolve_model(TARGET), draft_label=TARGET)
    spec = plan(big, with_levers=False)["speculation"]
    assert spec["draft_kv_priced_per_token"] == DRAFT_PER_TOKEN * 32 / 16 == 65_536
    assert spec["draft_kv_bytes_per_token"] == TARGET_PER_TOKEN
    assert spec["unpriced_bytes_per_gpu"] == (TARGET_PER_TOKEN - 65_536) * spec["with"]["pool_tokens"] > 0
    assert "beyond the budget" in spec["line"]


def test_deepseek_v3_mtp_is_one_mla_layer_whose_weights_the_checkpoint_holds():
    p = PlanInput(resolve_model("deepseek-v3"), engine="vllm", gpu="H200", tp=8, max_model_len=32768,
                  speculative="mtp")
    r = plan(p, with_levers=False)
    spec = r["speculation"]
    # num_nextn_predict_layers 1: one latent of kv_lora_rank 512 + rope 64 at 2 B, on every rank
    assert spec["draft_layers"] == 1 and spec["draft_kv_bytes_per_token"] == (512 + 64) * 2
    assert spec["target_kv_bytes_per_token"] == 61 * (512 + 64) * 2
    assert spec["draft_weights_bytes_per_gpu"] == 0 and "14.36 GiB" in spec["draft_weights_source"]
    assert '"mtp"' in spec["flag"]


def test_eagle_without_a_head_config_is_one_layer_of_the_targets_shape():
    _, r = planned("vllm", speculative="eagle", draft=None)
    spec = r["speculation"]
    assert spec["draft_layers"] == 1 and spec["draft_kv_bytes_per_token"] == TARGET_PER_TOKEN / 32
    assert spec["drafter"] == "one decoder layer of the target's shape" and spec["draft_model"] is None


def test_ngram_needs_no_memory_on_the_gpu():
    for engine in ("vllm", "llamacpp", "sglang"):
        _, r = planned(engine, speculative="ngram", draft=None)
        spec = r["speculation"]
        assert spec["draft_kv_bytes_per_gpu"] == 0 == spec["draft_weights_bytes_per_gpu"]
        assert spec["with"] == spec["without"] and "no drafter weights or KV" in spec["line"]


@pytest.mark.parametrize("args, says", [
    (["--speculative", "medusa"], "--speculative is one of none, ngram, draft, eagle, mtp"),
    (["--speculative", "draft"], "--speculative draft needs --draft-model"),
    (["--speculative", "ngram", "--draft-model", DRAFT], "--draft-model is the drafter of --speculative draft"),
    (["--draft-model", DRAFT], "--draft-model is the drafter of --speculative draft"),
    (["--speculative-tokens", "3"], "--speculative-tokens needs --speculative"),
    (["--speculative", "ngram", "--speculative-tokens", "0"], "--speculative-tokens"),
    (["--speculative", "ngram", "--speculative-tokens", "-1"], "--speculative-tokens"),
    (["--speculative", "ngram", "--speculative-tokens", "nan"], "--speculative-tokens"),
    (["--speculative", "ngram", "--speculative-tokens", "1e9"], "--speculative-tokens"),
    (["--speculative", "ngram", "--speculative-tokens", "5000"], "--speculative-tokens takes at most 1,024"),
    (["--speculative", "ngram", "--speculative-tokens", "9" * 400], "--speculative-tokens"),
    (["--speculative", "mtp"], "no multi-token-prediction layers"),
    (["--speculative", "draft", "--draft-model", "/no/such/draft.json"], "no such file"),
    (["--speculative", "draft", "--draft-model", "a b\n"], "error"),
])
def test_bad_speculative_flags_are_one_line_exit_2(args, says):
    r = kvbench_here("plan", TARGET, "--engine", "vllm", "--gpu", "H100-80GB", *args)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


@pytest.mark.parametrize("engine, method", [("ollama", "draft"), ("tgi", "ngram"), ("hf", "eagle")])
def test_a_method_the_engine_lacks_is_refused(engine, method):
    extra = ["--draft-model", DRAFT] if method == "draft" else []
    r = kvbench_here("plan", TARGET, "--engine", engine, "--gpu", "H100-80GB", "--speculative", method, *extra)
    assert r.returncode == 2 and f"--speculative {method}: {engine} has no such speculative decoding" in r.stderr


def test_the_plain_formula_asks_for_an_engine():
    r = kvbench_here("plan", TARGET, "--gpu", "H100-80GB", "--speculative", "ngram")
    assert r.returncode == 2 and "give --engine" in r.stderr


def test_json_and_screen_carry_the_speculation():
    args = ("plan", TARGET, "--engine", "vllm", "--gpu", "H100-80GB", "--max-model-len", "8192", "--speculative",
            "draft", "--draft-model", DRAFT, "--speculative-tokens", "5")
    r = kvbench_here(*args, "--json")
    assert r.returncode == 0
    spec = json.loads(r.stdout)["speculation"]
    assert spec["tokens"] == 5 and '"num_speculative_tokens": 5' in spec["flag"]
    assert set(spec["with"]) == {"pool_tokens", "requests_at_limit", "refusal"}
    screen = kvbench_here(*args).stdout
    assert "Speculative decoding (draft:" in screen and "without the drafter:" in screen
    assert "draft weights" in screen and "draft KV" in screen


def test_compare_engines_shows_each_engines_drafter():
    r = kvbench_here("plan", TARGET, "--gpu", "H100-80GB", "--max-model-len", "8192", "--compare-engines",
                     "--speculative", "draft", "--draft-model", DRAFT, "--json")
    assert r.returncode == 0
    rows = {e["engine"]: e for e in json.loads(r.stdout)["engines"]}
    assert rows["vllm"]["speculation"].startswith("draft: the target's KV pool")
    assert rows["vllm"]["tokens"] < rows["vllm"]["tokens_without"]
    assert rows["llamacpp"]["speculation"].startswith("draft: its own context")
    assert rows["ollama"]["speculation"] == "no draft speculative decoding" and rows["ollama"]["tokens_without"] is None
