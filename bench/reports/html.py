"""A :class:`kvbench.reports.Report` as one self-contained HTML page: inline CSS, every plot embedded as a
base64 PNG data URI, no script and no external reference, so it opens anywhere without a network.

Two ``<meta>`` tags (``kvbench-tables``, ``kvbench-images``) say how many tables and images the page
holds, so a check can compare them with what a browser rendered."""
from __future__ import annotations

import base64
import html
import re

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 110em;
       padding: 0 1.5em; color: #1b1b1b; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.header p { margin: 0.15em 0; } .header { margin-bottom: 1em; padding: 0.6em 1em; background: #f6f8fa; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.55em; vertical-align: top; }
th { background: #f6f8fa; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fbfbfb; }
.caption { font-size: 0.8em; color: #57606a; margin-bottom: 1em; }
code { background: #f0f0f0; padding: 0 0.2em; } pre { background: #f6f8fa; padding: 0.6em; overflow-x: auto; }
figure { margin: 1.5em 0; } figcaption { font-size: 0.9em; color: #57606a; } img { max-width: 100%; }
"""


def inline(text: str) -> str:
    """Escape, then render the Markdown that the report's prose uses: `code` and **bold**."""
    text = html.escape(text, quote=False)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


def note(text: str) -> str:
    """A section's note: its lines as one paragraph (each on a line of its own), a blank line starting the next
    paragraph, and lines that start with "- " as a list (the findings, the deployments' lines)."""
    out, lines, items = [], [], []

    def flush():
        if lines:
            out.append("<p>" + "<br>\n".join(inline(line) for line in lines) + "</p>")
            lines.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{inline(item)}</li>" for item in items) + "</ul>")
            items.clear()

    for line in text.splitlines():
        if not line.strip():
            flush()
        elif line.startswith("- "):
            if lines:
                flush()
            items.append(line[2:])
        else:
            if items:
                flush()
            lines.append(line)
    flush()
    return "\n".join(out)


def table(frame, right: set[str]) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    cls = ['num' if c in right else '' for c in frame.columns]
    body = []
    for row in frame.itertuples(index=False):
        tds = "".join(f'<td class="{k}">{html.escape(str(v))}</td>' if k else f"<td>{html.escape(str(v))}</td>"
                      for k, v in zip(cls, row))
        body.append(f"<tr>{tds}</tr>")
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body) + "\n</tbody>\n</table>"


def data_uri(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def place(report) -> tuple[dict[int, list], list]:
    """Each figure under the section whose table it illustrates (its ``section`` is that section's id; the
    first such section), the rest apart: ({id(section): figures}, rest)."""
    placed: dict[int, list] = {}
    rest = []
    for f in report.figures:
        home = next((s for s in report.sections if f.section and s.id == f.section), None)
        if home is None:
            rest.append(f)
        else:
            placed.setdefault(id(home), []).append(f)
    return placed, rest


def _figure(f) -> str:
    return (f'<figure><img src="{data_uri(f.path)}" alt="{html.escape(f.title)}">'
            f"<figcaption>{html.escape(f.title)}</figcaption></figure>")


def render(report) -> str:
    placed, rest = place(report)
    n_tables = sum(s.table is not None for s in report.sections)
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f'<meta name="kvbench-tables" content="{n_tables}">',
           f'<meta name="kvbench-images" content="{len(report.figures)}">',
           f"<title>{html.escape(report.title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
           f"<h1>{html.escape(report.title)}</h1>"]
    for header in report.headers:
        out.append('<div class="header">' + "".join(f"<p><strong>{html.escape(label)}</strong> {inline(value)}</p>"
                                                    for label, value in header) + "</div>")
    for s in report.sections:
        out.append(f"<section><h2>{html.escape(s.title)}</h2>")
        if s.intro:
            out.append(f"<p>{inline(s.intro)}</p>")
        if s.table is not None:
            out.append(table(s.table, s.right))
            if s.caption:
                out.append(f'<p class="caption">{inline(s.caption)}</p>')
        if s.note:
            out.append(note(s.note))
        for title, text in s.code_blocks:
            out.append(f"<p>{html.escape(title)}:</p><pre>{html.escape(text)}</pre>")
        out += [_figure(f) for f in placed.get(id(s), [])]
        out.append("</section>")
    if rest:
        out.append("<section><h2>Plots</h2>")
        out += [_figure(f) for f in rest]
        out.append("</section>")
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"


def render_compare(result: dict, frame, plot, needed: list[str], verdict: str) -> str:
    """``kvbench compare``'s page: the verdict and summary (``verdict``, Markdown), the warnings, the forest
    plot, the table."""
    title = "kvbench compare: " + ", ".join(result["baseline"]["runs"]) + " -> " + ", ".join(result["candidate"]["runs"])
    ci = f"{result['confidence']:.0%} CI"
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f'<meta name="kvbench-tables" content="{0 if frame.empty else 1}">',
           f'<meta name="kvbench-images" content="{1 if plot else 0}">',
           f"<title>{html.escape(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
           f"<h1>{html.escape(title)}</h1>", f'<div class="header"><p>{inline(verdict)}</p></div>']
    for w in result.get("warnings", []):
        out.append(f'<p style="color:#b00020"><strong>WARNING</strong> {inline(w)}</p>')
    out.append(f"<p>Repeats: {html.escape(result.get('pairing', ''))}. Change = candidate / baseline - 1; "
               f"a regression only when the whole {ci} lies beyond the tolerance on the worse side.</p>")
    if needed:
        out.append("<ul>" + "".join(f"<li>{inline(n)}</li>" for n in needed) + "</ul>")
    if plot:
        out.append(f'<figure><img src="{data_uri(plot)}" alt="forest plot"><figcaption>Each metric\'s change '
                   f"and {ci} against its tolerance band (grey)</figcaption></figure>")
    if not frame.empty:
        out.append(table(frame, {"baseline", "candidate", "change", ci, "tolerance"}))
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"
