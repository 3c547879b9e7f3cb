"""\"Did you mean ...?\" for a mistyped name: an engine, an option, a workload, a model."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice nearest to ``word`` when one is near enough to be a typo of it, else None."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match and match[0] != word else None


def hint(word: str, choices: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` or ``""``."""
    match = closest(word, choices)
    return f"did you mean {match!r}? " if match else ""


def with_hint(message: str, word: str, choices: Iterable[str]) -> str:
    """``message`` with a "did you mean" put before its list of allowed values (``; known: ...``,
    ``; allowed: ...``, ``; catalog: ...``), or at its end."""
    h = hint(word, choices)
    if not h or h in message:
        return message
    for marker in ("; known:", "; allowed:", "; catalog:"):
        at = message.find(marker)
        if at >= 0:
            return f"{message[:at]}; {h}{message[at + 2:]}"
    return f"{message}; {h.strip()}"

