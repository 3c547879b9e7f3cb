"""Markdown for the reports, recompute and compare: one table formatter, and text from outside made only text."""
from __future__ import annotations

import re

import pandas as pd

from kvbench.common import outside

# text that Markdown reads as itself, nothing more: a version ("0.32.0", "b4600 (3e2ba92)"), a model name
_PLAIN = re.compile(r"[A-Za-z0-9 .,:;+/=()@%-]*")
# in a table cell: what would start raw HTML (a tag, a comment) or close a link's text onto its target
_HTML_OR_LINK = re.compile(r"<(?=[A-Za-z/!?])|\](?=\()")


def md_text(value, limit: int = 300) -> str:
    """Text from outside kvbench (a server's version, a model name it lists) as Markdown that is only text: as it
    is where Markdown reads nothing in it; else one line in a code span, where no heading, list, link, image,
    raw HTML or emphasis is read (a backtick in it made '); the HTML report renders the span as <code>."""
    text = " ".join(outside.text(str(value), limit).split())
    if _PLAIN.fullmatch(text):
        return text
    return "`" + text.replace("`", "'") + "`"


def fence(text: str) -> str:
    """A code fence longer than any run of backticks in ``text`` (a log line holding ``` ended the block)."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def md_table(frame: pd.DataFrame, right: set[str] | None = None) -> str:
    """A frame of strings as a Markdown table; columns in ``right`` are right-aligned."""
    right = right or set()

    def cell(v) -> str:  # one line; no raw HTML or link from a server's words (an error) in a cell
        return _HTML_OR_LINK.sub(lambda m: "&lt;" if m.group() == "<" else "\\]",
                                 str(v).replace("|", "\\|").replace("\n", " "))

    lines = ["| " + " | ".join(map(str, frame.columns)) + " |",
             "|" + "|".join("---:" if c in right else "---" for c in frame.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)
