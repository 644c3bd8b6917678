"""The kinds of job: a static table of the built-in kinds (a Pod, a PyTorchJob) plus the kinds other packages
plug in through the ``airflow_provider_torchelastic.job_kinds`` entry-point group.

Everything that differs between kinds is in the kind's module and its :class:`JobKind` descriptor (API path,
renderer, pods, decisions, owner reference, the UI's replica count and its rendered-template view); the rest of the
provider asks this table instead of testing kind names, so a new kind (Kubeflow Trainer v2's ``TrainJob``) is one
module and one table entry, or one entry point in another package. Pure: no I/O, no Airflow, no kubernetes.

An entry point names a :class:`JobKind` object (``fakejob = my_package.kinds:FAKE_JOB``). Plugged-in kinds come
before the built-in ones, so that one that accepts a config claims it; a plugged-in kind may not reuse a built-in
kind's name. The entry points are read once per process, on first use (never at import: DAG files import this).
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Final

from airflow_provider_torchelastic.core.config import TaskConfig
from airflow_provider_torchelastic.kubernetes.kinds import pod, pytorchjob
from airflow_provider_torchelastic.kubernetes.kinds.descriptor import JobKind

__all__ = ["BUILT_IN", "ENTRY_POINT_GROUP", "POD", "PYTORCHJOB", "JobKind", "for_config", "get", "registered"]

POD: Final = pod.KIND
PYTORCHJOB: Final = pytorchjob.KIND
BUILT_IN: Final = (POD, PYTORCHJOB)
ENTRY_POINT_GROUP: Final = "airflow_provider_torchelastic.job_kinds"


@functools.cache
def registered() -> tuple[JobKind, ...]:
    """Every kind, in the order they claim configs (what a watch of all the provider's jobs covers): the plugged-in
    kinds by name, then the built-in ones. Read once per process; ``registered.cache_clear()`` reads again."""
    built_in = {kind.kind for kind in BUILT_IN}
    plugged: dict[str, JobKind] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        kind = point.load()
        where = f"entry point {point.name} = {point.value} ({ENTRY_POINT_GROUP})"
        if not isinstance(kind, JobKind):
            raise TypeError(f"{where}: expected a JobKind(...), got {kind!r}")
        if kind.kind in built_in or kind.kind in plugged:
            taken = ", ".join(sorted(built_in | set(plugged)))
            raise ValueError(f"{where}: the kind {kind.kind!r} is taken (kinds so far: {taken})")
        plugged[kind.kind] = kind
    return (*(plugged[name] for name in sorted(plugged)), *BUILT_IN)


def get(name: str) -> JobKind:
    """The descriptor of a kind, by its ``kind`` name."""
    for kind in BUILT_IN if name in (POD.kind, PYTORCHJOB.kind) else registered():
        if kind.kind == name:
            return kind
    known = ", ".join(sorted(kind.kind for kind in registered()))
    raise ValueError(f"job kind: expected one of {known}, got {name!r}")


def for_config(config: TaskConfig) -> JobKind:
    """The kind that runs a task config."""
    for kind in registered():
        if kind.accepts(config):
            return kind
    raise ValueError(f"task_config: no job kind runs {config!r}")  # pragma: no cover - the built-ins cover all
