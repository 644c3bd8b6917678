"""The public surface, pinned: every path that DAG files, training code, Airflow's database and pickles name keeps
resolving, wherever the code behind it lives.

Moving a module is free inside the package; these paths are not, because they outlive the code that wrote them:
a DAG file imports them at every parse, a trigger row and a serialized DAG name classes by classpath across an
upgrade, pods run the runner by its ``-m`` path, and a payload names by reference what training code pickles.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pickle
import re
import sys
import typing
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

PACKAGE = "airflow_provider_torchelastic"

#: module -> the names it must keep giving. The package's ``__all__`` is pinned in test_public_api.py.
PINNED: dict[str, tuple[str, ...]] = {
    PACKAGE: (
        "Elastic",
        "PyTorch",
        "Master",
        "Worker",
        "RunPolicy",
        "RecoverableError",
        "report",
        "set_result",
        "__version__",
        "PodOptions",
        "JobOptions",
        "Execution",
        "TrainingJobKind",
        "OnFinishAction",
    ),
    f"{PACKAGE}.pod": ("PodOptions", "JobOptions", "secret_key_ref", "config_map_key_ref"),
    f"{PACKAGE}.context": ("current", "heartbeat", "RunContext", "TaskContext", "NoRunContextError", "CONTEXT_ENV"),
    f"{PACKAGE}.checkpoint": ("save", "latest", "load_latest", "save_sharded", "load_sharded_latest", "Checkpoint"),
    f"{PACKAGE}.metrics": ("report", "flush"),
    f"{PACKAGE}.artifacts": ("load", "pickled", "ArtifactIntegrityError", "ArtifactRefError"),
    f"{PACKAGE}.errors": ("RecoverableError", "KubeError", "EXIT_OK", "EXIT_FAILED", "EXIT_RECOVERABLE"),
    f"{PACKAGE}.operators": (
        "TorchElasticOperator",
        "TrainingFailedError",
        "TrainingRecoverableError",
        # One class per cause (issue 31): what retry_policy rules name; their module is the classpath logs print.
        "TrainingError",
        "OutOfMemoryError",
        "PreemptedError",
        "CapacityTimeoutError",
        "NodeLostError",
        "InfrastructureError",
        "ImageUnavailableError",
        "ImageTransientlyUnavailableError",
        "StalledError",
        "ConfigurationError",
        "DeadlineExceededError",
        "UserCodeError",
        "UserCodeRecoverableError",
        "UserCodeFailedError",
        "UserExceptionRule",
        "TorchElasticJobLink",
        "TorchElasticLogsLink",
    ),
    f"{PACKAGE}.decorators": ("torch_elastic_task",),
    f"{PACKAGE}.triggers": ("TorchElasticJobTrigger",),
    f"{PACKAGE}.plugin": ("TorchElasticPlugin",),
}

#: Classpaths written into Airflow's database: a trigger row names its trigger, a serialized DAG its operator's
#: extra links. A row written before an upgrade is read after it.
TRIGGER_CLASSPATH = f"{PACKAGE}.triggers.TorchElasticJobTrigger"
LINK_CLASSPATHS = (f"{PACKAGE}.operators.TorchElasticJobLink", f"{PACKAGE}.operators.TorchElasticLogsLink")

#: What payloads pickle by reference (cloudpickle pickles an importable function or class by its module and name):
#: the paths of today's release, and the paths of releases before the layout moved them.
PICKLED_BY_REFERENCE = (
    (f"{PACKAGE}.errors", "RecoverableError"),
    (f"{PACKAGE}.metrics", "report"),
    (f"{PACKAGE}.worker.metrics", "report"),
    # What a module= or script= task's program imports (issue 32).
    (f"{PACKAGE}.worker.program", "set_result"),
    # Since the root's exports report the root as their module (issue 36).
    (PACKAGE, "report"),
    (PACKAGE, "set_result"),
    (PACKAGE, "Elastic"),
    (PACKAGE, "PodOptions"),
)


def resolve(path: str) -> Any:
    """``a.b.C`` as Python resolves it: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize(("module", "names"), sorted(PINNED.items()), ids=sorted(PINNED))
def test_every_pinned_name_resolves(module: str, names: tuple[str, ...]) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}"


def test_a_public_path_is_the_module_itself_not_a_copy() -> None:
    from airflow_provider_torchelastic import checkpoint, context

    assert (
        context is importlib.import_module(f"{PACKAGE}.context") is importlib.import_module(f"{PACKAGE}.worker.context")
    )
    assert checkpoint is importlib.import_module(f"{PACKAGE}.checkpoint")
    assert importlib.import_module(f"{PACKAGE}.pod") is importlib.import_module(f"{PACKAGE}.core.pod_options")
    assert resolve(f"{PACKAGE}.metrics.report") is resolve(f"{PACKAGE}.report")


def _readme_paths() -> set[str]:
    """Every dotted path of the package the README names: imports in its code blocks and paths in its text."""
    text = (REPO_ROOT / "README.md").read_text()
    paths: set[str] = set()
    for module, names in re.findall(rf"from ({PACKAGE}[\w.]*) import ([\w, ]+)", text):
        paths.update(f"{module}.{name.strip()}" for name in names.split(",") if name.strip())
    paths.update(re.findall(rf"import ({PACKAGE}[\w.]*)", text))
    paths.update(match.rstrip(".") for match in re.findall(rf"`({PACKAGE}(?:\.\w+)+)", text))
    paths.update(re.findall(rf"python -m ({PACKAGE}[\w.]*)", text))
    return paths


README_PATHS = sorted(_readme_paths())


def test_the_readme_names_paths() -> None:
    assert len(README_PATHS) >= 5, README_PATHS  # read the README, not an empty list


@pytest.mark.parametrize("path", README_PATHS)
def test_every_path_in_the_readme_resolves(path: str) -> None:
    resolve(path)


def test_the_trigger_writes_and_reads_its_pinned_classpath() -> None:
    from airflow.sdk.module_loading import import_string

    from airflow_provider_torchelastic.triggers import TorchElasticJobTrigger

    assert import_string(TRIGGER_CLASSPATH) is TorchElasticJobTrigger
    trigger = TorchElasticJobTrigger(kind="Pod", name="job", namespace="ml")
    assert trigger.serialize()[0] == TRIGGER_CLASSPATH


def test_the_operator_links_keep_their_classpaths() -> None:
    from airflow_provider_torchelastic.operators import TorchElasticOperator

    for classpath in LINK_CLASSPATHS:
        assert isinstance(resolve(classpath), type), classpath
    written = {
        f"{type(link).__module__}.{type(link).__qualname__}" for link in TorchElasticOperator.operator_extra_links
    }
    assert written <= set(LINK_CLASSPATHS), f"a serialized DAG would name {written - set(LINK_CLASSPATHS)}"


@pytest.mark.parametrize(("module", "name"), PICKLED_BY_REFERENCE, ids=[f"{m}.{n}" for m, n in PICKLED_BY_REFERENCE])
def test_a_pickle_that_names_a_public_object_by_reference_loads(module: str, name: str) -> None:
    # Protocol 0's GLOBAL opcode, written by hand: the bytes an older payload holds, whatever the code looks like now.
    loaded = pickle.loads(f"c{module}\n{name}\n.".encode())
    assert loaded is resolve(f"{PACKAGE}.{name}") or loaded is resolve(f"{PACKAGE}.errors.{name}")


def test_what_training_code_pickles_by_reference_names_a_pinned_path() -> None:
    from airflow_provider_torchelastic import RecoverableError, report

    for value in (RecoverableError, report):
        assert (value.__module__, value.__qualname__) in PICKLED_BY_REFERENCE, value


def test_the_runner_runs_by_its_module_path() -> None:
    spec = importlib.util.find_spec(f"{PACKAGE}.runner.__main__")
    assert spec is not None and spec.origin is not None


#: The modules users import from (the README's paths): a name they are shown says one of these as its ``__module__``,
#: which tracebacks, reprs and by-reference pickles then print, never an internal module that may move.
PUBLIC_MODULES = frozenset(PINNED) | {f"{PACKAGE}.metrics", f"{PACKAGE}.preflight", f"{PACKAGE}.kubernetes.sweep"}


def _shown_objects() -> dict[str, Any]:
    """The package's classes and functions that users are shown: the root's exports, and those the README names."""
    import airflow_provider_torchelastic as root

    shown = {f"{PACKAGE}.{name}": getattr(root, name) for name in root.__all__}
    for path in README_PATHS:
        value = resolve(path)
        if isinstance(value, type) or callable(value):
            shown[path] = value
    return {
        path: value
        for path, value in shown.items()
        if (isinstance(value, type) or callable(value)) and getattr(value, "__module__", "").startswith(PACKAGE)
    }


SHOWN = sorted(_shown_objects())


def test_the_shown_names_include_the_roots_exports() -> None:
    assert {f"{PACKAGE}.{name}" for name in ("Elastic", "PodOptions", "report", "Execution")} <= set(SHOWN)


@pytest.mark.parametrize("path", SHOWN)
def test_a_shown_name_reports_a_public_module(path: str) -> None:
    value = resolve(path)
    assert value.__module__ in PUBLIC_MODULES, f"{path} says it lives in {value.__module__}"
    # ... and that module gives it under its own name: what pickle checks when it pickles it by reference.
    assert resolve(f"{value.__module__}.{value.__qualname__}") is value


#: Every shown and pinned name (resolved in the test: a module imports when its case runs, not at collection).
SHOWN_AND_PINNED = sorted(set(SHOWN) | {f"{module}.{name}" for module, names in PINNED.items() for name in names})


@pytest.mark.parametrize("path", SHOWN_AND_PINNED)
def test_a_public_class_keeps_its_annotations_resolvable(path: str) -> None:
    # typing.get_type_hints (and Sphinx, pydantic, inspect.signature(eval_str=True)) evaluate a class's string
    # annotations in sys.modules[cls.__module__]: once that is the public module, core.public.publish must have
    # resolved them where the class was defined. Our classes only: Airflow's BaseOperator names what only a type
    # checker imports, as it always did.
    value = resolve(path)
    for klass in value.__mro__ if isinstance(value, type) else ():
        if not klass.__module__.startswith(PACKAGE):
            continue
        annotations = inspect.get_annotations(klass)
        holder = type("Holder", (), {"__annotations__": annotations})
        namespace = vars(sys.modules[klass.__module__])
        try:
            typing.get_type_hints(holder, namespace, dict(vars(klass)), include_extras=True)
        except NameError as e:
            pytest.fail(f"{klass.__qualname__} (shown as {klass.__module__}): {e}")
