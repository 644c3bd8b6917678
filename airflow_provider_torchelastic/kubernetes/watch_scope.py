"""What a stream of :mod:`~.watch` lists and watches: the triggerer's shared stream, every object of the provider in
a namespace; the worker's private stream (:mod:`~.worker_wait`), the objects of one job.

Each :class:`Watched` is one list+watch, filed in the stream's cache under its :attr:`~Watched.key`, so that the
cache answers "the job, its pods and the objects between them" the same way for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from airflow_provider_torchelastic.core.naming import MANAGED_SELECTOR
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.kinds import OwnerQuery
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef

__all__ = ["SELECTOR", "Watched", "intermediate_key", "job_scope", "namespace_scope"]

#: Every object the provider creates carries this label; the shared watch sees nothing else.
SELECTOR: Final = MANAGED_SELECTOR


@dataclass(frozen=True, kw_only=True)
class Watched:
    """One list+watch of a stream."""

    #: The cache's name for these objects: a job kind, ``Pod``, or :func:`intermediate_key` of an :class:`OwnerQuery`.
    key: str
    #: What the API is asked for: a job kind or ``Pod``, or the objects between a job and its pods.
    resource: str | OwnerQuery
    label_selector: str | None = SELECTOR
    field_selector: str | None = None


def intermediate_key(query: OwnerQuery) -> str:
    """The cache's name for the objects ``query`` reads (``jobsets.jobset.x-k8s.io``): never a kind's name."""
    return f"{query.plural}.{query.group}"


def namespace_scope() -> tuple[Watched, ...]:
    """The triggerer's shared stream: every job kind and every pod of the provider in the namespace.

    The Pod kind's objects double as the pods of every other kind: one pod watch serves all. A kind with objects
    between its pods and itself (a TrainJob's JobSet and Jobs) is not watched: its pods' owners are not in this
    cache, so its triggers poll on their own (:meth:`~.watch.JobCache.watches` says no).
    """
    names = {"Pod"} | {k.kind for k in kinds.registered() if not k.intermediates}
    return tuple(Watched(key=name, resource=name) for name in sorted(names))


def job_scope(ref: JobRef) -> tuple[Watched, ...]:
    """One job's objects, as a poll reads them: the job by name, its pods by the kind's pod selector, and (a
    TrainJob's JobSet and Jobs) the objects between them by the kind's own queries. No label of ours is needed: a
    job re-attached to is watched like one just created."""
    kind = kinds.get(ref.kind)
    scope = [Watched(key=ref.kind, resource=ref.kind, label_selector=None, field_selector=f"metadata.name={ref.name}")]
    pods = kind.pods_of(ref.name).selector
    if pods is not None:  # else the job is its own only pod
        scope.append(Watched(key="Pod", resource="Pod", label_selector=pods))
    for query in kind.intermediates:
        selectors = {"label_selector": query.label_selector(ref.name), "field_selector": query.field_selector(ref.name)}
        scope.append(Watched(key=intermediate_key(query), resource=query, **selectors))
    return tuple(scope)
