"""TGI's memory on a GPU after its warmup. Imports only kvbench.kv.

TGI's launcher passes --cuda-memory-fraction (default 1.0) to its shards; the shard's warmup runs a prefill of
max_batch_prefill_tokens (4096 by default), then gives its KV blocks the free memory x TGI_WIGGLE_ROOM
(server/text_generation_server/models/flash_causal_lm.py warmup; globals.py TGI_WIGGLE_ROOM, read as 0.90 in
the one copy of globals.py found, not confirmed for the CUDA server): the router logs the blocks' tokens as
"Setting max batch total tokens to N" (``pool_fills_budget``). The warmup's peak uses the same per-token widths
as vLLM's profile, unscaled. Two public TGI logs (tests/data/startup_logs/tgi-*: TGI 2.2.0 on an A10G, a
Llama 3.1 70B on 2 x A100 80GB) hold 2.4-2.6x fewer tokens than this rule gives: TGI holds more than it
models (CUDA graphs, the warmup's logits); no constant is fitted on two logs, and every TGI class stays
unverified.
"""
from __future__ import annotations

from kvbench.kv.startup import StartupMemory, StartupQuestion, StartupTerm

WIGGLE_ROOM = 0.90
PREFILL_TOKENS = 4096


def startup_memory(rules, q: StartupQuestion) -> StartupMemory:
    fraction = float(q.options.get("cuda_memory_fraction") or 1.0)
    tokens = int(q.options.get("max_batch_prefill_tokens") or PREFILL_TOKENS)
    terms = []
    if q.widths is not None:
        w, tp = q.widths, max(1, q.kv.tp)
        mlp = w.experts_per_token * w.expert_intermediate if w.experts else w.intermediate
        peak = tokens * 2 * (3 * mlp / tp + 4 * w.hidden)
        terms.append(StartupTerm("warmup peak", peak, f"{tokens:,} prefill tokens x 2 B x (3 x {mlp:,} / {tp} + 4 x "
                                 f"{w.hidden:,}) (not fitted: no TGI log)", True))
    budget = q.cuda_bytes * fraction - q.weights_bytes - sum(t.bytes for t in terms)
    terms.append(StartupTerm("wiggle room", max(0.0, budget) * (1 - WIGGLE_ROOM),
                             f"{1 - WIGGLE_ROOM:.0%} of the free memory after warmup left free (TGI_WIGGLE_ROOM "
                             f"{WIGGLE_ROOM})", True))
    return StartupMemory("tgi", "TGI", fraction, f"--cuda-memory-fraction {fraction:g}", q.cuda_bytes, q.cuda_source,
                         tuple(terms), "tgi", False, "unverified: the public TGI startup logs hold 2.4-2.6x fewer "
                         "tokens than this rule gives (tests/data/startup_logs/tgi-*)", pool_fills_budget=True)
