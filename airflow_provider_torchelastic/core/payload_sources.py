"""Tracebacks that show the DAG file: the source lines a payload carries for its by-value code, and their return.

Split from :mod:`airflow_provider_torchelastic.core.payload`, which writes and reads them. Standard library only.
"""

from __future__ import annotations

import linecache
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = ["restore_source_locations", "source_locations"]


# --- tracebacks that show the DAG file --------------------------------------------------------------------------
# cloudpickle renames by-value code to "<dynamic-code>", so a worker's traceback would show neither the DAG file nor
# its lines. The payload carries each local module's path and the source lines of its functions (the rest blanked,
# so that line numbers stay), and where each function's code starts; the loader puts the path back and registers
# the source with linecache (the file need not exist where it runs).

_MAX_SOURCE_BYTES: Final = 1_000_000
_DYNAMIC_FILENAME: Final = "<dynamic-code>"


def _code_key(code: types.CodeType) -> str:
    return f"{code.co_qualname}:{code.co_firstlineno}"


def _module_functions(module: types.ModuleType) -> Iterator[types.FunctionType]:
    for value in vars(module).values():
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            yield value
        elif isinstance(value, type) and value.__module__ == module.__name__:
            yield from (v for v in vars(value).values() if isinstance(v, types.FunctionType))


def _last_line(code: types.CodeType) -> int:
    """The last line of ``code`` and of the code nested in it."""
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return max([last, *(_last_line(const) for const in code.co_consts if isinstance(const, types.CodeType))])


def _functions_only(source: str, functions: Sequence[types.FunctionType]) -> str:
    """``source`` with every line outside ``functions`` blanked: the line numbers stay, so a traceback shows the
    function's own lines, and nothing else of the module travels (a constant beside the function, a credential in a
    DAG file's top level). A value the function uses travels anyway, pickled in its globals."""
    lines = source.splitlines(keepends=True)
    keep = [False] * len(lines)
    for function in functions:
        # A function's first line is its first decorator's.
        first, last = function.__code__.co_firstlineno, _last_line(function.__code__)
        for number in range(max(first, 1), min(last, len(lines)) + 1):
            keep[number - 1] = True
    blank = ["\n" if line.endswith("\n") else "" for line in lines]
    return "".join(line if kept else empty for line, kept, empty in zip(lines, keep, blank, strict=True))


def source_locations(modules: Sequence[types.ModuleType]) -> dict[str, Any]:
    files: dict[str, str] = {}
    codes: dict[str, str] = {}
    for module in modules:
        path = getattr(module, "__file__", None)
        try:
            source = Path(path).read_text() if path else None
        except (OSError, UnicodeDecodeError):
            source = None
        if path is None or source is None or len(source) > _MAX_SOURCE_BYTES:
            continue
        functions = list(_module_functions(module))
        files[path] = _functions_only(source, functions)
        for function in functions:
            codes[_code_key(function.__code__)] = path
    return {"files": files, "codes": codes}


def _relocated(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_relocated(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def restore_source_locations(roots: Iterable[Any], sources: Mapping[str, Any]) -> None:
    """Relocate the code of ``roots`` (the function and what was rebuilt by value), of the function's globals and of
    their classes' methods."""
    codes: Mapping[str, str] = sources.get("codes", {})
    for path, source in (sources.get("files") or {}).items():
        # mtime None: linecache.checkcache keeps the entry although no such file exists here.
        linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
    roots = list(roots)
    todo = [*roots, *(v for root in roots[:1] for v in getattr(root, "__globals__", {}).values())]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            todo.extend(v for v in vars(obj).values() if isinstance(v, types.FunctionType))
            continue
        if not isinstance(obj, types.FunctionType) or obj.__code__.co_filename != _DYNAMIC_FILENAME:
            continue
        path = codes.get(_code_key(obj.__code__))
        if path is not None:
            obj.__code__ = _relocated(obj.__code__, path)
