"""docs/plan.md's list of the catalog's models, written from the catalog (``python -m kvbench.planner.catalog_doc``
rewrites it; tests/planner/test_catalog_doc.py fails when it is not current)."""
from __future__ import annotations

import sys
from pathlib import Path

from .shared import catalog_names

START, END = "<!-- catalog list: python -m kvbench.planner.catalog_doc -->", "<!-- end of catalog list -->"


def catalog_list() -> str:
    return ", ".join(catalog_names())


def with_catalog_list(text: str) -> str:
    """``text`` with what stands between the markers replaced by the catalog's names."""
    head, sep, rest = text.partition(START)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the markers {START} ... {END} are missing")
    return f"{head}{START}{catalog_list()}{END}{tail}"


def main(path: str = "docs/plan.md") -> None:
    file = Path(path)
    file.write_text(with_catalog_list(file.read_text()))


if __name__ == "__main__":
    main(*sys.argv[1:])
