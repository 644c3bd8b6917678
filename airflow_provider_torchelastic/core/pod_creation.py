"""Why a controller could not create a job's pods, from its own ``FailedCreatePod`` Warning: a ResourceQuota that
pods of other jobs hold (the controller creates the pods once they finish), a refusal that will not change (Pod
Security, a LimitRange, an admission webhook's denial), or something this module does not know.

The Kubeflow training operator creates a PyTorchJob's pods itself; when the API server refuses one, the refusal
is only an event on the job (``Error creating: pods "…" is forbidden: exceeded quota: …``), retried with a back-off,
and the job shows no pods. The messages are the API server's admission plugins' (ResourceQuota, LimitRanger,
PodSecurity) and webhooks'.

Pure and standard library only: read by the wait core and the wait's decision (kubernetes.status).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any, Final

__all__ = ["FAILED_CREATE_POD", "CreateRefusal", "create_error_of", "create_refusal", "newest_message"]

#: The reason of the training operator's event when a pod's create failed (``control/pod_control.go``).
FAILED_CREATE_POD: Final = "FailedCreatePod"
#: A ResourceQuota's refusal: ``exceeded quota: q, requested: cpu=2, used: cpu=3, limited: cpu=4``.
_QUOTA: Final = re.compile(r"\bexceeded quota\b")
#: Refusals no wait changes: Pod Security admission, a LimitRange's bounds, an admission webhook's denial.
_PERMANENT: Final = re.compile(
    r"\bviolates PodSecurity\b|\b(?:maximum|minimum) \S+ usage per (?:Container|Pod) is\b|\bdenied the request\b"
)


class CreateRefusal(Enum):
    """What a refused pod create means for the wait (:func:`create_refusal`)."""

    QUOTA = "quota"
    PERMANENT = "permanent"
    UNKNOWN = "unknown"


def newest_message(events: Sequence[Mapping[str, Any]], keep: Callable[[Mapping[str, Any]], bool]) -> str:
    """The message of the newest of ``events`` that ``keep`` keeps; empty when there is none (no permission to
    list events, or they expired)."""

    def when(event: Mapping[str, Any]) -> str:
        # RFC 3339 strings of one clock sort as times; eventTime is the newer API's, lastTimestamp the older's.
        return str(event.get("lastTimestamp") or event.get("eventTime") or "")

    kept = [event for event in events if isinstance(event, Mapping) and keep(event)]
    return str(max(kept, key=when).get("message", "")) if kept else ""


def create_error_of(events: Sequence[Mapping[str, Any]]) -> str:
    """The newest ``FailedCreatePod`` Warning's message among a job's ``events``; empty when there is none."""
    return newest_message(events, lambda e: e.get("reason") == FAILED_CREATE_POD and e.get("type") == "Warning")


def create_refusal(message: str) -> CreateRefusal:
    """What a controller's ``Error creating: …`` message says of a wait: quota frees up, the others never do."""
    if _QUOTA.search(message):
        return CreateRefusal.QUOTA
    if _PERMANENT.search(message):
        return CreateRefusal.PERMANENT
    return CreateRefusal.UNKNOWN
