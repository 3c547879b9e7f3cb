"""A run option declared once, as a field of :class:`~kvbench.run.options.RunOptions`.

The field's :func:`option` says which flags of ``kvbench run`` give it (help, default, metavar, bounds), how
their values become the field's value (``read``: a one-line ``ValueError`` refuses them, a
:class:`FlagError` refuses them as a usage error of one flag) and what run.json records of it (``record``).
The command's parameters (:func:`flags`), the options from its flags (:func:`read_flags`) and run.json's
record (:func:`recorded`) are all made from these fields, so adding an option is its field and its use.

No command-line library here: bench/commands/run.py turns each :class:`Flag` into a typer option.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_KEY = "kvbench_run_option"


class FlagError(ValueError):
    """A flag's value refused as a usage error of that flag (``Invalid value for '--resume': ...``)."""

    def __init__(self, message: str, flag: str):
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class Flag:
    """One flag of ``kvbench run``: ``param`` is its parameter name (and key among the flags' values)."""

    param: str
    kind: Any  # the value's type as the command line parses it (before ``read``)
    default: Any
    help: str
    names: tuple[str, ...] = ()  # e.g. ("--backend", "-b"); empty: --param-with-dashes
    metavar: str | None = None
    min: int | None = None


#: ``read(values, earlier)``: the field's value from its flags' values (by param), given the fields read
#: before it (a check across options, e.g. a workload's family, reads them there)
Read = Callable[[dict[str, Any], dict[str, Any]], Any]
#: ``recorded(value, run)``: what run.json holds of the value; ``run`` is the runner, for what the run resolved
#: (the repeats the workload gave, the prompt salt drawn or resumed)
Recorded = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class RunOption:
    flags: tuple[Flag, ...]
    read: Read | None  # None: the one flag's value as it is
    record: str | None  # run.json's key; None: not recorded
    recorded: Recorded | None  # None: the value as it is


def option(*flags: Flag, read: Read | None = None, record: str | None = None, recorded: Recorded | None = None,
           default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is a run option. Its default is the one flag's when the value is that flag's
    as it is; else ``default`` (none: the field is required where RunOptions is made in code)."""
    if read is None and len(flags) > 1:
        raise TypeError("an option of several flags says how to read them")
    if read is None and default is dataclasses.MISSING and default_factory is dataclasses.MISSING:
        default = flags[0].default
    meta = {_KEY: RunOption(flags, read, record, recorded)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declared(cls) -> Iterator[tuple[str, RunOption]]:
    """(field name, option) of every option field of ``cls``, in declaration order."""
    for f in dataclasses.fields(cls):
        if _KEY in f.metadata:
            yield f.name, f.metadata[_KEY]


def flags(cls) -> list[Flag]:
    """Every flag of the options, in declaration order (the order of ``--help``)."""
    return [flag for _, opt in declared(cls) for flag in opt.flags]


def read_flags(cls, values: dict[str, Any], **fields: Any):
    """``cls`` from the flags' values (by param), each option read in declaration order; ``fields`` are
    fields set in code (not flags). ValueError (one line) or FlagError for a value refused."""
    read: dict[str, Any] = {}
    for name, opt in declared(cls):
        if not opt.flags:
            continue
        own = {flag.param: values[flag.param] for flag in opt.flags}
        read[name] = opt.read(own, read) if opt.read else own[opt.flags[0].param]
    return cls(**read, **fields)


def recorded(options, run) -> dict[str, Any]:
    """run.json's record of the options that have one, in declaration order."""
    out = {}
    for name, opt in declared(type(options)):
        if opt.record is not None:
            value = getattr(options, name)
            out[opt.record] = opt.recorded(value, run) if opt.recorded else value
    return out
