"""llama-server's speculative decoding (``--spec-type``): n-gram lookup in the request's own tokens
(``ngram-simple``) and a draft model (``draft-simple`` with ``--model-draft``). Each request's last stream event
says what it drafted and accepted (``timings.draft_n``, ``timings.draft_n_accepted``: present only where it
drafted), and /metrics counts the drafts (``llamacpp:spec_decode_num_*``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..capabilities import Speculation
from ..prometheus import capped_get, metric_samples
from ..shared.speculation import counter_names, read_counters
from ..types import EngineStartError, SpeculationCounters

if TYPE_CHECKING:
    import httpx

    from kvbench.common.models import ModelFiles

    from ..base import Backend

PREFIX = "llamacpp:"
DRAFT_DEFAULT = ("for a model with its own GGUF (the embedded model's Q4_1): that GGUF drafts for the 16-bit "
                 "GGUF llama.cpp's converter makes of its HF folder (served instead); else required")


#: gguf=converted: serve the GGUF llama.cpp's converter makes of the HF folder (the default draft's target)
CONVERTED = "converted"


def drafter(options: dict, model: ModelFiles) -> tuple[str, Path | None]:
    """The speculation method and its draft GGUF (None for none or ngram): the draft_model option, else the
    model's own GGUF (the embedded model's Q4_1), which then drafts for the 16-bit GGUF converted from its HF
    folder (the adapter serves that instead)."""
    method = str(options.get("speculative", "none"))
    if method != "draft":
        return method, None
    if options.get("draft_model"):
        return method, Path(str(options["draft_model"])).expanduser()
    if model.gguf_path is None or options.get("gguf") not in (None, CONVERTED):
        raise EngineStartError("speculative=draft: this model has no GGUF of its own to draft with: give "
                               "draft_model=PATH (a GGUF)")
    return method, model.gguf_path


@dataclass(frozen=True)
class LlamaServerSpeculation(Speculation):
    def server_args(self, backend: Backend, method: str, tokens: int | None, draft: str | None) -> list[str]:
        if method in ("", "none"):
            return []
        if method == "ngram":  # the draft's length is the m-gram's (--spec-draft-n-max is the draft model's)
            return ["--spec-type", "ngram-simple", *(["--spec-ngram-simple-size-m", str(tokens)] if tokens else [])]
        if method == "draft" and draft:
            return ["--spec-type", "draft-simple", "--model-draft", str(draft),
                    *(["--spec-draft-n-max", str(tokens)] if tokens else [])]
        return super().server_args(backend, method, tokens, draft)

    def draft_problem(self, path: Path) -> str | None:
        """A draft model is a GGUF file (its magic read, nothing more)."""
        if not path.is_file():
            return "no such file (llama.cpp's draft model is a GGUF file)"
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        return None if magic == b"GGUF" else "not a GGUF file (llama.cpp's draft model is one)"

    def counters(self, backend: Backend, client: httpx.Client) -> SpeculationCounters | None:
        response = capped_get(client, backend.base_url + "/metrics")
        if response.status_code != 200:  # started without --metrics
            return None
        return read_counters(metric_samples(response.text, counter_names(PREFIX)), PREFIX)


SPECULATION = LlamaServerSpeculation(
    methods={"ngram": "--spec-type ngram-simple (n-gram lookup in the request's tokens; speculative_tokens: "
                      "--spec-ngram-simple-size-m)",
             "draft": "--spec-type draft-simple --model-draft GGUF (speculative_tokens: --spec-draft-n-max)"},
    per_request="timings.draft_n and timings.draft_n_accepted of each request's last event",
    counters_source="llamacpp:spec_decode_num_draft_tokens/accepted_tokens/drafts on /metrics")
