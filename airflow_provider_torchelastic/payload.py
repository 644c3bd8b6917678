"""The payload: the training function and its arguments, as the runner receives them.

Layout: ``MAGIC`` + one line of JSON header + the cloudpickle bytes. The header is readable without unpickling, so
the runner can refuse a payload from another Python minor version with a clear message instead of a cryptic
unpickling error.

cloudpickle pickles functions of importable modules *by reference* (``module.name``). A DAG file is importable
where Airflow parses it, but it does not exist in a training pod, so the modules that the function comes from are
registered to be pickled *by value* while dumping: the function, its helpers, classes and closures travel whole.
Standard library, installed packages and this provider stay by reference: the runner image has them.
"""

from __future__ import annotations

import json
import linecache
import os
import pickle
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import cloudpickle

__all__ = ["FORMAT_VERSION", "Payload", "PayloadError", "PayloadHeader", "dump_payload", "load_payload"]

MAGIC: Final = b"airflow-provider-torchelastic payload\n"
#: The payload format this provider writes and its runner reads. Bump it when the body's layout changes: a runner
#: image that cannot read a payload then says which provider wrote it and which image to rebuild.
FORMAT_VERSION: Final = 1
_OWN_PACKAGE: Final = __name__.split(".")[0]
#: Set in every pod by the renderer, so that a runner can name the image it runs in.
IMAGE_ENV: Final = "TORCHELASTIC_IMAGE"


class PayloadError(ValueError):
    """The payload cannot be used here (corrupt, another format, another Python)."""


@dataclass(frozen=True, kw_only=True)
class PayloadHeader:
    format: int
    #: ``major.minor`` of the Python that pickled the payload; pickled code only loads on the same minor.
    python: str
    cloudpickle: str
    #: The airflow-provider-torchelastic version that wrote the payload ("" in payloads of 0.1.0, which lacked it).
    provider: str = ""

    @classmethod
    def current(cls) -> PayloadHeader:
        return cls(
            format=FORMAT_VERSION, python=_python_version(), cloudpickle=cloudpickle.__version__, provider=_provider()
        )


def _provider() -> str:
    from airflow_provider_torchelastic import __version__

    return __version__


@dataclass(frozen=True, kw_only=True)
class Payload:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    header: PayloadHeader


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def dump_payload(fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: Mapping[str, Any] | None = None) -> bytes:
    """Pickle ``fn(*args, **kwargs)`` so that it can run where the DAG file does not exist."""
    if not callable(fn):
        raise TypeError(f"python_callable: expected a callable, got {fn!r}")
    call_args, call_kwargs = tuple(args), dict(kwargs or {})
    modules = _modules_to_pickle_by_value(fn, call_args, call_kwargs)
    body = {"fn": fn, "args": call_args, "kwargs": call_kwargs, "sources": _source_locations(modules)}
    registered: list[types.ModuleType] = []
    try:
        for module in modules:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        pickled = cloudpickle.dumps(body)
    finally:
        # Registration is process-global state; leave the interpreter as we found it.
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)
    header = json.dumps(PayloadHeader.current().__dict__, sort_keys=True).encode()
    return MAGIC + header + b"\n" + pickled


def read_header(data: bytes) -> tuple[PayloadHeader, bytes]:
    """Split a payload into its header and the pickled body, checking the format."""
    if not data.startswith(MAGIC):
        raise PayloadError("not a torch elastic payload (missing header); was it written by this provider?")
    header_line, sep, body = data[len(MAGIC) :].partition(b"\n")
    if not sep:
        raise PayloadError("truncated payload: the header line is incomplete")
    try:
        fields = json.loads(header_line)
        header = PayloadHeader(
            format=fields["format"],
            python=fields["python"],
            cloudpickle=fields["cloudpickle"],
            provider=str(fields.get("provider", "")),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise PayloadError(f"unreadable payload header {header_line[:200]!r}: {e}") from None
    if header.format != FORMAT_VERSION:
        writer = f"airflow-provider-torchelastic {header.provider}" if header.provider else "another provider version"
        image = os.environ.get(IMAGE_ENV, "")
        where = f"the image {image}" if image else "this runner's image"
        raise PayloadError(
            f"payload format {header.format} is not supported by this runner: the payload was written by {writer} "
            f"(payload format {header.format}), and {where} has airflow-provider-torchelastic {_provider()} "
            f"(payload format {FORMAT_VERSION}); rebuild {where} with airflow-provider-torchelastic "
            f"{header.provider or 'the version installed on the Airflow workers'} (see docker/Dockerfile)"
        )
    return header, body


def check_compatible(header: PayloadHeader) -> None:
    """Refuse a payload pickled by another Python minor version: its bytecode would not load."""
    here = _python_version()
    if header.python != here:
        raise PayloadError(
            f"the payload was pickled with Python {header.python} but this runner runs Python {here}; "
            f"use an image with Python {header.python} (or run Airflow's workers on Python {here})"
        )


def load_payload(data: bytes) -> Payload:
    header, body = read_header(data)
    check_compatible(header)
    # cloudpickle is backward compatible across patch releases; a differing version is worth a note, not a failure.
    if header.cloudpickle != cloudpickle.__version__:
        print(
            f"note: payload pickled with cloudpickle {header.cloudpickle}, loading with {cloudpickle.__version__}",
            file=sys.stderr,
        )
    try:
        content = cloudpickle.loads(body)
    except (pickle.UnpicklingError, EOFError) as e:
        # Damaged in transit or storage; a missing module (ModuleNotFoundError) is left as it is: it names the module.
        raise PayloadError(f"corrupt payload: the pickled body ({len(body)} bytes) cannot be read: {e}") from e
    _restore_source_locations(content["fn"], content.get("sources") or {})
    return Payload(fn=content["fn"], args=tuple(content["args"]), kwargs=content["kwargs"], header=header)


# --- tracebacks that show the DAG file --------------------------------------------------------------------------
# cloudpickle renames by-value code to "<dynamic-code>", so a worker's traceback would show neither the DAG file nor
# its lines. The payload carries each local module's path and source, and where each function's code starts; the
# loader puts the path back and registers the source with linecache (the file need not exist where it runs).

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


def _source_locations(modules: Sequence[types.ModuleType]) -> dict[str, Any]:
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
        files[path] = source
        for function in _module_functions(module):
            codes[_code_key(function.__code__)] = path
    return {"files": files, "codes": codes}


def _relocated(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_relocated(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _restore_source_locations(fn: Any, sources: Mapping[str, Any]) -> None:
    codes: Mapping[str, str] = sources.get("codes", {})
    for path, source in (sources.get("files") or {}).items():
        # mtime None: linecache.checkcache keeps the entry although no such file exists here.
        linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
    todo = [fn, *getattr(fn, "__globals__", {}).values()]
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


# --- which modules travel by value -------------------------------------------------------------------------------


def _installed_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return tuple(Path(root).resolve() for root in roots if root)


def _is_local_module(module: types.ModuleType, installed: tuple[Path, ...]) -> bool:
    """A module that exists only where the DAG is parsed: not built in, not installed, not this provider."""
    name = module.__name__
    if name == "__main__" or name.split(".")[0] == _OWN_PACKAGE or name in sys.builtin_module_names:
        return False
    file = getattr(module, "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    return not any(path.is_relative_to(root) for root in installed)


def _referenced_objects(fn: Any) -> Iterator[Any]:
    """Globals that a function's code (including nested functions and lambdas) refers to by name."""
    code = getattr(fn, "__code__", None)
    fn_globals = getattr(fn, "__globals__", {})
    codes = [code] if code is not None else []
    while codes:
        current = codes.pop()
        for name in current.co_names:
            if name in fn_globals:
                yield fn_globals[name]
        codes.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue


def _modules_to_pickle_by_value(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[types.ModuleType]:
    installed = _installed_roots()
    found: dict[str, types.ModuleType] = {}
    seen: set[int] = set()
    todo: list[Any] = [fn, *args, *kwargs.values()]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.ModuleType):
            module: types.ModuleType | None = obj
        else:
            owner = obj if isinstance(obj, type | types.FunctionType) else type(obj)
            module = sys.modules.get(getattr(owner, "__module__", "") or "")
        if module is None or not _is_local_module(module, installed):
            continue
        found.setdefault(module.__name__, module)
        # Follow what local code refers to: a helper imported from a sibling module of the DAG file must travel
        # by value too, or unpickling fails in the pod with "No module named ...".
        if isinstance(obj, types.FunctionType):
            todo.extend(_referenced_objects(obj))
        elif isinstance(obj, type):
            todo.extend(v for v in vars(obj).values() if isinstance(v, types.FunctionType))
        elif isinstance(obj, types.ModuleType):
            todo.extend(v for v in vars(obj).values() if isinstance(v, type | types.FunctionType))
    return list(found.values())
