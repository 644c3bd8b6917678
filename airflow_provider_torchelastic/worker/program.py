"""A torchrun script or module as the training "function": ``TorchElasticOperator(module=..., args=[...])`` or
``script=...``, and ``set_result`` for what its rank 0 hands back.

A :class:`Program` travels in the payload in place of a function, so everything a function has (the runner, the
root cause, recoverable errors, logs, metrics, checkpoints, ``context.current()``, every execution and job kind)
holds for it. Each worker runs it as ``python -m module args...`` or ``python script args...`` would: ``sys.argv``
set, the module or script run as ``__main__`` (``if __name__ == "__main__":`` holds, and a spawned DataLoader worker
re-imports it by that name), the script's folder first on ``sys.path``. With ``start_method="spawn"`` (the
default) each worker is a fresh interpreter, as under torchrun.

Standard library only: it runs in images without Airflow.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_torchelastic.core.public import publish

__all__ = ["ModuleNotInstalledError", "Program", "ScriptNotFoundError", "set_result"]

# What set_result() was given in this worker (a list, so that None is a value too).
_RESULT: list[Any] = []


def set_result(value: Any) -> None:
    """Hand ``value`` back as the task's result when called on rank 0 of a ``module=``/``script=`` task (encoded as
    a function's return value is: JSON, artifacts for tensors and models). On other ranks it is ignored, as their
    functions' return values are. The last call wins; a program that never calls it returns None."""
    _RESULT[:] = [value]


class ScriptNotFoundError(FileNotFoundError):
    """``script=`` names no file where the worker runs (the image, or the Airflow worker for local execution)."""


class ModuleNotInstalledError(ModuleNotFoundError):
    """``module=`` names a module that is not installed where the worker runs (the image, or the Airflow worker for
    local execution). A module it imports that is missing is the module's own failure, raised as it is."""


def _missing(what: str) -> str:
    """``what`` (``script='x.py': no such file``), where it was looked for, and where it must be."""
    return (
        f"{what} on {os.uname().nodename} (working directory {os.getcwd()}); it must be where the workers run: in the "
        "image, or on the Airflow worker for local execution"
    )


def _check_installed(module: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError as e:  # a parent package is missing, or something a parent's __init__ imports
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise
        found = False
    if not found:
        raise ModuleNotInstalledError(_missing(f"module={module!r}: not installed"), name=module)


@dataclass(frozen=True)
class Program:
    """``python -m module *args`` or ``python script *args``, run in a worker in place of a function."""

    module: str | None = None
    script: str | None = None
    args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """What the task log calls it."""
        return f"-m {self.module}" if self.module is not None else str(self.script)

    def __call__(self) -> Any:
        _RESULT.clear()
        saved_argv, saved_path = sys.argv[:], sys.path[:]
        try:
            if self.module is not None:
                _check_installed(self.module)
                sys.argv = [self.module, *self.args]  # runpy puts the module's file in argv[0], as `python -m` does
                runpy.run_module(self.module, run_name="__main__", alter_sys=True)
            else:
                path = Path(str(self.script))
                if not path.is_file():
                    raise ScriptNotFoundError(_missing(f"script={self.script!r}: no such file"))
                sys.argv = [str(path), *self.args]
                sys.path.insert(0, str(path.resolve().parent))  # as `python script.py` does
                runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            # exit(), sys.exit(0) at the end of a script is its normal end: its result stands. Any other code is the
            # worker's failure (runner.worker turns it into one).
            if e.code not in (None, 0):
                raise
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
        return _RESULT[0] if _RESULT else None


# Exported at the package root, and shown (and pickled by reference) by that path.
publish(set_result)
