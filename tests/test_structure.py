"""The package's shape, read from the source: one installed name, layers that import only downwards, no
import circles, an engine's name and facts in its own folder only, hooks declared rather than probed, and
the self-checks out of the product's path, reaching the engines only through the registry."""
import ast
import os
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from tests.helpers import REPO

# The tree read: this checkout, or another product tree named by KVBENCH_TREE (tests/test_extension_paths.py
# runs these checks on a copy with a change planted, under that copy's own kvbench).
ROOT = Path(os.environ.get("KVBENCH_TREE") or REPO).resolve()
# The layers, bottom first: a module imports only from its own layer and those before it (data flows one
# way: workload -> cells -> runner -> rows -> store -> reports). The package's own __init__ is below all.
LAYERS = ["kvbench.kv", "kvbench.common", "kvbench.backends", "kvbench.load", "kvbench.workloads", "kvbench.store",
          "kvbench.planner", "kvbench.run", "kvbench.reports", "kvbench.compare", "kvbench.commands", "kvbench.cli",
          "kvbench.integrations", "kvbench.selfcheck"]
ENGINE_DIRS = sorted(p.parent.name for p in (ROOT / "backends").glob("*/adapter.py"))


def package_dirs() -> dict[str, Path]:
    """Installed package name -> folder, from pyproject.toml (bench/ is `kvbench`, ...)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


@cache  # each file parsed once per session: the checks below read the same files
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@cache  # read once per session: every check below walks the same tree
def modules() -> dict[str, Path]:
    out = {}
    for package, folder in package_dirs().items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            if "scripts" in rel.parts:  # run inside the engines' environments, never imported
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            inner = [n for n in package_dirs() if n.startswith(name + ".") and n.count(".") == name.count(".") + 1]
            if not inner or rel.name == "__init__":  # a subpackage mapped elsewhere wins over a same-named folder
                out.setdefault(name, path)
    return out


def imports(name: str, path: Path, type_checking: bool = True) -> set[str]:
    """The modules ``name`` imports: at run time (function-level imports too) and, unless ``type_checking`` is
    False, for type checking (an import under TYPE_CHECKING is a dependency all the same: a layer that names a
    type of a layer above it depends on it)."""
    tree = parsed(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if not type_checking and id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@cache
def graph(type_checking: bool = True) -> dict[str, set[str]]:
    mods = modules()
    edges = {}
    for name, path in mods.items():
        targets = set()
        for imported in imports(name, path, type_checking):
            if imported in mods and imported != name:
                targets.add(imported)
                # importing a package's module runs the package's __init__ first (unless already inside it)
                parent = imported.rpartition(".")[0]
                if parent in mods and parent != "kvbench" and not name.startswith(parent + ".") and parent != name:
                    targets.add(parent)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_one_installed_name():
    assert set(package_dirs()) == {"kvbench", "kvbench.backends", "kvbench.workloads", "kvbench.selfcheck"}
    for name, path in modules().items():
        tree = parsed(path)
        for node in ast.walk(tree):
            roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else
                     [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            assert not {"bench", "backends", "workloads", "selfcheck"} & set(roots), f"{name} imports {roots}"


def test_the_graph_is_read():
    edges = graph()
    assert len(edges) > 50
    assert "kvbench.backends.base" in edges["kvbench.backends.vllm.adapter"]
    assert "kvbench.run.rows" in edges["kvbench.run.measure"]


def test_no_import_circles():
    """No circle of imports at run time. A class and its parts may name each other's types (the Backend and its
    capability groups): imports under TYPE_CHECKING run never, so they make no circle; they do count as layer
    dependencies (the upward-import test)."""
    assert cycles(graph(type_checking=False)) == []


def test_a_circle_would_be_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layer(module: str) -> int:
    if module == "kvbench":
        return -1
    return next(i for i, top in enumerate(LAYERS) if module == top or module.startswith(top + "."))


def test_every_module_is_in_a_layer():
    for name in modules():
        layer(name)  # StopIteration: a module outside every layer


def test_layers_import_only_downwards():
    upward = sorted(f"{name} -> {t}" for name, targets in graph().items() for t in targets if layer(t) > layer(name))
    assert upward == []


def test_an_upward_import_would_be_found():
    assert layer("kvbench.kv.geometry") < layer("kvbench.backends.vllm.adapter") < layer("kvbench.run.runner")


def test_an_import_for_type_checking_is_read(tmp_path):
    planted = tmp_path / "typed.py"
    planted.write_text("from typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    from kvbench.workloads import Workload\n")
    assert "kvbench.workloads" in imports("kvbench.load.typed", planted)


# The shared modules engines' rules build on (llama-server's, which llama.cpp and Ollama run): like an engine's
# rules, they import only the kv layer.
SHARED_RULES = ("kvbench.backends.shared.llama_server_kv", "kvbench.backends.shared.llama_server_gpumem")


def rules_module(name: str) -> bool:
    return name.endswith((".kvrules", ".gpumem")) or name in SHARED_RULES


def test_the_kv_layer_and_every_engines_rules_import_only_the_kv_layer():
    for name, targets in graph().items():
        if name.startswith("kvbench.kv") or rules_module(name):
            others = {t for t in targets if not t.startswith("kvbench.kv") and not rules_module(t)
                      and t not in ("kvbench", "kvbench.backends") and not re.fullmatch(r"kvbench\.backends\.\w+", t)}
            assert not others, f"{name} imports {sorted(others)}"


def engine_of(module: str, engines: list[str]) -> str | None:
    """The engine whose folder holds ``module`` (kvbench.backends.<engine>...), None outside every engine's."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvbench", "backends"] and parts[2] in engines else None


def imports_across_engines(edges: dict[str, set[str]], engines: list[str]) -> list[str]:
    """Imports from one engine's folder into another's: what engines share lives in backends/shared/."""
    return sorted(f"{name} -> {t}" for name, targets in edges.items() if (own := engine_of(name, engines))
                  for t in targets if (other := engine_of(t, engines)) and other != own)


def test_no_engine_folder_imports_another_engines_folder():
    assert imports_across_engines(graph(), ENGINE_DIRS) == []


def test_an_import_across_engines_would_be_found():
    edges = {"kvbench.backends.ollama.adapter": {"kvbench.backends.llamacpp.adapter", "kvbench.backends.base",
                                                 "kvbench.backends.shared.llama_log", "kvbench.backends.ollama.kvrules"},
             "kvbench.backends.llamacpp.adapter": {"kvbench.backends.hf"}}
    assert imports_across_engines(edges, ENGINE_DIRS) == [
        "kvbench.backends.llamacpp.adapter -> kvbench.backends.hf",
        "kvbench.backends.ollama.adapter -> kvbench.backends.llamacpp.adapter"]


def test_every_engine_is_one_folder_and_one_registry_line():
    from kvbench.backends import ENGINES, REGISTRY, kv_rules
    from kvbench.backends.capabilities import Capabilities

    assert sorted(ENGINES) == ENGINE_DIRS
    for engine in ENGINES:
        assert REGISTRY[engine].engine == engine
        assert isinstance(REGISTRY[engine].capabilities, Capabilities)  # declared groups, not a method
        assert REGISTRY[engine].__module__ == f"kvbench.backends.{engine}.adapter"
        rules = kv_rules(engine)
        assert rules is None or (type(rules).__module__ == f"kvbench.backends.{engine}.kvrules"
                                 and type(REGISTRY[engine].kv_rules) is type(rules))


def test_every_engine_folder_is_an_installed_package():
    """pyproject.toml lists the packages setuptools installs: an engine folder left out is missing from a
    wheel."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert [e for e in ENGINE_DIRS if f"kvbench.backends.{e}" not in packages] == []


def test_importing_the_planner_loads_no_adapter_streaming_client_or_guard():
    code = ("import sys, kvbench.planner as p; p.engine_rules('vllm').answer; p.engine_rules('llamacpp');"
            "print('\\n'.join(m for m in sys.modules if m.startswith('kvbench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    loaded = set(out.split())
    assert "kvbench.backends.vllm.kvrules" in loaded  # the check can see what it looks for
    heavy = {m for m in loaded if m.endswith(".adapter") or m.rpartition(".")[2] in
             ("streaming", "process", "guard", "base", "deployment", "prometheus")}
    assert heavy == set()


# Strings that name something else than an engine: the HF-format folder and config ("hf"), ModelOpt's
# hf_quant_config.json; kept here so that each exception is seen.
NOT_ENGINE_NAMES = {("bench/common/models.py", "hf"), ("bench/kv/geometry.py", "hf"), ("bench/kv/model_config.py", "hf"),
                    ("bench/run/plan.py", "hf_dir"), ("bench/kv/weights.py", "hf_quant_config.json")}


def engine_names_outside_their_folders(files: list[Path], engines: list[str]) -> list[str]:
    """String constants (not docstrings) that are, or start with, an engine's name, and imports of an
    engine's folder, in product code outside ``backends/<engine>/`` and the registry."""
    named = re.compile(r"^(%s)([:@\-_.]|$)" % "|".join(map(re.escape, engines)))
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        tree = parsed(path)
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            if (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                    and named.match(n.value) and (rel, n.value) not in NOT_ENGINE_NAMES):
                found.append(f"{rel}:{n.lineno}: {n.value!r}")
    return found + engine_folder_imports(files, engines)


def engine_folder_imports(files: list[Path], engines: list[str]) -> list[str]:
    """Imports of an engine's folder (``kvbench.backends.<engine>...``, or an engine's module from the registry
    package)."""
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        for n in ast.walk(parsed(path)):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                         [n.module or ""] + [f"{n.module}.{a.name}" for a in n.names])
                for m in names:
                    if re.match(r"kvbench\.backends\.(%s)\b" % "|".join(engines), m):
                        found.append(f"{rel}:{n.lineno}: import {m}")
                        break
    return found


def product_files_outside_the_engines() -> list[Path]:
    files = [*ROOT.glob("bench/**/*.py"), *ROOT.glob("workloads/**/*.py"), *ROOT.glob("backends/*.py")]
    return sorted(p for p in files if p != ROOT / "backends" / "__init__.py")


def test_no_engine_name_outside_its_folder_and_the_registry():
    assert engine_names_outside_their_folders(product_files_outside_the_engines(), ENGINE_DIRS) == []


def self_check_files() -> list[Path]:
    return sorted(ROOT.glob("selfcheck/**/*.py"))


def test_the_self_checks_reach_engines_only_through_the_registry():
    """selfcheck/ looks an engine up by name in the registry (``kvbench.backends``: REGISTRY, kv_rules) and uses
    its declared hooks; selfcheck/engines.py finds what the registry does not name. No engine's folder is
    imported (engine names as strings are fine here: they are what the registry is asked for)."""
    assert len(self_check_files()) > 10 and ROOT / "selfcheck" / "gpu_check" / "kv.py" in self_check_files()
    assert engine_folder_imports(self_check_files(), ENGINE_DIRS) == []


def test_an_engine_folder_import_would_be_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from kvbench.backends import REGISTRY, vllm\nfrom kvbench.backends.hf.adapter import HFBackend\n"
                       "import kvbench.backends.llamacpp.gpumem as gpumem\nfrom kvbench.backends.types import LOCALHOST\n")
    assert engine_folder_imports([planted], ENGINE_DIRS) == [
        "planted.py:1: import kvbench.backends.vllm", "planted.py:2: import kvbench.backends.hf.adapter",
        "planted.py:3: import kvbench.backends.llamacpp.gpumem"]


def test_the_graph_reads_the_self_checks():
    """selfcheck/ is the top layer: it may import the product (bench, and backends through the registry), and
    nothing in the product imports it (test_the_product_never_imports_the_self_checks): only tests/ do."""
    assert LAYERS[-1] == "kvbench.selfcheck"
    edges = graph()
    assert {"kvbench.selfcheck.engines", "kvbench.backends"} <= edges["kvbench.selfcheck.gpu_check.kv"]
    assert "kvbench.selfcheck.gpu_check.kv" in edges["kvbench.selfcheck.gpu_check.main"]


def test_an_engine_name_outside_its_folder_would_be_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""vllm in a docstring is fine."""\nif engine == "vllm":\n    pass\n'
                       "from kvbench.backends.llamacpp.kvrules import LlamaCppKV\n")
    assert sorted(engine_names_outside_their_folders([planted], ENGINE_DIRS)) == [
        "planted.py:2: 'vllm'", "planted.py:4: import kvbench.backends.llamacpp.kvrules"]


def hook_probes(files: list[Path]) -> list[str]:
    """getattr/hasattr of a Backend, capability group or KVRules hook name: a hook is declared on the base
    class or its capability group instead."""
    from kvbench.backends import capabilities
    from kvbench.backends.base import Backend
    from kvbench.kv.rules import KVRules

    groups = [v for v in vars(capabilities).values() if isinstance(v, type) and v.__module__ == capabilities.__name__]
    hooks = {n for cls in (Backend, KVRules, *groups) for n in dir(cls) if not n.startswith("__")}
    found = []
    for path in files:
        for n in ast.walk(parsed(path)):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
                    and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value in hooks):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{n.lineno}: {n.func.id}(..., {n.args[1].value!r})")
    return found


def test_no_hook_is_probed_with_getattr():
    files = [*ROOT.glob("bench/**/*.py"), *ROOT.glob("backends/**/*.py"), *ROOT.glob("workloads/**/*.py"),
             *self_check_files()]
    assert hook_probes([p for p in files if "scripts" not in p.parts]) == []


def test_a_probed_hook_would_be_found(tmp_path):
    planted = tmp_path / "probe.py"
    planted.write_text("count = getattr(cls, 'gpus_used', None)\nname = getattr(cls, 'something_else', None)\n")
    assert hook_probes([planted]) == ["probe.py:1: getattr(..., 'gpus_used')"]


def test_the_product_never_imports_the_self_checks():
    for name, targets in graph().items():
        if not name.startswith("kvbench.selfcheck"):
            assert not {t for t in targets if t.startswith("kvbench.selfcheck")}, name


def test_the_editable_install_is_a_tree_static_readers_follow():
    """make setup installs kvbench in strict editable mode: the .pth names a folder that holds the package
    under its import names (links into the checkout), not an import hook only Python itself runs."""
    import sysconfig

    pth = sorted(Path(sysconfig.get_paths()["purelib"]).glob("__editable__.kvbench-*.pth"))
    assert len(pth) == 1, pth
    lines = [line for line in pth[0].read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and not lines[0].startswith("import"), lines
    tree = Path(lines[0])
    assert (tree / "kvbench" / "backends" / "vllm" / "adapter.py").resolve() == REPO / "backends" / "vllm" / "adapter.py"
    assert (tree / "kvbench" / "kv" / "geometry.py").resolve() == REPO / "bench" / "kv" / "geometry.py"


def long_functions(path: Path, limit: int) -> list[str]:
    return [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(parsed(path))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


RUN_STEPS = ["runner", "resolve", "plan", "session", "start", "check", "warmup", "measure", "stop", "options",
             "option_fields"]


def test_no_function_of_the_runner_or_its_steps_is_longer_than_a_screen():
    for step in RUN_STEPS:
        assert long_functions(ROOT / "bench" / "run" / f"{step}.py", 60) == [], step


def test_no_module_over_500_lines_without_a_reason():
    """A module of the product or the self-checks over 500 lines says why in its docstring (a line starting
    "Long because")."""
    files = [*ROOT.glob("bench/**/*.py"), *ROOT.glob("backends/**/*.py"), *ROOT.glob("workloads/**/*.py"),
             *self_check_files()]
    long = [p.relative_to(ROOT).as_posix() for p in files if "scripts" not in p.parts
            and len(p.read_text().splitlines()) > 500
            and "Long because" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert long == []


def test_every_test_that_starts_an_engine_lives_in_an_engines_module():
    """make test's scheduler keeps tests/**/*_engines.py on one xdist worker (tests/conftest.py): an engine test
    elsewhere would run beside another engine on a 2-core machine, and each would measure the other."""
    from tests.conftest import ENGINE_MODULES

    elsewhere = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = parsed(path)
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and "mark.engine" in ast.unparse(n.value) for n in tree.body)
        marked = module_marked or any(isinstance(n, ast.FunctionDef) and any("mark.engine" in ast.unparse(d)
                                                                              for d in n.decorator_list)
                                      for n in ast.walk(tree))
        if marked and not path.name.endswith(ENGINE_MODULES):
            elsewhere.append(str(path.relative_to(REPO)))
    assert elsewhere == []
