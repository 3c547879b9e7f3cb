"""The ``kvbench`` command. Each verb lives in its own module under bench/commands/.

A verb's module is imported only when that verb runs (or its own --help is asked for): the modules import
pandas, matplotlib and transformers, which took ``kvbench --help`` to 2.3-2.8 s. The listing of
``kvbench --help`` reads each verb's docstring from its source instead of importing it.

A verb's text and flag options are taken as typed, without the pydantic validation typer 0.29 brings
(:func:`plain_value`): `kvbench plan` imports only what its answer needs (issue 54 item 4).

Help text is printed as written (``rich_markup_mode=None``): under rich markup, ``ENGINE[@VERSION]`` lost
its ``[@VERSION]`` as a markup tag.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys

import typer
from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer's own click, as its commands raise
from typer.core import TyperCommand, TyperGroup

from kvbench.common.redact import ScrubbingStream, hold_environment_tokens
from kvbench.common.suggest import closest

#: verb -> (module, function); the order of `kvbench --help`.
COMMANDS = {
    "run": ("kvbench.commands.run", "run"),
    "report": ("kvbench.commands.report", "report"),
    "compare": ("kvbench.commands.compare", "compare"),
    "merge": ("kvbench.commands.merge", "merge"),
    "setup": ("kvbench.commands.setup", "setup"),
    "plan": ("kvbench.commands.plan", "plan_command"),
    "validate": ("kvbench.commands.validate", "validate"),
    "default-bench": ("kvbench.commands.default_bench", "default_bench"),
    "backends": ("kvbench.commands.backends", "backends"),
}


def load_command(name: str):
    """The verb's click command, built by typer from its function (importing its module)."""
    module, function = COMMANDS[name]
    sub = typer.Typer(add_completion=False, rich_markup_mode=None)
    sub.command(name, cls=Command)(getattr(importlib.import_module(module), function))
    return typer.main.get_command(sub)


class Command(TyperCommand):
    def get_params(self, ctx):  # its --help too, which typer makes per context
        return [plain_value(param) for param in super().get_params(ctx)]


try:  # typer's coercion of a value (imported with typer.core: nothing more to load)
    from typer._coercion import RuntimeParam, build_runtime_param
except ImportError:  # a typer without it: its own coercion throughout
    RuntimeParam = None
else:
    class PlainParam(RuntimeParam):
        """A str, list[str] or bool value as typer's TypeAdapter returns it, without one (:func:`plain_value`)."""

        def _coerce_value(self, value, param, ctx):  # None never comes here: RuntimeParam.coerce returns it
            if self.annotation in (str, bool) and type(value) is self.annotation:
                return value
            if self.annotation == list[str] and isinstance(value, (list, tuple)) and all(type(v) is str
                                                                                       for v in value):
                return list(value)
            return build_runtime_param(param.type_descriptor)._coerce_value(value, param=param, ctx=ctx)


def plain_value(param):
    """A text or flag parameter's value taken as it is, without pydantic. typer 0.29 coerces every value through
    a pydantic TypeAdapter it builds per parameter (a flag's too, where it is not given): importing pydantic and
    building one per option was 60 ms of `kvbench plan`'s 0.33 s, for values that the adapter passes through
    unchanged. A str, list[str] or bool parameter with no parser of its own gets :class:`PlainParam` instead;
    any other parameter, or another typer, keeps typer's own coercion (tests/planner/test_plan_imports.py checks
    that both give the same)."""
    descriptor = getattr(param, "type_descriptor", None)
    if (RuntimeParam is None or getattr(param, "_runtime_param", False) is not None or descriptor is None
            or descriptor.annotation not in (str, list[str], bool) or descriptor.parameter_info.parser is not None
            or descriptor.file_annotation is not None):
        return param
    param._runtime_param = PlainParam(descriptor.parameter_info, descriptor.annotation)
    return param


def docstring(name: str) -> str:
    """The verb's docstring, read from its module's source without importing it (imported where there is
    no source to read, e.g. an install of bytecode only)."""
    module, function = COMMANDS[name]
    try:
        source = importlib.util.find_spec(module).origin
        with open(source, encoding="utf-8") as f:
            tree = ast.parse(f.read(), source)
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
        return inspect.cleandoc(ast.get_docstring(node) or "")
    except (OSError, SyntaxError, ValueError, StopIteration):
        return inspect.cleandoc(getattr(importlib.import_module(module), function).__doc__ or "")


class LazyGroup(TyperGroup):
    """Verbs imported on first use; `kvbench --help` lists them from their docstrings."""

    def get_params(self, ctx):
        return [plain_value(param) for param in super().get_params(ctx)]

    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, name: str):
        if name not in COMMANDS:
            return None
        if name not in self.commands:
            self.commands[name] = load_command(name)
        return self.commands[name]

    def resolve_command(self, ctx, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except Exception as exc:  # click's UsageError (typer vendors its own click)
            if isinstance(getattr(exc, "message", None), str) and args and (match := closest(args[0], COMMANDS)):
                exc.message = f"{exc.message.rstrip('.')}; did you mean {match!r}?"
            raise

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except UsageError as exc:
            raise one_line(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            raise one_line(exc) from None

    def format_commands(self, ctx, formatter) -> None:
        limit = formatter.width - 6 - max(map(len, COMMANDS))
        rows = [(name, TyperCommand(name, help=docstring(name)).get_short_help_str(limit)) for name in COMMANDS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def one_line(exc: UsageError) -> UsageError:
    """A usage error as one line on stderr ("error: Invalid value for '--repeats': ..."), as every other
    refusal is: click would print the usage and a --help hint above it. Asking for help (no arguments) is
    left as it is."""
    if not isinstance(exc, NoArgsIsHelpError):
        exc.show = lambda file=None: typer.echo(f"error: {exc.format_message()}", err=True)
    return exc


app = typer.Typer(cls=LazyGroup, no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.callback()
def main():
    """Measured KV-cache memory, throughput and latency of LLM inference engines."""
    # whatever a verb prints goes through the credential scrubber (a server's error page echoing a key)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, ScrubbingStream):
            setattr(sys, name, ScrubbingStream(stream))
    hold_environment_tokens()  # the hub token: an engine's log or a server that prints it is masked too


if __name__ == "__main__":
    app()
