"""The payload: the training function and its arguments, as the runner receives them.

Layout: ``MAGIC`` + one line of JSON header + the cloudpickle bytes. The header is readable without unpickling, so
the runner can refuse a payload from another Python minor version with a clear message instead of a cryptic
unpickling error.

cloudpickle pickles functions of importable modules *by reference* (``module.name``). A DAG file is importable
where Airflow parses it, but it does not exist in a training pod, so the modules that the function comes from are
registered to be pickled *by value* while dumping: the function, its helpers, classes and closures travel whole.
Standard library, installed packages and this provider stay by reference: the runner image has them.

In the worker, code that came by value still names its module (``__name__``, ``cls.__module__``), and Python looks
modules up by that name: ``dataclasses`` resolves string annotations (``from __future__ import annotations``) in
``sys.modules[cls.__module__]``, ``typing.get_type_hints`` too, and ``pickle`` finds a class by importing its module
(``torch.distributed``'s ``*_object`` collectives). So the loader gives each such module a module object in
``sys.modules`` whose ``__dict__`` *is* the globals dict that module's functions are rebuilt with (see
:class:`~airflow_provider_torchelastic.core.unpickle.Namespaces`): the globals the code was shipped with, plus the
module's classes and functions that travelled and the globals that cloudpickle leaves behind (read by class bodies,
named by string annotations), never the whole DAG file. A module that exists or is importable in the worker is never
replaced, nor imported.
"""

from __future__ import annotations

import ast
import dis
import hashlib
import hmac
import inspect
import io
import json
import os
import pickle
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import cloudpickle

from airflow_provider_torchelastic.core.payload_sources import restore_source_locations, source_locations
from airflow_provider_torchelastic.core.unpickle import Namespaces, PayloadUnpickler

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
    from airflow_provider_torchelastic.core.version import __version__

    return __version__


@dataclass(frozen=True, kw_only=True)
class Payload:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    header: PayloadHeader


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


#: Writes a task's arguments elsewhere when the payload would be too large: given the arguments, returns them with
#: their tensors replaced by references (written as artifacts), and a function that stores the arguments' pickle and
#: returns its reference (a JSON object with ``url``, ``bytes`` and ``sha256``).
Spill = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any], Callable[[bytes], Any]]]
#: Reads spilled arguments' bytes back, given their reference (the runner: from the store, bounded by ``bytes``).
Fetch = Callable[[Mapping[str, Any]], bytes]


def dump_payload(
    fn: Callable[..., Any],
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    max_bytes: int | None = None,
    spill: Spill | None = None,
) -> bytes:
    """Pickle ``fn(*args, **kwargs)`` so that it can run where the DAG file does not exist.

    ``spill``: when the payload would be larger than ``max_bytes``, the arguments go through it instead (their
    tensors as artifacts, the rest as one pickle in the store), and the payload carries only the pickle's reference
    and sha256, which the runner checks before it unpickles anything (:func:`load_payload`).
    """
    if not callable(fn):
        raise TypeError(f"python_callable: expected a callable, got {fn!r}")
    call_args, call_kwargs = tuple(args), dict(kwargs or {})
    local = _local_code(fn, call_args, call_kwargs)
    body: dict[str, Any] = {
        "fn": fn,
        "args": call_args,
        "kwargs": call_kwargs,
        "sources": source_locations(local.modules),
    }
    header = json.dumps(PayloadHeader.current().__dict__, sort_keys=True).encode()
    registered: list[types.ModuleType] = []
    try:
        for module in local.modules:
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
        # Each pickled on its own: a name that cannot be pickled here, or loaded there, is left out, not fatal.
        body["extra_globals"] = _pickle_each(local.extra_globals)
        pickled: bytes = cloudpickle.dumps(body)
        if spill is not None and max_bytes is not None and len(MAGIC) + len(header) + 1 + len(pickled) > max_bytes:
            # Pickled while the DAG file's modules are registered, as the payload is: their classes travel by value.
            spilled_args, spilled_kwargs, store = spill(call_args, call_kwargs)
            ref = store(cloudpickle.dumps({"args": spilled_args, "kwargs": spilled_kwargs}))
            pickled = cloudpickle.dumps({**body, "args": (), "kwargs": {}, ARGUMENTS_REF_KEY: ref})
    finally:
        # Registration is process-global state; leave the interpreter as we found it.
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)
    return MAGIC + header + b"\n" + pickled


#: The body's key of the reference to spilled arguments.
ARGUMENTS_REF_KEY: Final = "arguments_ref"


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


def _spilled_arguments(ref: Mapping[str, Any], fetch: Fetch | None, namespaces: Namespaces) -> dict[str, Any]:
    """The arguments a payload spilled to the store, unpickled only once their bytes match the reference's sha256
    (the reference came in the payload, whose own sha256 the runner checked)."""
    if fetch is None:
        raise PayloadError(
            f"the payload's arguments were spilled to {ref.get('url')!r}, and nothing can fetch them here"
        )
    data = fetch(ref)
    digest = hashlib.sha256(data).hexdigest()
    if not hmac.compare_digest(digest, str(ref.get("sha256"))):
        raise PayloadError(
            f"the spilled arguments at {ref.get('url')!r} are not the ones this try wrote (sha256 {digest}, expected "
            f"{ref.get('sha256')}): refusing to unpickle them"
        )
    content = PayloadUnpickler(io.BytesIO(data), namespaces).load()
    return {"args": tuple(content["args"]), "kwargs": dict(content["kwargs"])}


def load_payload(data: bytes, *, fetch: Fetch | None = None) -> Payload:
    """The payload's function and arguments; ``fetch`` reads spilled arguments (see :func:`dump_payload`)."""
    header, body = read_header(data)
    check_compatible(header)
    # cloudpickle is backward compatible across patch releases; a differing version is worth a note, not a failure.
    if header.cloudpickle != cloudpickle.__version__:
        print(
            f"note: payload pickled with cloudpickle {header.cloudpickle}, loading with {cloudpickle.__version__}",
            file=sys.stderr,
        )
    namespaces = Namespaces()
    try:
        content = PayloadUnpickler(io.BytesIO(body), namespaces).load()
        ref = content.get(ARGUMENTS_REF_KEY)
        if ref is not None:
            content.update(_spilled_arguments(ref, fetch, namespaces))
        namespaces.add_extra_globals(content.get("extra_globals") or {})
        namespaces.bind_definitions()
    except (pickle.UnpicklingError, EOFError) as e:
        namespaces.discard()
        # Damaged in transit or storage; a missing module (ModuleNotFoundError) is left as it is: it names the module.
        raise PayloadError(f"corrupt payload: the pickled body ({len(body)} bytes) cannot be read: {e}") from e
    except BaseException:
        namespaces.discard()
        raise
    restore_source_locations([content["fn"], *namespaces.defined], content.get("sources") or {})
    return Payload(fn=content["fn"], args=tuple(content["args"]), kwargs=content["kwargs"], header=header)


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


@dataclass(frozen=True)
class _LocalCode:
    #: The modules to pickle by value.
    modules: list[types.ModuleType]
    #: module name -> {name: (value, needed)}: globals that the travelling code may look up but cloudpickle does not
    #: ship (see :func:`_unshipped_names`); ``needed``: the code reads it (not only an annotation names it).
    extra_globals: dict[str, dict[str, tuple[Any, bool]]] = field(default_factory=dict)


def _local_code(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _LocalCode:
    installed = _installed_roots()
    found: dict[str, types.ModuleType] = {}
    extra: dict[str, dict[str, tuple[Any, bool]]] = {}
    #: module name -> the globals that cloudpickle ships with its travelling functions.
    shipped: dict[str, set[str]] = {}
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
            namespace: Mapping[str, Any] = obj.__globals__
            shipped.setdefault(str(namespace.get("__name__")), set()).update(_global_names(obj.__code__))
        elif isinstance(obj, type):
            todo.extend(v for v in vars(obj).values() if isinstance(v, types.FunctionType))
            namespace = vars(module)
        else:
            if isinstance(obj, types.ModuleType):
                todo.extend(v for v in vars(obj).values() if isinstance(v, type | types.FunctionType))
            continue
        unshipped = _unshipped_names(obj, namespace)
        if unshipped:
            names = extra.setdefault(str(namespace.get("__name__")), {})
            for name, (value, needed) in unshipped.items():
                names[name] = (value, needed or names.get(name, (None, False))[1])
            todo.extend(value for value, _ in unshipped.values())

    def travels(module_name: str, name: str, value: Any, needed: bool) -> bool:
        if name in shipped.get(module_name, ()):
            return False  # cloudpickle ships it with the functions
        # A local module would travel whole (by value): worth it for code that reads it, not for an annotation.
        return needed or not (isinstance(value, types.ModuleType) and value.__name__ in found)

    kept = {
        module_name: remaining
        for module_name, names in extra.items()
        if (remaining := {k: v for k, v in names.items() if travels(module_name, k, *v)})
    }
    return _LocalCode(modules=list(found.values()), extra_globals=kept)


# --- globals that cloudpickle leaves behind ----------------------------------------------------------------------
# cloudpickle ships the globals that a function's code reads with LOAD_GLOBAL (nested code included). Two kinds of
# lookups in the module's namespace escape it:
# - the body of a class defined inside the function reads globals with LOAD_NAME (``field`` in
#   ``tags: list[str] = field(default_factory=list)``): without them the class statement fails with NameError;
# - with ``from __future__ import annotations`` an annotation is a string, resolved later in the module's namespace
#   by dataclasses (is ``ClassVar[int]`` a ClassVar? then it is no field) and typing.get_type_hints: without the names
#   a dataclass quietly gets a field where the DAG file has a class variable.
# The payload carries those names apart, each pickled on its own; the loader adds what it can load (see
# unpickle.Namespaces), and for names that only annotations use, only what loads without importing a module this
# process has not imported.

_MAX_ANNOTATION_CHARS: Final = 500
_GLOBAL_OPS: Final = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"})
_NAME_OPS: Final = frozenset({"LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})


def _nested_codes(code: types.CodeType) -> Iterator[types.CodeType]:
    codes = [code]
    while codes:
        current = codes.pop()
        yield current
        codes.extend(const for const in current.co_consts if isinstance(const, types.CodeType))


def _global_names(code: types.CodeType) -> set[str]:
    """The globals that cloudpickle ships with a function: what its code (nested code included) reads as globals."""
    return {
        str(instruction.argval)
        for current in _nested_codes(code)
        for instruction in dis.get_instructions(current)
        if instruction.opname in _GLOBAL_OPS
    }


def _class_body_names(code: types.CodeType) -> set[str]:
    """Names that the bodies of the classes that a function defines look up (a class body is not optimized code)."""
    return {
        str(instruction.argval)
        for current in _nested_codes(code)
        if current is not code and not current.co_flags & inspect.CO_OPTIMIZED
        for instruction in dis.get_instructions(current)
        if instruction.opname in _NAME_OPS
    }


def _code_strings(code: types.CodeType) -> Iterator[str]:
    """String constants of a function's code and of the code nested in it, where the annotations of the classes and
    functions that it defines are (a class body's ``x: "int"``, a nested function's ``("x", "int")``)."""
    for current in _nested_codes(code):
        for const in current.co_consts:
            if isinstance(const, str):
                yield const
            elif isinstance(const, tuple):
                yield from (item for item in const if isinstance(item, str))


def _names_in_annotation(text: str) -> set[str]:
    if len(text) > _MAX_ANNOTATION_CHARS or "\n" in text:
        return set()
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # list["Sample"]
            names |= _names_in_annotation(node.value)
    return names


def _is_annotation_value(value: Any) -> bool:
    """Classes, modules and typing constructs: what annotations name; never a DAG's task or a tensor."""
    if isinstance(value, type | types.ModuleType | types.GenericAlias | types.UnionType):
        return True
    return type(value).__module__ in ("typing", "typing_extensions")


def _unshipped_names(obj: types.FunctionType | type, namespace: Mapping[str, Any]) -> dict[str, tuple[Any, bool]]:
    """Globals of ``namespace`` that class bodies in ``obj``'s code read, and that the string annotations of ``obj``
    (and of what its code defines) name: ``{name: (value, read by code)}``."""
    try:
        annotations = inspect.get_annotations(obj)
    except Exception:  # annotations that cannot even be read: nothing to resolve
        annotations = {}
    texts = [value for value in annotations.values() if isinstance(value, str)]
    needed: set[str] = set()
    if isinstance(obj, types.FunctionType):
        texts.extend(_code_strings(obj.__code__))
        needed = _class_body_names(obj.__code__)
    annotated: set[str] = set()
    for text in texts:
        annotated |= _names_in_annotation(text)
    found: dict[str, tuple[Any, bool]] = {}
    for name in sorted(needed | annotated):
        if name.startswith("__") or name not in namespace:
            continue
        if name in needed:
            found[name] = (namespace[name], True)
        elif _is_annotation_value(namespace[name]):
            found[name] = (namespace[name], False)
    return found


def _pickle_each(values: Mapping[str, Mapping[str, tuple[Any, bool]]]) -> dict[str, dict[str, tuple[bytes, bool]]]:
    pickled: dict[str, dict[str, tuple[bytes, bool]]] = {}
    for module_name, names in values.items():
        for name, (value, needed) in names.items():
            try:
                data = cloudpickle.dumps(value)
            except Exception:  # not picklable: it stays unresolved in the worker, as it was before
                continue
            pickled.setdefault(module_name, {})[name] = (data, needed)
    return pickled
