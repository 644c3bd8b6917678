"""The pure core's import graph, read from the source: no cycles (not even through imports hidden inside functions),
no private names borrowed from another module, and one bottom module of shared value checks that imports only the
standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import airflow_provider_torchelastic

PACKAGE = "airflow_provider_torchelastic"
PACKAGE_DIR = Path(airflow_provider_torchelastic.__file__).parent
#: The pure core whose import graph must stay a tree-like DAG: typed config, pod options, shared checks, naming,
#: the launch command line and the renderer.
CORE = ("config", "pod", "validation", "naming", "launch", "render")


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """``(imported module, imported names)`` for every import at run time, at any depth (functions included)."""
    tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text())
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node):
            return  # annotations only: never executed
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                base = f"{PACKAGE}.{base}" if base else PACKAGE
            found.append((base, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _core_edges(module: str) -> set[str]:
    edges = set()
    for imported, names in _imports(module):
        if imported == PACKAGE:
            edges.update(name for name in names if name in CORE)
        elif imported.startswith(PACKAGE + "."):
            edges.add(imported.split(".")[1])
    return edges & set(CORE)


def test_core_import_graph_has_no_cycle() -> None:
    graph = {module: _core_edges(module) for module in CORE}
    done: set[str] = set()

    def walk(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            cycle = " -> ".join((*path[path.index(module) :], module))
            pytest.fail(f"import cycle in the pure core: {cycle}")
        if module in done:
            return
        for target in sorted(graph[module]):
            walk(target, (*path, module))
        done.add(module)

    for module in CORE:
        walk(module, ())
    assert "config" in graph["render"] and "validation" in graph["config"] and "validation" in graph["pod"]


@pytest.mark.parametrize("module", CORE)
def test_no_private_name_is_imported_from_another_module(module: str) -> None:
    borrowed = [
        f"{imported}.{name}"
        for imported, names in _imports(module)
        if imported.startswith(PACKAGE)
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not borrowed, f"{module}.py imports private names: {borrowed}"


def test_validation_is_the_bottom_and_imports_only_the_standard_library() -> None:
    imported = {name.split(".")[0] for name, _ in _imports("validation")}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
