"""Why an image pull failed, from the container runtime's own words: a registry that will not change its mind
(the image does not exist, the credentials are refused, the name is invalid) or one that may answer later (429,
5xx, a timeout, a reset connection).

The words are containerd 1.6's, as the kubelet passes them on in a container's ``ErrImagePull`` message and in its
``Failed to pull image "…": …`` event, e.g. ``… pulling from host H failed with status code [manifests T]: 429 Too
Many Requests``, ``… read: connection reset by peer``, ``… : not found``. A kubelet's ``ImagePullBackOff`` message is
a bare ``Back-off pulling image "…"``: the cause is then only in the newest of those events (:func:`pull_error_of`).

Pure and standard library only: read by the wait's decision (kubernetes.status) and the wait core.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from airflow_provider_torchelastic.core.pod_creation import newest_message

__all__ = [
    "BACK_OFF",
    "PULL_REASONS",
    "PullError",
    "PullFailure",
    "backed_off_images",
    "classify_pull",
    "pull_error_of",
    "scheduled_at",
]

#: Container waiting reasons of an image that could not be pulled.
PULL_REASONS: Final = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
#: The waiting reason between two pulls, whose message does not say why the last one failed.
BACK_OFF: Final = "ImagePullBackOff"
#: The reasons that say it all themselves: no registry was asked, and asking again changes nothing.
_PERMANENT_REASONS: Final = frozenset({"InvalidImageName", "ErrImageNeverPull"})
#: How the kubelet's event about a failed pull begins (its reason is a generic ``Failed``).
_PULL_FAILED: Final = "Failed to pull image"


class PullError(str, Enum):
    #: The registry will say the same again: fail at once.
    PERMANENT = "permanent"
    #: The registry (or the way to it) may answer later: the kubelet's back-off pulls again, up to image_pull_timeout.
    TRANSIENT = "transient"
    #: Nothing says which (only the back-off, or words not known here): fail after pending_grace_seconds.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class PullFailure:
    kind: PullError
    #: The words that decided (``429 Too Many Requests``, ``connection reset by peer``, ``not found``); empty when
    #: nothing did.
    what: str = ""


# Checked first: a throttled or failing registry is transient whatever else the message says (Docker Hub's rate
# limit asks to "authenticate", which is no refusal). Go's net/http and containerd's resolver wordings.
_TRANSIENT: Final = re.compile(
    r"429 Too Many Requests|500 Internal Server Error|502 Bad Gateway|503 Service Unavailable"
    r"|504 Gateway Time-?out|(?<=\]: )(?:429|5\d\d)(?: [A-Z][A-Za-z-]*)*|toomanyrequests"
    r"|connection reset by peer|broken pipe|connection refused|no route to host"
    r"|i/o timeout|TLS handshake timeout|timeout awaiting response headers|context deadline exceeded"
    r"|Client\.Timeout exceeded|unexpected EOF|server misbehaving|temporary failure in name resolution"
    r"|code = (?:Unavailable|DeadlineExceeded|ResourceExhausted)"
    r"|:\s*EOF\b",
    re.IGNORECASE,
)
_PERMANENT: Final = re.compile(
    r"\bnot found\b|manifest unknown|name unknown|repository does not exist|pull access denied"
    r"|\bunauthorized\b|\b40[13]\s+[A-Z][a-z]+|\bdenied\b|insufficient_scope|authorization failed"
    r"|no basic auth credentials|invalid reference format|no match for platform|no such host"
    r"|code = (?:NotFound|InvalidArgument|PermissionDenied|Unauthenticated)",
    re.IGNORECASE,
)


def classify_pull(reason: str, message: str) -> PullFailure:
    """What a container waiting with ``reason`` says of its image, from ``message`` (its own, or the newest pull
    error of its events when its own is the back-off's)."""
    if reason in _PERMANENT_REASONS:
        return PullFailure(PullError.PERMANENT, reason)
    for kind, pattern in ((PullError.TRANSIENT, _TRANSIENT), (PullError.PERMANENT, _PERMANENT)):
        found = pattern.search(message)
        if found is not None:
            return PullFailure(kind, found.group(0).strip(": "))
    return PullFailure(PullError.UNKNOWN)


def pull_error_of(events: Sequence[Mapping[str, Any]], image: str | None = None) -> str:
    """The newest ``Failed to pull image`` message among a pod's ``events`` (of ``image``, when given); empty when
    there is none (no permission to list events, or they expired)."""

    prefix = f'{_PULL_FAILED} "{image}"' if image else _PULL_FAILED
    return newest_message(events, lambda event: str(event.get("message", "")).startswith(prefix))


def backed_off_images(pods: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{image: pod}`` for each image some pending pod waits for in ``ImagePullBackOff`` (the first such pod): whose
    events say why its last pull failed. One pod per image: its pull error is every pod's that pulls it."""
    found: dict[str, str] = {}
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") not in (None, "Pending"):
            continue
        for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (container.get("state") or {}).get("waiting") or {}
            image = str(container.get("image") or "")
            if waiting.get("reason") == BACK_OFF and image not in found:
                found[image] = str((pod.get("metadata") or {}).get("name", "?"))
    return found


def scheduled_at(pod: Mapping[str, Any]) -> str | None:
    """When the pod got its node, as the API wrote it (RFC 3339): its pulls started then. None while it has none."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if (
            isinstance(condition, Mapping)
            and condition.get("type") == "PodScheduled"
            and condition.get("status") == "True"
        ):
            time = condition.get("lastTransitionTime")
            return time if isinstance(time, str) else None
    return None
