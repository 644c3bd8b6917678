"""The kinds of job: a static table of the built-in kinds (a Pod, a PyTorchJob, a TrainJob) plus the kinds other
packages plug in through the ``airflow_provider_torchelastic.job_kinds`` entry-point group.

Everything that differs between kinds is in the kind's module and its :class:`JobKind` descriptor (API path,
renderer, pods, decisions, owner reference, the UI's replica count and its rendered-template view); the rest of the
provider asks this table instead of testing kind names, so a new kind (Kubeflow Trainer v2's ``TrainJob``) is one
module and one table entry, or one entry point in another package. Pure: no I/O, no Airflow, no kubernetes.

Which kind runs a task is :func:`choose`'s alone: a plugged-in kind that accepts the config, else a Pod for one node,
else what ``job_kind`` says (``pytorchjob``, ``trainjob``, or ``auto``: a TrainJob where the cluster serves it and the
task fits one, since PyTorchJob v1 is in maintenance; else a PyTorchJob). :func:`fixed_choice` is its part that needs
no cluster (the parse-time check), and :func:`for_config` is the choice under ``pytorchjob``.

The pods of a job are the kind's answer too (:meth:`JobKind.pods_of`): the selector a poll sends, and the same choice
over pods at hand (the shared watch's cache, the UI's pod list).

An entry point names a :class:`JobKind` object (``fakejob = my_package.kinds:FAKE_JOB``). Plugged-in kinds come
before the built-in ones, so that one that accepts a config claims it; a plugged-in kind may not reuse a built-in
kind's name. The entry points are read once per process, on first use (never at import: DAG files import this).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Final

from airflow_provider_torchelastic.core import choices
from airflow_provider_torchelastic.core.config import TaskConfig
from airflow_provider_torchelastic.kubernetes.kinds import pod, pytorchjob, trainjob
from airflow_provider_torchelastic.kubernetes.kinds.descriptor import DENIED, NOT_SERVED, JobKind, OwnerQuery, PodsOf

__all__ = [
    "BUILT_IN",
    "DENIED",
    "ENTRY_POINT_GROUP",
    "JOB_KIND_CHOICES",
    "NOT_SERVED",
    "POD",
    "PYTORCHJOB",
    "TRAINJOB",
    "Choice",
    "JobKind",
    "OwnerQuery",
    "PodsOf",
    "choose",
    "fixed_choice",
    "for_config",
    "get",
    "owner_of_pod",
    "registered",
]

POD: Final = pod.KIND
PYTORCHJOB: Final = pytorchjob.KIND
TRAINJOB: Final = trainjob.KIND
#: In the order they claim configs: a PyTorchJob runs every multi-node config, so :func:`for_config` never picks a
#: TrainJob; only :func:`choose` does.
BUILT_IN: Final = (POD, PYTORCHJOB, TRAINJOB)
ENTRY_POINT_GROUP: Final = "airflow_provider_torchelastic.job_kinds"
#: What ``job_kind`` (the operator's argument, ``[torch_elastic] job_kind``) may say (core/choices.py).
JOB_KIND_CHOICES: Final = choices.JOB_KIND_CHOICES
_BUILT_IN_NAMES: Final = frozenset(kind.kind for kind in BUILT_IN)


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


def owner_of_pod(pod: Mapping[str, Any]) -> tuple[JobKind, str] | None:
    """The kind and name of the job whose pods ``pod``'s labels say it is among (:meth:`JobKind.owner_of`), or None:
    a pod that no kind owning pods claims (a bare Pod job is its own)."""
    for kind in registered():
        owner = kind.owner_of(pod)
        if owner is not None:
            return kind, owner
    return None


def get(name: str) -> JobKind:
    """The descriptor of a kind, by its ``kind`` name."""
    for kind in BUILT_IN if name in _BUILT_IN_NAMES else registered():
        if kind.kind == name:
            return kind
    known = ", ".join(sorted(kind.kind for kind in registered()))
    raise ValueError(f"job kind: expected one of {known}, got {name!r}")


def for_config(config: TaskConfig) -> JobKind:
    """The kind that runs a task config without a cluster to ask: :func:`choose` under ``job_kind='pytorchjob'``
    (a plugged-in kind that accepts it, a Pod for one node, else a PyTorchJob)."""
    return choose(config, "pytorchjob")[0]


#: A kind and why it was chosen (for the task log).
Choice = tuple[JobKind, str]


def fixed_choice(config: TaskConfig, job_kind: str) -> Choice | None:
    """The kind that runs ``config`` when it does not depend on the cluster, or None (``auto`` with several nodes).

    A ``ValueError`` naming the field and the value for a ``job_kind`` that is not one of
    :data:`JOB_KIND_CHOICES`, or for a config the kind it names cannot run: raised while the DAG file is parsed when
    the kind is known then, and at submit otherwise.
    """
    if job_kind not in JOB_KIND_CHOICES:
        expected = ", ".join(map(repr, JOB_KIND_CHOICES))
        raise ValueError(
            f"job_kind: expected one of {expected} (or None for [torch_elastic] job_kind), got {job_kind!r}"
        )
    for kind in registered():
        if kind.kind not in _BUILT_IN_NAMES and kind.accepts(config):
            return kind, f"the plugged-in kind {kind.kind} runs this task config"
    if POD.accepts(config):
        return POD, "one node runs as a Pod"
    if job_kind == "pytorchjob":
        return PYTORCHJOB, "job_kind='pytorchjob'"
    if job_kind == "trainjob":
        trainjob.check_trainjob_config(config)
        return TRAINJOB, "job_kind='trainjob'"
    if not TRAINJOB.accepts(config):
        return PYTORCHJOB, (
            "job_kind='auto': only a PyTorchJob runs this task config (a TrainJob runs a fixed number of nodes, with "
            "no restart policy of its own)"
        )
    return None


def choose(config: TaskConfig, job_kind: str, served: Callable[[JobKind], bool] | None = None) -> Choice:
    """The kind that runs ``config`` under ``job_kind``, asking ``served(kind)`` (API discovery) only for ``auto``:
    the one choice of a kind, which the submit, the dry run and the render make (the parse-time check makes its part
    that needs no cluster, :func:`fixed_choice`).

    ``auto`` picks a TrainJob where the cluster serves it (Kubeflow Trainer v2; PyTorchJob v1 is in maintenance),
    else a PyTorchJob. Neither served: a PyTorchJob, whose submit says what to install. ``served`` None (a dry run,
    with no cluster to ask): a PyTorchJob.
    """
    fixed = fixed_choice(config, job_kind)
    if fixed is not None:
        return fixed
    if served is None:
        return PYTORCHJOB, "job_kind='auto' without a cluster to ask: a PyTorchJob"
    if served(TRAINJOB):
        return TRAINJOB, "job_kind='auto': the cluster serves TrainJob (Kubeflow Trainer v2), and this task fits one"
    if served(PYTORCHJOB):
        return PYTORCHJOB, "job_kind='auto': the cluster serves PyTorchJob, not TrainJob"
    return PYTORCHJOB, "job_kind='auto': the cluster serves neither PyTorchJob nor TrainJob"
