"""The exception tree drawn in errors.py's module docstring names every exception class the package defines, under
its real base class and with the module it lives in; and it names no exception the package no longer has."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import airflow_provider_torchelastic
from airflow_provider_torchelastic import errors

PACKAGE = "airflow_provider_torchelastic"
PACKAGE_DIR = Path(airflow_provider_torchelastic.__file__).parent
#: A node of the drawing: ``├── Name   (where) what it means``; its depth is where the branch starts.
NODE = re.compile(r"^(?P<indent>[ │]*)[├└]── (?P<name>\w+)(?:\s+\((?P<where>[^)]*)\))?")


@dataclass(frozen=True)
class Node:
    name: str
    parent: str
    where: str | None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _defined_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in the package's source: ``{module (package-relative).Name: class}``."""
    found: dict[str, type[BaseException]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name == "__main__.py":
            continue  # importing it would run the runner; it defines nothing
        tree = ast.parse(path.read_text())
        top_level = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
        nested = [
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            and node.name not in top_level
            and any(re.search(r"Error|Exception|Warning", ast.unparse(base)) for base in node.bases)
        ]
        assert not nested, f"{path.name}: define exceptions at module level, where the tree can name them: {nested}"
        if not top_level:
            continue
        module = importlib.import_module(_module_name(path))
        for name in top_level:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                # By the module it is printed and imported by (its __module__), which a class defined in a private
                # submodule of a public one sets to the public one.
                found[f"{value.__module__.removeprefix(PACKAGE + '.')}.{name}"] = value
    return found


def _drawn_tree() -> dict[str, Node]:
    doc = errors.__doc__ or ""
    lines = doc.splitlines()
    (root_index,) = [i for i, line in enumerate(lines) if line.strip() == "Exception"]
    root_column = len(lines[root_index]) - len(lines[root_index].lstrip())
    parents = ["Exception"]
    nodes: dict[str, Node] = {}
    for line in lines[root_index + 1 :]:
        if not line.strip():
            break  # the literal block ends at the first blank line
        match = NODE.match(line[root_column:])
        if match is None:
            continue  # a continuation line of a description
        depth = len(match["indent"]) // 4 + 1
        del parents[depth:]
        name = match["name"]
        assert name not in nodes, f"{name} is drawn twice"
        nodes[name] = Node(name, parents[depth - 1], match["where"])
        parents.append(name)
    return nodes


DEFINED = _defined_exceptions()
TREE = _drawn_tree()


def test_the_package_defines_the_exceptions_this_test_knows_of() -> None:
    # Guards the scan itself (a scan finding nothing would pass everything below).
    assert {"errors.KubeError", "operators.TrainingFailedError", "runner.RunnerUsageError"} <= set(DEFINED)


@pytest.mark.parametrize("qualified", sorted(DEFINED))
def test_every_exception_is_drawn_under_its_base_with_its_module(qualified: str) -> None:
    module, _, name = qualified.rpartition(".")
    cls = DEFINED[qualified]
    assert name in TREE, f"{qualified} is missing from the exception tree in errors.py's docstring"
    node = TREE[name]
    assert node.parent == cls.__bases__[0].__name__, f"{name} is drawn under {node.parent}, its base is {cls.__bases__}"
    where = (node.where or "").split(";")[0].strip()
    assert where == ("here" if module == "errors" else module), f"{name} lives in {module}, drawn as ({node.where})"


def test_the_tree_draws_no_exception_the_package_no_longer_defines() -> None:
    defined = {qualified.rpartition(".")[2] for qualified in DEFINED}
    for node in TREE.values():
        if node.where is None:  # a built-in base
            assert issubclass(getattr(builtins, node.name), BaseException), node
        elif node.where != "Airflow":
            assert node.name in defined, f"{node.name} is drawn in errors.py but not defined in the package"
