"""Which pods belong to a job: those its controller ownerReferences lead to, by uid. Pure: no I/O, no kind table.

Labels are anyone's to set, so a pod matched by label alone may be another controller's, or a pod someone made to
look like rank 0. A job's pods are the pods it controls: each pod's ``controller: true`` ownerReference, followed
through the kinds of a chain, must end at the job's own uid. A PyTorchJob's chain is one hop (the pod's controller
is the PyTorchJob); a Kubeflow Trainer ``TrainJob``'s would be three (Pod -> Job -> JobSet -> TrainJob), the
intermediate objects given by uid. This stops name collisions and foreign controllers; it does not stop a tenant who
may create pods in the namespace, since ownerReferences are written by whoever creates the pod (the namespace is the
trust boundary).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["controller_reference", "controlled_pods", "is_controlled_by", "uid_of"]


def uid_of(obj: Mapping[str, Any] | None) -> str | None:
    """The object's ``metadata.uid``, or None when it has none (a rendered manifest, a malformed object)."""
    if not isinstance(obj, Mapping):
        return None
    meta = obj.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


def controller_reference(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The object's ownerReference with ``controller: true`` (the API server allows at most one), or None."""
    meta = obj.get("metadata")
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    if not isinstance(refs, list):
        return None
    for ref in refs:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


def is_controlled_by(
    pod: Mapping[str, Any],
    job_uid: str,
    chain: Sequence[str],
    intermediates: Mapping[str, Mapping[str, Any]] | None = None,
) -> bool:
    """Whether ``pod``'s controllers, of the kinds in ``chain`` (nearest first, the job's own kind last), lead to
    the object with uid ``job_uid``. An empty chain: the pod is the job itself (a bare Pod job).

    ``intermediates``: the objects between the pod and the job by uid (a chain longer than one hop needs them); a
    controller that is missing from it, or of another kind than the chain says, makes the pod not the job's.
    """
    if not job_uid:
        return False
    if not chain:
        return uid_of(pod) == job_uid
    obj: Mapping[str, Any] = pod
    for hop, kind in enumerate(chain):
        ref = controller_reference(obj)
        if ref is None or ref.get("kind") != kind or not isinstance(ref.get("uid"), str):
            return False
        if hop == len(chain) - 1:
            return bool(ref["uid"] == job_uid)
        found = (intermediates or {}).get(ref["uid"])
        if found is None:
            return False
        obj = found
    return False  # pragma: no cover - the loop returns at its last hop


def controlled_pods(
    job: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    chain: Sequence[str],
    intermediates: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Mapping[str, Any]]:
    """The pods of ``pods`` (picked by label) that ``job`` controls through ``chain``; none without the job's uid."""
    job_uid = uid_of(job)
    if job_uid is None:
        return []
    return [pod for pod in pods if is_controlled_by(pod, job_uid, chain, intermediates)]
