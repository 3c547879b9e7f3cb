"""Issue 36 item 4: docs/plan.md lists every catalog model, from the catalog itself."""
from kvbench.planner import catalog_names
from kvbench.planner.catalog_doc import START, with_catalog_list

from tests.helpers import REPO


def test_the_docs_catalog_list_is_current():
    text = (REPO / "docs" / "plan.md").read_text()
    assert text == with_catalog_list(text), "run: .venv/bin/python -m kvbench.planner.catalog_doc"
    listed = text.split(START, 1)[1].split("<!--", 1)[0].split(", ")
    assert listed == catalog_names()
