"""Markdown for the reports, recompute and compare: one table formatter."""
from __future__ import annotations

import pandas as pd


def md_table(frame: pd.DataFrame, right: set[str] | None = None) -> str:
    """A frame of strings as a Markdown table; columns in ``right`` are right-aligned."""
    right = right or set()

    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(str, frame.columns)) + " |",
             "|" + "|".join("---:" if c in right else "---" for c in frame.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)
