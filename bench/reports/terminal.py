"""A :class:`kvbench.reports.Report` on a terminal of 120 columns: the text as Markdown, each table in as many
parts as its columns need to fit without wrapping a figure (the columns that say which cell a row is repeated
in each part), where rich would squeeze every column of a wide table and wrap each row to several lines."""
from __future__ import annotations

import pandas as pd
from rich.console import Console, Group
from rich.markdown import Markdown
from rich.table import Table

WIDTH = 120
LEAD = ("run", "backend", "replica", "variant", "prompt", "conc", "load", "rep")  # bench/reports/tables.py _lead
WRAPPED = {"reason", "failure"}  # free text: wrapped in its column, not widened to its longest value
PADDING = 3  # a column's cell padding and separator in rich's simple table


def column_width(frame: pd.DataFrame, name: str) -> int:
    """The width a column needs: its longest value, and its header's longest word (headers wrap)."""
    values = [len(str(v)) for v in frame[name]]
    header = max((len(w) for w in str(name).split()), default=0)
    if name in WRAPPED:
        return max(header, 30)
    return max([header, *values])


def split_columns(frame: pd.DataFrame, width: int = WIDTH) -> list[list[str]]:
    """The table's columns in parts that fit ``width``, each part led by the columns that say which cell a
    row is."""
    lead = [c for c in frame.columns if c in LEAD]
    rest = [c for c in frame.columns if c not in LEAD]
    lead_width = sum(column_width(frame, c) + PADDING for c in lead)
    parts, current, used = [], [], lead_width
    for c in rest:
        need = column_width(frame, c) + PADDING
        if current and used + need > width:
            parts.append(lead + current)
            current, used = [], lead_width
        current.append(c)
        used += need
    if current or not parts:
        parts.append(lead + current)
    return parts


def table(frame: pd.DataFrame, right: set[str], width: int = WIDTH) -> Group:
    out = []
    for columns in split_columns(frame, width):
        t = Table(box=None, show_edge=False, pad_edge=False, header_style="bold")
        for c in columns:  # a figure never wraps (its width is its longest value); headers do
            wrapped = c in WRAPPED
            values = max((len(str(v)) for v in frame[c]), default=0)
            t.add_column(str(c), justify="right" if c in right else "left", min_width=None if wrapped else values,
                         overflow="fold")
        for row in frame[columns].itertuples(index=False):
            t.add_row(*(str(v) for v in row))
        out.append(t)
    return Group(*out)


def render(report, console: Console) -> None:
    """Print the report: its title, run headers, every section's text and table, within the console's width."""
    console.print(Markdown(f"# {report.title}"))
    for header in report.headers:
        console.print(Markdown("  \n".join(f"**{label}** {value}" for label, value in header)))
    width = min(console.width, WIDTH) if console.width else WIDTH
    for s in report.sections:
        console.print(Markdown(f"## {s.title}"))
        if s.intro:
            console.print(Markdown(s.intro))
        if s.table is not None and not s.table.empty:
            console.print(table(s.table, s.right, width))
            if s.caption:
                console.print(Markdown(s.caption))
        if s.note:
            console.print(Markdown(s.note))
        for title, text in s.code_blocks:
            console.print(Markdown(f"{title}:\n\n```\n{text}\n```"))
    for note in report.notes:
        console.print(Markdown(note))
