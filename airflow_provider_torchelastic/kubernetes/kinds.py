"""One descriptor per kind of job: everything that differs between a Pod, a PyTorchJob and a future kind.

A kind is where the API keeps it (group, version, plural), how a task config becomes one (its renderer), how to
find its pods, and how to read what it says (its decision, and when it has finished). The rest of the provider
asks the registry instead of testing kind names, so a new kind (Kubeflow Trainer v2's ``TrainJob``) is one module
with its renderer and decision, and one :func:`register` call. Pure: no I/O, no Airflow, no kubernetes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from airflow_provider_torchelastic.core.config import TaskConfig
from airflow_provider_torchelastic.kubernetes import render
from airflow_provider_torchelastic.kubernetes.status import (
    JobRef,
    Snapshot,
    WaitDecision,
    WaitPolicy,
    decide_pod,
    decide_pytorchjob,
    pod_finished,
    pytorchjob_finished,
)

__all__ = ["POD", "PYTORCHJOB", "JobKind", "for_config", "get", "register", "registered", "unregister"]


@dataclass(frozen=True, kw_only=True)
class JobKind:
    """What the provider needs to know about one kind of job."""

    #: The object's ``kind``, e.g. ``PyTorchJob``; also the key of the registry.
    kind: str
    #: API group (``""`` for the core group), version and plural, as in the resource's URL.
    group: str
    version: str
    plural: str
    #: Whether this kind runs a task config; the first registered kind that accepts it renders it.
    accepts: Callable[[TaskConfig], bool]
    #: The job object from the shared render inputs (name, namespace, image, pod options, labels...).
    render: Callable[[render.RenderInputs], dict[str, Any]]
    #: The label selector of the job's pods, given the job's name; ``None`` when the object is its own only pod.
    pod_selector: Callable[[str], str | None]
    #: Where the job stands, from a snapshot of it and its pods.
    decide: Callable[[JobRef, Snapshot, WaitPolicy], WaitDecision]
    #: Whether the job itself says it has ended (whatever the pods still do): a finished job is never deleted by a
    #: late kill, so that ``on_finish_action="keep"`` keeps it.
    is_finished: Callable[[Mapping[str, Any]], bool]
    #: The pod label whose value is the job's name (what :attr:`pod_selector` selects on), so that a watch of all
    #: pods can file each pod under its job without a request; ``None`` when the object is its own only pod.
    pod_owner_label: str | None = None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def is_core(self) -> bool:
        return not self.group


#: The training operator labels every pod of a job with the job's name.
_PYTORCHJOB_POD_LABEL: Final = "training.kubeflow.org/job-name"


def _pytorchjob_pods(name: str) -> str:
    return f"{_PYTORCHJOB_POD_LABEL}={name}"


POD: Final = JobKind(
    kind="Pod",
    group="",
    version="v1",
    plural="pods",
    accepts=lambda config: render.workload_for(config) is render.Workload.POD,
    render=render.render_pod,
    pod_selector=lambda name: None,
    decide=decide_pod,
    is_finished=pod_finished,
)

PYTORCHJOB: Final = JobKind(
    kind="PyTorchJob",
    group=render.PYTORCHJOB_GROUP,
    version=render.PYTORCHJOB_VERSION,
    plural=render.PYTORCHJOB_PLURAL,
    accepts=lambda config: render.workload_for(config) is render.Workload.PYTORCHJOB,
    render=render.render_pytorchjob,
    pod_selector=_pytorchjob_pods,
    decide=decide_pytorchjob,
    is_finished=pytorchjob_finished,
    pod_owner_label=_PYTORCHJOB_POD_LABEL,
)

_REGISTRY: dict[str, JobKind] = {POD.kind: POD, PYTORCHJOB.kind: PYTORCHJOB}


def register(kind: JobKind, *, first: bool = False) -> None:
    """Add (or replace) a kind. ``first=True`` lets it claim configs before the built-in kinds do."""
    if not isinstance(kind, JobKind):
        raise TypeError(f"register: expected a JobKind(...), got {kind!r}")
    others = {name: k for name, k in _REGISTRY.items() if name != kind.kind}
    _REGISTRY.clear()
    _REGISTRY.update({kind.kind: kind, **others} if first else {**others, kind.kind: kind})


def unregister(name: str) -> None:
    if name in (POD.kind, PYTORCHJOB.kind):
        raise ValueError(f"unregister: {name!r} is a built-in kind")
    _REGISTRY.pop(name, None)


def registered() -> tuple[JobKind, ...]:
    """Every registered kind, in the order they claim configs (what a watch of all the provider's jobs covers)."""
    return tuple(_REGISTRY.values())


def get(name: str) -> JobKind:
    """The descriptor of a kind, by its ``kind`` name."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"job kind: expected one of {known}, got {name!r}") from None


def for_config(config: TaskConfig) -> JobKind:
    """The kind that runs a task config."""
    for kind in _REGISTRY.values():
        if kind.accepts(config):
            return kind
    raise ValueError(f"task_config: no job kind runs {config!r}")  # pragma: no cover - the built-ins cover all
