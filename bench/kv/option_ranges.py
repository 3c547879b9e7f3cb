"""What an engine option takes (``KVRules.rule_options``; `kvbench plan --engine-option KEY=VALUE`), as the
engine itself checks it, and the error the KV rules raise for a value or question they refuse."""
from __future__ import annotations

import math
from dataclasses import dataclass


class KVRuleError(ValueError):
    """A question the engine refuses (a KV dtype it lacks, a split it rejects, a block size it has not)."""


#: The most a whole-number engine option takes where its engine says no less: a C int's, beyond any count of
#: requests, tokens or MiB a plan meets.
MAX_WHOLE_OPTION = 2**31 - 1


class OptionRange:
    """What one engine option (``KVRules.rule_options``; `kvbench plan --engine-option KEY=VALUE`) takes, as
    the engine itself checks it. :meth:`read` gives the value the rules read from the text or value given, or
    raises :class:`KVRuleError` in one line naming the range."""

    def describe(self) -> str:
        raise NotImplementedError

    def read(self, key: str, value):
        raise NotImplementedError

    def refuse(self, key: str, value) -> KVRuleError:
        return KVRuleError(f"{key} takes {self.describe()}, not {value!r}")


@dataclass(frozen=True)
class Number(OptionRange):
    """A finite number between ``low`` and ``high``, each bound open or closed."""

    low: float
    high: float
    low_open: bool = True
    high_open: bool = False

    def describe(self) -> str:
        return (f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")

    def read(self, key: str, value) -> float:
        try:
            number = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError, OverflowError):
            number = None
        if number is None or not (math.isfinite(number)
                                  and (self.low < number if self.low_open else self.low <= number)
                                  and (number < self.high if self.high_open else number <= self.high)):
            raise self.refuse(key, value)
        return number


@dataclass(frozen=True)
class Whole(OptionRange):
    """A whole number from ``low`` to ``high`` (of ``unit``, where it has one)."""

    low: int = 1
    high: int = MAX_WHOLE_OPTION
    unit: str = ""

    def describe(self) -> str:
        of = f" of {self.unit}" if self.unit else ""
        return f"a whole number{of} from {self.low:,} to {self.high:,}"

    def read(self, key: str, value) -> int:
        if isinstance(value, bool) or isinstance(value, float):
            raise self.refuse(key, value)
        try:
            number = int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:  # text, or more digits than int() reads
            raise self.refuse(key, value) from None
        if not self.low <= number <= self.high:
            raise self.refuse(key, value)
        return number


SWITCH_WORDS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


@dataclass(frozen=True)
class Switch(OptionRange):
    """On or off: on/off, true/false, yes/no, 1/0; read as a bool."""

    def describe(self) -> str:
        return "on or off (true/false, yes/no, 1/0)"

    def read(self, key: str, value) -> bool:
        word = str(value).strip().lower()
        if word not in SWITCH_WORDS:
            raise self.refuse(key, value)
        return SWITCH_WORDS[word]


@dataclass(frozen=True)
class Choice(OptionRange):
    """One of ``choices`` (lower case; ``aliases`` maps other words to them)."""

    choices: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return f"one of {', '.join(self.choices)}"

    def read(self, key: str, value) -> str:
        word = str(value).strip().lower()
        word = dict(self.aliases).get(word, word)
        if word not in self.choices:
            raise self.refuse(key, value)
        return word
