"""vLLM's speculative decoding (``--speculative-config`` JSON, vllm/config/speculative.py): n-gram prompt
lookup, a draft model, an EAGLE head. It says nothing of a request's drafts in its answer: the cell's figures
come from its counters on /metrics (``vllm:spec_decode_num_drafts``, ``..._draft_tokens``,
``..._accepted_tokens``: vllm/v1/spec_decode/metrics.py, SpecDecodingProm)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvbench.kv.geometry import kv_bytes_per_token
from kvbench.kv.model_config import geometry_from_hf

from ..capabilities import Speculation
from ..shared.speculation import counter_names, read_counters
from ..types import SpeculationCounters

if TYPE_CHECKING:
    import httpx

    from kvbench.common.models import ModelFiles

    from ..base import Backend

PREFIX = "vllm:"
#: vLLM has no default count (a draft model without one is refused): kvbench passes llama.cpp's default
DEFAULT_TOKENS = 3
DRAFT_DEFAULT = "the model's own HF folder (draft = target: accepts nearly every token; a test of the path)"
#: kvbench's names -> vLLM's method
METHOD = {"ngram": "ngram", "draft": "draft_model", "eagle": "eagle"}


def draft_folder(options: dict, model: ModelFiles) -> str | None:
    """The drafter's folder for a method that loads one (the draft_model option, else the model's own)."""
    method = str(options.get("speculative", "none"))
    if method not in ("draft", "eagle"):
        return None
    return str(Path(str(options["draft_model"])).expanduser()) if options.get("draft_model") else str(model.hf_dir)


def draft_kv_share(options: dict, model: ModelFiles, dtype: str) -> float:
    """The drafter's KV per token over the target's: a draft model's layers take blocks of the same pool (its
    own KV cache group), so a pool sized for the target alone would hold fewer sequences than asked."""
    folder = draft_folder(options, model)
    if folder is None:
        return 0.0
    try:
        return kv_bytes_per_token(geometry_from_hf(folder), dtype) / kv_bytes_per_token(model.geometry, dtype)
    except (OSError, ValueError):
        return 1.0  # unreadable here: room for a drafter as large as the target (vLLM reads it at start)


@dataclass(frozen=True)
class VLLMSpeculation(Speculation):
    def server_args(self, backend: Backend, method: str, tokens: int | None, draft: str | None) -> list[str]:
        if method in ("", "none"):
            return []
        config = {"method": METHOD[method], "num_speculative_tokens": tokens or DEFAULT_TOKENS}
        if method in ("draft", "eagle"):
            config["model"] = draft
        return ["--speculative-config", json.dumps(config)]

    def draft_problem(self, path: Path) -> str | None:
        """A drafter is an HF folder: config.json and weights."""
        if not path.is_dir():
            return "no such folder (vLLM's drafter is an HF model folder)"
        return None if (path / "config.json").is_file() else "no config.json in it (vLLM's drafter is an HF folder)"

    def counters(self, backend: Backend, client: httpx.Client) -> SpeculationCounters | None:
        return read_counters(backend.metrics(client, counter_names(PREFIX)), PREFIX)


SPECULATION = VLLMSpeculation(
    methods={"ngram": '--speculative-config {"method": "ngram"} (prompt lookup, prompt_lookup_min/max 5)',
             "draft": '--speculative-config {"method": "draft_model", "model": FOLDER}',
             "eagle": '--speculative-config {"method": "eagle", "model": HEAD} (not measured here: no EAGLE '
                      'head for the embedded model)'},
    counters_source="vllm:spec_decode_num_draft_tokens/accepted_tokens/drafts on /metrics",
    needs_draft_model=("eagle",))
