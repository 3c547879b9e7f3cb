"""Run a kvbench module from this checkout without installing kvbench (a GPU machine lent with no network,
where `pip install -e .` cannot fetch its build backend): ``python selfcheck/uninstalled.py MODULE [ARGS]``,
e.g. ``python selfcheck/uninstalled.py kvbench.selfcheck.gpu_check --budget-s 540``.

It maps the package as pyproject.toml does (kvbench -> bench/, kvbench.backends -> backends/, kvbench.workloads
-> workloads/, kvbench.selfcheck -> selfcheck/) before anything imports kvbench. kvbench's own dependencies
(psutil, httpx, pydantic, ...) must still be importable by this interpreter.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def register() -> None:
    """``kvbench`` from bench/, its subpackages backends/, workloads/ and selfcheck/ from the checkout's root."""
    spec = importlib.util.spec_from_file_location("kvbench", ROOT / "bench" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "bench"), str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvbench"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    register()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
