"""The package's shape, read from the source: one installed name, no import circles, the adapters free of the
harness's orchestration, and the self-checks out of the product's path."""
import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the adapters may use of the harness: the data and helpers below them, never the runner, the load
# generator, the planner or the reports.
BELOW_THE_ADAPTERS = {"kvbench", "kvbench.configs", "kvbench.envs", "kvbench.hardware", "kvbench.kvmodel", "kvbench.models",
                      "kvbench.redact", "kvbench.suggest", "kvbench.units"}


def package_dirs() -> dict[str, Path]:
    """Installed package name -> folder, from pyproject.toml (bench/ is `kvbench`, ...)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


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


def _type_checking_only(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(name: str, path: Path) -> set[str]:
    """The modules ``name`` imports when it runs (function-level imports too; TYPE_CHECKING blocks not)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking_only(node)
            for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
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


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {}
    for name, path in mods.items():
        targets = set()
        for imported in imports(name, path):
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
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else
                     [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            assert not {"bench", "backends", "workloads", "selfcheck"} & set(roots), f"{name} imports {roots}"


def test_the_graph_is_read():
    edges = graph()
    assert len(edges) > 50
    assert "kvbench.backends.base" in edges["kvbench.backends.vllm"]
    assert "kvbench.summary" in edges["kvbench.runner"]


def test_no_import_circles():
    assert cycles(graph()) == []


def test_a_circle_would_be_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_adapters_import_nothing_of_the_orchestration():
    for name, targets in graph().items():
        if name.startswith("kvbench.backends"):
            upward = {t for t in targets if not t.startswith("kvbench.backends") and t not in BELOW_THE_ADAPTERS}
            assert not upward, f"{name} imports {sorted(upward)}"


def test_the_product_never_imports_the_self_checks():
    for name, targets in graph().items():
        if not name.startswith("kvbench.selfcheck"):
            assert not {t for t in targets if t.startswith("kvbench.selfcheck")}, name
