"""A run's prompt salt (:class:`PromptSalt`): what keeps its prompts apart from every other run's (see
bench/run/cells.py). A module of its own, light, so that the run's options check ``--prompt-salt`` without
loading the prompts' builder (numpy, the tokenizer)."""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from kvbench.store.errors import RunFolderError

_SALT = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class PromptSalt:
    """What keeps a run's prompts apart from every other run's. ``value`` None: unsalted (the prompts of
    every run before salts, and of every ``--prompt-salt none`` run). ``in_tokens``: the salt changes the
    prompts' tokens (the same for every engine of the run); else the tokens stay the unsalted ones and each
    request carries the salt in the engine's cache-isolation field (vLLM's ``cache_salt``): possible only
    when every engine of the run has one."""

    value: str | None
    in_tokens: bool = True

    @classmethod
    def parse(cls, text: str | None, isolated: bool) -> "PromptSalt":
        """``--prompt-salt``: None or "auto" draws one, "none" switches salting off, else the salt itself.
        ``isolated``: every engine of the run has a cache-isolation field."""
        if text is None or text == "auto":
            return cls(secrets.token_hex(6), in_tokens=not isolated)
        if text == "none":
            return cls(None)
        if not _SALT.fullmatch(text):
            raise ValueError(f"--prompt-salt {text!r}: 1-64 letters, digits, '.', '_' or '-' "
                             "(or auto, or none for unsalted prompts)")
        return cls(text, in_tokens=not isolated)

    @property
    def applied(self) -> str:
        """How the salt reached the engines, for run.json."""
        if self.value is None:
            return "none: unsalted prompts (an earlier run's, token for token)"
        return "in the prompts' tokens" if self.in_tokens else "in each request's cache-isolation field"

    def to_dict(self) -> dict:
        return {"value": self.value, "in_tokens": self.in_tokens, "applied": self.applied}

    @classmethod
    def resumed(cls, record: dict | None, asked: str | None, isolated: bool) -> "PromptSalt":
        """A resumed run's salt: the one its run.json recorded (none for a run from before salts: its
        prompts were unsalted), which its unfinished cells must keep; a different ``--prompt-salt`` is
        refused (RunFolderError)."""
        recorded = cls(record.get("value"), bool(record.get("in_tokens", True))) if record else cls(None)
        if asked not in (None, "auto") and cls.parse(asked, isolated).value != recorded.value:
            raise RunFolderError(f"--resume: the run's cells were built with prompt salt {recorded.value or 'none'}, "
                             f"not {asked}: leave --prompt-salt out to resume it")
        return recorded


UNSALTED = PromptSalt(None)
