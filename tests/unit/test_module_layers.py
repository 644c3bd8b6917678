"""The package's import rules that import-linter does not check, and what ties its contracts to the source.

The contracts ([tool.importlinter] in pyproject.toml, run by ``lint-imports`` in scripts/test.sh and ``make lint``)
enforce the direction: the glue over the backends (Kubernetes, local, runner) over the worker-side API over the pure
core; nothing below the glue imports Airflow; only the Kubernetes backend imports a Kubernetes client (and only its
client and watch modules, plus the UI's sources); neither the core nor the backend imports torch; and the core and the
backend import downwards in layers of their own, which also rules out cycles.

What stays here, read from the source (``if TYPE_CHECKING:`` blocks skipped, as in the contracts):

- every module of the package sits in a layer of the top contract (or is a public-path shim, which the layers may
  not import), and every module of the core and of the backend is on a line of its own layers contract: a new module
  cannot slip past the contracts by being in none;
- every import a contract ignores exists and is made inside a function, never at module level, and names no
  wildcard: an ignore cannot hide a module-level import;
- no core module imports a private name from another module;
- the bottom of the core (validation) imports only the standard library;
- only compat.py imports Airflow's private modules and names;
- no module is longer than about 500 lines;
- no string literal stands as a statement of its own, but a docstring (a message cut in two, its end dropped).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import airflow_provider_torchelastic
from tests.conftest import REPO_ROOT

PACKAGE = "airflow_provider_torchelastic"
PACKAGE_DIR = Path(airflow_provider_torchelastic.__file__).parent
IMPORT_LINTER: dict[str, Any] = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS: dict[str, dict[str, Any]] = {contract["id"]: contract for contract in IMPORT_LINTER["contracts"]}


def _tail(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


@dataclass(frozen=True)
class _Import:
    module: str
    names: tuple[str, ...]
    line: int
    in_function: bool

    def reaches(self, target: str) -> bool:
        """Whether this statement imports ``target`` or a submodule of it (``from pkg import mod`` included)."""
        candidates = [self.module, *(f"{self.module}.{name}" for name in self.names)]
        return any(found == target or found.startswith(target + ".") for found in candidates)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _source(module: str) -> Path:
    path = PACKAGE_DIR.joinpath(*_tail(module).split(".")) if module != PACKAGE else PACKAGE_DIR
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(module: str) -> list[_Import]:
    """Every import that runs in ``module`` (a full or package-relative name), at any depth (functions included)."""
    module = module if module.startswith(PACKAGE) else f"{PACKAGE}.{module}"
    path = _source(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[_Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if _is_type_checking_block(node):
            return  # annotations only: never executed
        if isinstance(node, ast.Import):
            found.extend(_Import(alias.name, (), node.lineno, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.append(_Import(base, tuple(alias.name for alias in node.names), node.lineno, in_function))
        nested = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return found


def _layer_modules(contract: dict[str, Any]) -> set[str]:
    (container,) = contract.get("containers", [""])
    return {
        f"{container}.{name}" if container else name
        for layer in contract["layers"]
        for name in (part.strip().strip("()") for part in re.split(r"[|:]", layer))
    }


def _modules(package: str) -> set[str]:
    """Every module of ``package`` (a full name), its subpackages' modules included."""
    root = _source(package).parent
    return {
        ".".join([package, *path.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")
        for path in root.rglob("*.py")
        if "static" not in path.parts
    }


SHIMS = {_tail(module) for module in CONTRACTS["no-shims-inside"]["forbidden_modules"]}
CORE = sorted(module for module in _modules(f"{PACKAGE}.core") if module != f"{PACKAGE}.core")


def test_every_module_is_in_a_layer_or_is_a_shim() -> None:
    layers = {_tail(module) for module in _layer_modules(CONTRACTS["layers"])}
    top = {_tail(module).split(".")[0] for module in _modules(PACKAGE) if module != PACKAGE}
    assert top - layers == SHIMS, f"neither in a layer nor a shim: {sorted(top - layers - SHIMS)}"
    assert {"core", "kubernetes", "worker", "operators"} <= layers  # read the contract, not an empty one
    # The layers' modules may not import the shims: every layer is a source of that contract.
    sources = {_tail(module) for module in CONTRACTS["no-shims-inside"]["source_modules"]}
    assert sources == layers, f"in one contract only: {sorted(sources ^ layers)}"


@pytest.mark.parametrize("package", ["core", "kubernetes"])
def test_every_module_of_a_layered_package_is_on_a_line(package: str) -> None:
    contract = CONTRACTS[f"{package}-layers"]
    on_lines = _layer_modules(contract)
    modules = {module for module in _modules(f"{PACKAGE}.{package}") if module != f"{PACKAGE}.{package}"}
    # A module is on a line itself or through its package (kinds/ and everything in it are one line).
    covered = {
        module for module in modules if any(module == line or module.startswith(line + ".") for line in on_lines)
    }
    assert covered == modules, f"on no line: {sorted(modules - covered)}"
    assert on_lines <= modules, f"gone: {sorted(on_lines - modules)}"


IGNORED = sorted(
    {
        (contract["id"], expression)
        for contract in CONTRACTS.values()
        for expression in contract.get("ignore_imports", [])
    }
)


@pytest.mark.parametrize(("contract", "expression"), IGNORED, ids=[f"{c}:{e}" for c, e in IGNORED])
def test_an_ignored_import_is_lazy_inside_a_function(contract: str, expression: str) -> None:
    importer, _, imported = (part.strip() for part in expression.partition("->"))
    assert "*" not in expression, f"{contract}: ignore one import, not a pattern: {expression}"
    assert importer.startswith(PACKAGE + ".") and imported, expression
    statements = [statement for statement in _imports(importer) if statement.reaches(imported)]
    assert statements, f"{contract}: {importer} no longer imports {imported}: drop the ignore"
    module_level = [statement.line for statement in statements if not statement.in_function]
    assert not module_level, f"{contract}: {importer} imports {imported} at module level (line {module_level})"


@pytest.mark.parametrize("module", CORE)
def test_no_private_name_is_imported_from_another_module(module: str) -> None:
    borrowed = [
        f"{statement.module}.{name}"
        for statement in _imports(module)
        if statement.module.startswith(PACKAGE)
        for name in statement.names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not borrowed, f"{module}.py imports private names: {borrowed}"


def test_validation_is_the_bottom_and_imports_only_the_standard_library() -> None:
    imported = {statement.module.split(".")[0] for statement in _imports("core.validation")}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


@pytest.mark.parametrize("module", sorted(_modules(PACKAGE) - {f"{PACKAGE}.compat"}))
def test_only_compat_reaches_airflows_private_api(module: str) -> None:
    private = [
        f"{statement.module}:{', '.join(statement.names)} (line {statement.line})"
        for statement in _imports(module)
        if statement.module.split(".")[0] == "airflow"
        and any(part.startswith("_") for part in [*statement.module.split("."), *statement.names])
    ]
    assert not private, f"{module} imports Airflow's private API (move it to compat.py): {private}"


#: About 500 lines: past that a module holds more than one idea (the runner's agent is the one near the edge).
MAX_MODULE_LINES = 550


@pytest.mark.parametrize("module", sorted(_modules(PACKAGE)))
def test_no_module_is_longer_than_about_500_lines(module: str) -> None:
    lines = len(_source(module).read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines: split it where its parts meet"


def _code_lines(source: str, node: ast.AST) -> int:
    """The lines of ``node`` that are code: not blank, not a comment, not a docstring."""
    lines = source.splitlines()
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(inner):
            first = inner.body[0]
            docstrings |= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    span = range(node.lineno, (getattr(node, "end_lineno", None) or node.lineno) + 1)  # type: ignore[attr-defined]
    return sum(
        1 for n in span if n not in docstrings and lines[n - 1].strip() and not lines[n - 1].lstrip().startswith("#")
    )


def _definitions(module: str) -> Iterator[tuple[ast.AST, str, str]]:
    source = _source(module).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.name, source


#: Issue 40: a function that needs more is doing more than one thing; the operator's class holds only its checked
#: arguments, its handle and its entry points (the work is in the backends).
MAX_FUNCTION_CODE_LINES = 60
MAX_OPERATOR_CLASS_CODE_LINES = 150


@pytest.mark.parametrize("module", sorted(_modules(PACKAGE)))
def test_no_function_is_longer_than_60_lines_of_code(module: str) -> None:
    long = {
        name: lines
        for node, name, source in _definitions(module)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (lines := _code_lines(source, node)) > MAX_FUNCTION_CODE_LINES
    }
    assert not long, f"{module}: functions over {MAX_FUNCTION_CODE_LINES} lines of code: {long}"


def test_the_operator_class_is_at_most_150_lines_of_code() -> None:
    [(node, source)] = [
        (node, source)
        for node, name, source in _definitions(f"{PACKAGE}.operators.operator")
        if name == "TorchElasticOperator"
    ]
    assert _code_lines(source, node) <= MAX_OPERATOR_CLASS_CODE_LINES


def _stray_strings(source: str) -> list[int]:
    """The lines of string literals that are statements of their own but not a module's, class's or function's
    docstring: what is left of a message continued on the next line without parentheses."""
    stray: list[int] = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        documented = isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        stray.extend(
            statement.lineno
            for index, statement in enumerate(body)
            if isinstance(statement, ast.Expr)
            and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str)
            and not (index == 0 and documented)
        )
    return stray


def test_the_stray_string_finder_finds_a_message_cut_in_two() -> None:
    cut = 'def f():\n    """Doc."""\n    return 1, "the first half "\n    "the second half"\n'
    assert _stray_strings(cut) == [4]
    assert _stray_strings('def f():\n    return 1, ("the first half "\n    "the second half")\n') == []


@pytest.mark.parametrize("module", sorted(_modules(PACKAGE)))
def test_no_string_is_a_statement_of_its_own_but_a_docstring(module: str) -> None:
    stray = _stray_strings(_source(module).read_text())
    assert not stray, f"{module}: string literals that are statements of their own at lines {stray}"
