"""Each engine's options (``-b ENGINE:KEY=VALUE,...``), declared once per adapter as ``option_specs`` and
checked here: an unknown key or a value of the wrong type is an error naming the allowed keys, not an
option silently ignored. ``kvbench backends`` lists them."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.common.suggest import hint


class OptionError(ValueError):
    pass


@dataclass(frozen=True)
class Option:
    name: str
    type: type  # bool, int, float or str
    default: object = None  # the value used when the option is not given (None: none / the engine's own)
    help: str = ""
    choices: tuple[str, ...] = ()  # for a str option: its allowed values
    default_text: str = ""  # how the default is shown when it is computed, e.g. "1 on <= 2 cores"
    # the range of a number option: an int is a count (threads, GPUs, tokens, bytes): 1 or more unless
    # ``minimum`` says otherwise; a float is finite and above 0, at most ``maximum`` (a fraction: 1)
    minimum: float | None = None
    maximum: float | None = None

    @property
    def type_name(self) -> str:
        if self.choices:
            return "|".join(self.choices)
        return self.type.__name__

    @property
    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        return "-" if self.default is None else str(self.default).lower() if isinstance(self.default, bool) else str(self.default)


#: Keys every engine takes: where its server is (attach mode), and how to reach a secured one.
COMMON = (
    Option("url", str, None, "attach to the server already running at this URL instead of starting one"),
    Option("api_key_env", str, None, "name of an environment variable holding an API key, sent as a bearer token"),
    Option("ca_bundle", str, None, "CA bundle (PEM file) to verify an https server's certificate with"),
)

#: Every engine that starts a server passes these on to it.
EXTRA_ARGS = Option("extra_args", str, None, "more arguments for the server's command line (split on spaces)")


#: The engine options of speculative decoding (docs/speculation.md), one spelling on every engine that has it;
#: an engine without it refuses them by name (:func:`validate`).
SPECULATION_KEYS = ("speculative", "speculative_tokens", "draft_model")
#: speculative_tokens at most: past every engine's default (3 to 16) and the longest drafts of their docs, and
#: small enough that a typo (a token count meant as a context) is refused before an engine starts
MAX_SPECULATIVE_TOKENS = 64


def speculation_options(methods: tuple[str, ...], tokens_default: str, draft_default: str) -> tuple[Option, ...]:
    """The speculation options of an engine with the drafters ``methods`` ("none" added first)."""
    return (
        Option("speculative", str, "none", "speculative decoding: none, or the drafter (ngram: n-gram lookup "
               "in the request's own tokens; draft: a draft model; eagle: an EAGLE head); docs/speculation.md",
               choices=("none", *methods)),
        Option("speculative_tokens", int, None, "tokens the drafter proposes a step", default_text=tokens_default,
               maximum=MAX_SPECULATIVE_TOKENS),
        Option("draft_model", str, None, "the draft model (or EAGLE head) of speculative=draft (eagle)",
               default_text=draft_default),
    )


def specs_of(cls) -> dict[str, Option]:
    """Every option an adapter class takes: its own and the common ones."""
    return {o.name: o for o in (*COMMON, *cls.option_specs)}


def coerce(engine: str, spec: Option, value):
    """``value`` (as the option parser read it: bool, int, float or str) as ``spec.type``, or an error
    naming the option and what it takes."""
    def wrong(what: str) -> OptionError:
        return OptionError(f"option {spec.name!r} for {engine} takes {what}, not {value!r}")

    if spec.type is bool:
        if isinstance(value, bool):
            return value
        raise wrong("true or false")
    if spec.type is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return _in_range(engine, spec, value, 1)
        raise wrong("an integer")
    if spec.type is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return _in_range(engine, spec, float(value), None)
        raise wrong("a finite number")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if spec.choices and text not in spec.choices:
        raise OptionError(f"option {spec.name!r} for {engine} takes one of {', '.join(spec.choices)}, not "
                          f"{value!r}; {hint(text, spec.choices)}".rstrip("; "))
    return text


def _in_range(engine: str, spec: Option, value: float, least: int | None):
    """``value`` when it is within ``spec``'s range (``least``: the type's own minimum; None: above 0)."""
    low = spec.minimum if spec.minimum is not None else least
    kind = "an integer" if spec.type is int else "a number"
    if (value < low) if low is not None else (value <= 0):
        bound = f"{low:g} or more" if low is not None else "above 0"
        raise OptionError(f"option {spec.name!r} for {engine} takes {kind} {bound}, not {value:g}")
    if spec.maximum is not None and value > spec.maximum:
        raise OptionError(f"option {spec.name!r} for {engine} takes {kind} up to {spec.maximum:g}, not {value:g}")
    return value


def validate(engine: str, cls, options: dict) -> dict:
    """``options`` checked against the adapter's declaration, each value as its declared type."""
    specs = specs_of(cls)
    out = {}
    for key, value in options.items():
        spec = specs.get(key)
        if spec is None and key in SPECULATION_KEYS:
            raise OptionError(f"option {key!r}: the {engine} adapter has no speculative decoding (docs/speculation.md "
                              "lists the engines that have)")
        if spec is None:
            allowed = ", ".join(sorted(specs))
            raise OptionError(f"unknown option {key!r} for {engine}; {hint(key, specs)}allowed: {allowed}")
        out[key] = coerce(engine, spec, value)
    return out
