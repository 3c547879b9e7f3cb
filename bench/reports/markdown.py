"""A :class:`kvbench.reports.Report` as Markdown (GitHub-flavoured: pipe tables, images by relative path)."""
from __future__ import annotations

import os
from pathlib import Path

from kvbench.common.markdown import fence, md_table


def render(report, base: Path) -> str:
    """The Markdown text; image links are relative to ``base`` (the folder the .md file is written to)."""
    from kvbench.reports.html import place

    placed, rest = place(report)

    def figure(f) -> str:
        return f"![{f.title}]({Path(os.path.relpath(f.path, base)).as_posix()})"

    out = [f"# {report.title}"]
    for header in report.headers:
        out.append("  \n".join(f"**{label}** {value}" for label, value in header))
    for s in report.sections:
        out.append(f"## {s.title}")
        if s.intro:
            out.append(s.intro)
        if s.table is not None:
            out.append(md_table(s.table, s.right))
            if s.caption:
                out.append(f"<sub>{s.caption}</sub>")
        if s.note:
            out.append(s.note)
        for title, text in s.code_blocks:
            out.append(f"{title}:\n\n{fence(text)}\n{text}\n{fence(text)}")
        out += [figure(f) for f in placed.get(id(s), [])]  # each plot under the table it illustrates
    if rest:
        out.append("## Plots")
        out += [figure(f) for f in rest]
    return "\n\n".join(out) + "\n"
