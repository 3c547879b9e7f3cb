"""One place that decides how the CLI prints."""
import sys

from rich.console import Console


def console() -> Console:
    # Rich falls back to 80 columns when output is not a terminal (CI logs, `| tee`): too narrow for tables.
    return Console() if sys.stdout.isatty() else Console(width=160)
