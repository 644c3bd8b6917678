"""The payload's unpickler: the shipped code's modules in the worker, and the one place that uses cloudpickle's
private reconstructors (``cloudpickle.cloudpickle._make_function``, ``_make_skeleton_class``, ``_make_skeleton_enum``,
``subimport``), checked against cloudpickle 3.1.3.

In the core, not in :mod:`airflow_provider_torchelastic.compat` (Airflow's private API), because the runner loads
payloads in images without Airflow. Each reconstructor is looked up with ``getattr``: a cloudpickle without one
loads payloads as plain cloudpickle does, without the shared module namespaces below.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import pickle
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any, Final

import cloudpickle

__all__ = ["Namespaces", "PayloadUnpickler", "ShippedModule"]

# cloudpickle rebuilds by-value functions with ``_make_function(code, globals, ...)``, where ``globals`` is one dict
# per module and pickle (shared by all the functions of that module), holding ``__name__``, ``__file__`` and, once
# the functions' state is set, the globals they refer to. The loader's unpickler swaps that dict for the ``__dict__``
# of a module registered in sys.modules under ``__name__``, before the first function of the module exists: the
# functions, the classes they define and everything that looks the module up by name then see one namespace.

_CLOUDPICKLE: Final = getattr(cloudpickle, "cloudpickle", None)
_MAKE_FUNCTION: Final = getattr(_CLOUDPICKLE, "_make_function", None)
_MAKE_CLASS: Final = tuple(
    f for f in (getattr(_CLOUDPICKLE, name, None) for name in ("_make_skeleton_class", "_make_skeleton_enum")) if f
)
_SUBIMPORT: Final = getattr(_CLOUDPICKLE, "subimport", None)


class ShippedModule(types.ModuleType):
    """A module that exists in this process only because a payload's code came from it (not importable here)."""


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a parent package that is missing or fails to import: not importable either
        return False


def _imported_or_standard(module: str) -> bool:
    return module in sys.modules or module.partition(".")[0] in sys.stdlib_module_names


def _new_module(name: str, *, package: bool) -> ShippedModule:
    module = ShippedModule(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    return module


class Namespaces:
    """The modules of one load: created where the name is free, reused where an earlier payload created them."""

    def __init__(self) -> None:
        self.modules: dict[str, types.ModuleType] = {}
        #: Functions and classes rebuilt by value during this load.
        self.defined: list[Any] = []
        self._refused: set[str] = set()
        #: module name -> the globals dict that cloudpickle gave the functions of a module that exists here.
        self._unregistered: dict[str, dict[str, Any]] = {}
        self._created: list[tuple[str, types.ModuleType]] = []

    def globals_for(self, shipped: dict[str, Any]) -> dict[str, Any]:
        name = shipped.get("__name__")
        module = self._module(name, shipped) if isinstance(name, str) and name else None
        if module is not None:
            return module.__dict__
        if isinstance(name, str):
            self._unregistered.setdefault(name, shipped)
        return shipped

    def _namespace(self, name: str) -> dict[str, Any] | None:
        """Where the functions of module ``name`` look up their globals in this load."""
        module = self.modules.get(name)
        return module.__dict__ if module is not None else self._unregistered.get(name)

    def _module(self, name: str, shipped: Mapping[str, Any]) -> types.ModuleType | None:
        if name in self.modules:
            return self.modules[name]
        if name in self._refused:
            return None
        existing = sys.modules.get(name)
        if isinstance(existing, ShippedModule):
            module: types.ModuleType = existing
        elif name in sys.modules or _importable(name):
            # A real module (an installed package, __main__) or a blocked one (None): never replaced, never imported
            # for this. The code keeps the globals dict that cloudpickle gives it.
            self._refused.add(name)
            return None
        else:
            module = _new_module(name, package="__path__" in shipped)
            self._register(name, module)
        for key in ("__file__", "__package__", "__path__"):
            if key in shipped and module.__dict__.get(key) is None:
                module.__dict__[key] = shipped[key]
        self.modules[name] = module
        return module

    def _register(self, name: str, module: types.ModuleType) -> None:
        sys.modules[name] = module
        self._created.append((name, module))
        parent_name, _, child = name.rpartition(".")
        if not parent_name:
            return
        # pickle imports a dotted module through its parents: a parent that exists nowhere gets an empty package.
        parent = sys.modules.get(parent_name)
        if parent_name not in sys.modules and not _importable(parent_name):
            parent = _new_module(parent_name, package=True)
            self._register(parent_name, parent)
        if isinstance(parent, ShippedModule):
            setattr(parent, child, module)

    def add_extra_globals(self, shipped: Mapping[str, Mapping[str, tuple[bytes, bool]]]) -> None:
        """Add the globals that cloudpickle left behind to the namespace of their module's functions, where absent."""
        for module_name, names in shipped.items():
            namespace = self._namespace(module_name)
            if namespace is None:
                continue
            for name, (data, needed) in names.items():
                if name in namespace:
                    continue
                try:
                    value = PayloadUnpickler(io.BytesIO(data), self, guarded=not needed).load()
                except Exception:  # a module this process lacks (or has not imported, for an annotation's name)
                    continue
                namespace.setdefault(name, value)

    def bind_definitions(self) -> None:
        """Top-level classes and functions that travelled are attributes of their module, as in the DAG file (where
        the name is free): pickle finds a class by ``module.qualname``."""
        for obj in self.defined:
            module = self.modules.get(getattr(obj, "__module__", None) or "")
            qualname = getattr(obj, "__qualname__", "")
            if module is not None and isinstance(qualname, str) and qualname.isidentifier():
                module.__dict__.setdefault(qualname, obj)

    def discard(self) -> None:
        """Loading failed: take out of sys.modules what this load put there."""
        for name, module in reversed(self._created):
            if sys.modules.get(name) is module:
                del sys.modules[name]
        self._created.clear()


class PayloadUnpickler(pickle.Unpickler):
    """cloudpickle's stream, with by-value functions given their module's namespace (see :class:`Namespaces`).

    ``guarded``: for the annotation names, which are optional: refuse to import a module that this process has not
    imported yet (other than the standard library), so that an annotation never drags Airflow or a large package into
    a worker.
    """

    def __init__(self, file: io.BytesIO, namespaces: Namespaces, *, guarded: bool = False) -> None:
        super().__init__(file)
        self._namespaces = namespaces
        self._guarded = guarded

    def find_class(self, module: str, name: str) -> Any:
        if self._guarded and not _imported_or_standard(module):
            raise pickle.UnpicklingError(f"{module} is not imported in this process")
        found = super().find_class(module, name)
        if _MAKE_FUNCTION is not None and found is _MAKE_FUNCTION:
            return self._make_function
        if any(found is make for make in _MAKE_CLASS):
            return self._class_maker(found)
        if self._guarded and _SUBIMPORT is not None and found is _SUBIMPORT:
            return self._subimport
        return found

    def _make_function(self, *args: Any, **kwargs: Any) -> Any:
        # (code, globals, name, argdefs, closure)
        if len(args) >= 2 and isinstance(args[1], dict):
            args = (args[0], self._namespaces.globals_for(args[1]), *args[2:])
        function = _MAKE_FUNCTION(*args, **kwargs)  # type: ignore[misc]
        self._namespaces.defined.append(function)
        return function

    def _class_maker(self, make: Callable[..., Any]) -> Callable[..., Any]:
        def make_class(*args: Any, **kwargs: Any) -> Any:
            cls = make(*args, **kwargs)
            self._namespaces.defined.append(cls)
            return cls

        return make_class

    @staticmethod
    def _subimport(name: str) -> Any:
        if not _imported_or_standard(name):
            raise pickle.UnpicklingError(f"{name} is not imported in this process")
        return _SUBIMPORT(name)  # type: ignore[misc]
