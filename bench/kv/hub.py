"""Models named by their hub id (``org/name``, as copied from the hub), through huggingface_hub and its cache.

``kvbench plan`` needs the config alone (and the safetensors index, which gives the exact weight bytes);
``kvbench run`` needs the whole model. Both go through huggingface_hub, so its cache, ``HF_HUB_OFFLINE``,
``HF_ENDPOINT`` and ``HF_TOKEN`` apply as they do for every other tool. The token is read from the
environment by huggingface_hub and never written by kvbench. Failures are one line saying what to do.
"""
from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PLAN_FILES = ("config.json", "model.safetensors.index.json")
RUN_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
# a run whose every engine is attached (a server already serving the model) needs no weights: the config for
# the KV, the index for the weights' size, the tokenizer for token-exact prompts
ATTACHED_RUN_PATTERNS = [p for p in RUN_PATTERNS if p != "*.safetensors"]


class HubError(ValueError):
    pass


def _quiet() -> None:
    """huggingface_hub logs a warning for each failed request before raising: kvbench says it once, itself."""
    from huggingface_hub.utils import logging

    logging.set_verbosity_error()


def looks_like_hub_id(text: str) -> bool:
    return bool(HUB_ID.match(text)) and not Path(text).expanduser().exists()


def _explain(repo_id: str, exc: Exception) -> HubError:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return HubError(f"{repo_id} is gated: accept its licence on the hub with your account, then set HF_TOKEN "
                        "(read from the environment; kvbench never stores it)")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"no model {repo_id} on the hub (or it is private: set HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{repo_id}: no such revision on the hub")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        return HubError(f"{repo_id} is not in the local hub cache ({constants.HF_HUB_CACHE}) and {why}: download it "
                        f"once where the hub is reachable (hf download {repo_id}), or give a local folder")
    return HubError(f"{repo_id}: the hub answered {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def config_folder(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder in the hub cache holding the model's config.json (and its safetensors index, when
    the repository has one): enough to plan, without the weights."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    _quiet()
    try:
        config = Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except LocalEntryNotFoundError as exc:
        raise _explain(repo_id, exc) from None
    except EntryNotFoundError:
        raise HubError(f"{repo_id} has no config.json on the hub: kvbench needs an HF-format model") from None
    except (HfHubHTTPError, OSError) as exc:
        raise _explain(repo_id, exc) from None
    try:
        hf_hub_download(repo_id, "model.safetensors.index.json", revision=revision)
    except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError):
        pass  # a single-file checkpoint has no index; the weights are then estimated from the config
    return config.parent


def model_folder(repo_id: str, revision: str | None = None, weights: bool = True) -> Path:
    """The whole model (config, tokenizer, safetensors) in the hub cache, downloaded once; without
    ``weights``, all but the safetensors (a run against servers that already serve it)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    _quiet()
    try:
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=RUN_PATTERNS if weights else ATTACHED_RUN_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise _explain(repo_id, exc) from None

