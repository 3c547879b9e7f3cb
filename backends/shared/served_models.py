"""The models an OpenAI-compatible server says it serves: the ids of its ``/v1/models``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from ..capabilities import ServedModel

if TYPE_CHECKING:
    from ..base import Backend


def served_model_ids(http: httpx.Client, base_url: str) -> list[str] | None:
    """The ids an OpenAI-compatible server's /v1/models lists (vLLM, llama-server, SGLang); None where the
    server has no such route or answers something else."""
    try:
        return [str(m["id"]) for m in http.get(base_url + "/v1/models").json()["data"]]
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class OpenAIModelList(ServedModel):
    """The served-model group of a server with an OpenAI-compatible /v1/models."""

    def models(self, backend: Backend) -> list[str] | None:
        return served_model_ids(backend.http, backend.base_url)
