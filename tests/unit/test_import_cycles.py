"""No import circle anywhere in the package, read from the source.

import-linter's layers contracts rule out cycles between layers and, in the core and the Kubernetes backend, between
their modules; inside one layer (``worker/``, ``operators/``) nothing did. This test builds the whole package's import
graph with :mod:`ast` and fails naming every circle:

- every import that runs counts, at module level and inside functions (a lazy import still ties the two modules: a
  change to one can break the other, and neither can be read alone); ``if TYPE_CHECKING:`` imports never run and do
  not count, as in the contracts;
- ``from pkg import name`` is an import of ``pkg.name`` when that is a module of the package, else of ``pkg``;
- importing ``a.b.c`` is an edge to ``a.b.c`` only, not to the packages above it: a package's ``__init__`` that
  re-exports its own modules is not a circle with them.

To break a circle, move what both modules need into a module both import, or pass the value instead of importing.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Mapping
from pathlib import Path

import airflow_provider_torchelastic

PACKAGE = "airflow_provider_torchelastic"

#: importer -> {imported: the line of its first import there}
Graph = Mapping[str, Mapping[str, int]]


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root`` (named ``package``), by full name."""
    return {
        ".".join([package, *path.relative_to(root).with_suffix("").parts]).removesuffix(".__init__"): path
        for path in sorted(root.rglob("*.py"))
        if "static" not in path.relative_to(root).parts
    }


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """The package's modules and the modules of the package each of them imports, at any depth."""
    modules = _modules(root, package)
    graph: dict[str, dict[str, int]] = {module: {} for module in modules}
    for module, path in modules.items():
        edges = graph[module]
        anchor_package = module if path.name == "__init__.py" else module.rpartition(".")[0]

        def add(target: str, line: int, module: str = module, edges: dict[str, int] = edges) -> None:
            while target not in modules and "." in target:  # `import pkg.mod.Name` or a name that is no module
                target = target.rpartition(".")[0]
            if target in modules and target != module:
                edges.setdefault(target, line)

        def visit(node: ast.AST, anchor_package: str = anchor_package) -> None:
            if _is_type_checking_block(node):
                return
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the importing module's package
                    anchor = anchor_package.rsplit(".", node.level - 1)[0] if node.level > 1 else anchor_package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    add(submodule if submodule in modules else base, node.lineno)
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(path.read_text(), filename=str(path)))
    return graph


def _strongly_connected(graph: Graph) -> list[list[str]]:
    """The graph's strongly connected components of two or more modules (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as the modules along it (first one repeated)."""
    start = component[0]
    members = set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # pragma: no cover (a component always has one)


def cycles(graph: Graph) -> list[str]:
    """Every circle of the graph, one line per strongly connected component: its modules, and a shortest circle with
    the line of each import along it."""
    found = []
    for component in _strongly_connected(graph):
        cycle = _shortest_cycle(graph, component)
        steps = (
            " -> ".join(f"{_tail(a)}:{graph[a][b]}" for a, b in itertools.pairwise(cycle)) + f" -> {_tail(cycle[-1])}"
        )
        found.append(f"{', '.join(map(_tail, component))}: {steps}")
    return found


def _tail(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph(Path(airflow_provider_torchelastic.__file__).parent, PACKAGE)
    # Read the package, not an empty graph: the operator reaches the backend through lazy imports.
    assert f"{PACKAGE}.operators.backends.attempt" in graph[f"{PACKAGE}.operators.operator"]
    found = cycles(graph)
    assert not found, "import circles (module:line -> imported module):\n" + "\n".join(found)


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_sees_lazy_and_submodule_imports_and_skips_type_checking(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "from pkg import a\n",
            # a -> b at module level; b -> a inside a function: a circle.
            "a.py": "from pkg.b import thing\n",
            "b.py": "thing = 1\ndef later():\n    from pkg import a\n    return a\n",
            # c <-> d, once through `from . import d` (a submodule) and once through a relative import.
            "sub/__init__.py": "",
            "sub/c.py": "from . import d\n",
            "sub/d.py": "from .c import name\nname = 1\n",
            # e -> f for type checkers only: no circle.
            "e.py": "from typing import TYPE_CHECKING\nimport pkg.f\nif TYPE_CHECKING:\n    import pkg.e\n",
            "f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        },
    )
    graph = import_graph(tmp_path / "pkg", "pkg")
    assert graph["pkg"] == {"pkg.a": 1}
    assert graph["pkg.b"] == {"pkg.a": 3}  # inside a function
    assert graph["pkg.sub.c"] == {"pkg.sub.d": 1}  # `from . import d` names the module, not the package
    assert graph["pkg.e"] == {"pkg.f": 2}
    assert graph["pkg.f"] == {}  # TYPE_CHECKING only
    assert cycles(graph) == [
        "pkg.a, pkg.b: pkg.a:1 -> pkg.b:3 -> pkg.a",
        "pkg.sub.c, pkg.sub.d: pkg.sub.c:1 -> pkg.sub.d:1 -> pkg.sub.c",
    ]
