"""The public paths users import the package's names from, and the one way a name moved there says so.

A class or function exported at a public path reports that path as its ``__module__``: tracebacks, reprs, docs and
by-reference pickles (pickle and cloudpickle name a class or function by module and qualified name, and a payload
keeps that name) then show a path that stays, not an internal module that may move. The public module must give the
name under its own name (the package root does, lazily): pickle checks that before it writes the reference.

Standard library only: the core, the worker-side API and the operators all call :func:`publish`.
"""

from __future__ import annotations

import inspect
import sys
import typing
from typing import Any, Final

__all__ = ["OPERATORS_MODULE", "PUBLIC_MODULE", "command_name", "publish"]

#: The package root, where the configuration types, the choices and the worker-side functions are imported from.
PUBLIC_MODULE: Final = "airflow_provider_torchelastic"
#: Where the operator, its links and its failure classes are imported from (a serialized DAG names its operator and
#: links by this path, and task logs print the failure classes by it).
OPERATORS_MODULE: Final = f"{PUBLIC_MODULE}.operators"


def command_name(script: str, module: str) -> str:
    """What a command-line tool calls itself in its usage: ``script``, its console script (``[project.scripts]``),
    when it was run as that, else ``python -m <module>``, the path that needs no script on PATH."""
    return script if sys.argv and sys.argv[0].rpartition("/")[2] == script else f"python -m {module}"


def publish(*objects: Any, module: str = PUBLIC_MODULE) -> None:
    """Show each of ``objects`` as ``module``'s.

    A class's own annotations are strings (``from __future__ import annotations``) that ``typing.get_type_hints``,
    ``inspect.signature(eval_str=True)``, Sphinx and pydantic evaluate in ``sys.modules[cls.__module__]``. Once that is
    the public module, which imports none of the names they use, they would fail (``NameError: name 'Mapping' is not
    defined``), so each is evaluated first where the class was defined. One that names what only a type checker
    imports (``if TYPE_CHECKING:``) stays a string, as unresolvable as it was before.
    """
    for value in objects:
        if isinstance(value, type):
            _resolve_own_annotations(value)
        value.__module__ = module


def _resolve_own_annotations(cls: type) -> None:
    annotations = inspect.get_annotations(cls)
    if not any(isinstance(annotation, str) for annotation in annotations.values()):
        return
    # Where typing.get_type_hints looks for a class's names: its module's globals, then the class body's.
    module_globals = vars(sys.modules[cls.__module__])
    class_names = dict(vars(cls))
    resolved: dict[str, Any] = {}
    for name, annotation in annotations.items():
        # One annotation at a time, through typing itself (nested strings such as Mapping[str, "str | Mapping"]
        # included), so that one name only a type checker knows leaves the others resolved.
        holder = type("_Annotation", (), {"__annotations__": {name: annotation}})
        try:
            resolved[name] = typing.get_type_hints(holder, module_globals, class_names, include_extras=True)[name]
        except NameError:
            resolved[name] = annotation
    cls.__annotations__ = resolved
