"""One place that decides how the CLI prints."""
import os
import sys

from rich.console import Console


def console() -> Console:
    # Rich falls back to 80 columns when output is not a terminal (CI logs, `| tee`): too narrow for tables;
    # 120 there (the width the report's tables are laid out for), or $COLUMNS when set.
    return Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=120)
