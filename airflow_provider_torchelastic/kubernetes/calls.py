"""Kubernetes API calls as plain data: what to send and how to read the answer, built by pure functions.

A :class:`Call` is one HTTP request (method, path, query, body) with what its answer means: how the body is read,
what a 404 means, and how much of the body is read at most. The builders below make every call the provider sends;
the two senders in :mod:`~.client` (blocking and ``asyncio``) only send a call and hand the body to it, so the sync
and async clients cannot drift apart, and "what would be sent" can be printed and tested without a network. This is
lightkube's split (``generic_client.prepare_request`` and two thin clients), in our own words.

Reads that take several calls (:func:`snapshot`, :func:`delete_job`) are written once as generators that yield calls
and receive their answers; each sender drives them.

No Kubernetes client is imported here: the senders own the wire.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, NoReturn, TypeVar
from urllib.parse import quote

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.kinds import OwnerQuery
from airflow_provider_torchelastic.kubernetes.pod_template import payload_secret_name
from airflow_provider_torchelastic.kubernetes.requests import ReadEvents, ReadLog
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot
from airflow_provider_torchelastic.kubernetes.workloads import (
    JOB_UID_LABEL,
    WORKLOAD_GROUP,
    WORKLOAD_PLURAL,
    WORKLOAD_VERSION,
)

__all__ = [
    "RAISE",
    "Call",
    "Flow",
    "collection_path",
    "create",
    "delete",
    "delete_job",
    "get",
    "json_object",
    "label_job",
    "list_items",
    "list_kind",
    "list_objects",
    "list_pods",
    "owners",
    "patch_secret",
    "events",
    "read_log",
    "segments",
    "snapshot",
    "watch_objects",
    "workloads",
]

T = TypeVar("T")
JsonDict = dict[str, Any]


class _Raise(enum.Enum):
    RAISE = "raise"


#: :attr:`Call.missing`: a 404 is an error like any other.
RAISE: Final = _Raise.RAISE

JSON: Final = "application/json"
#: Core objects (a Secret, a Pod) take a strategic merge patch, which merges lists such as ``ownerReferences`` by
#: their key; custom resources know no strategy and take a JSON merge patch.
STRATEGIC_MERGE_PATCH: Final = "application/strategic-merge-patch+json"
MERGE_PATCH: Final = "application/merge-patch+json"


@dataclass(frozen=True, kw_only=True)
class Call(Generic[T]):
    """One request to the API server and what its answer means."""

    method: Literal["GET", "POST", "PATCH", "DELETE"]
    #: The URL path, its segments quoted (``/api/v1/namespaces/ml/pods``).
    path: str
    #: Query parameters in the API's own names and spelling (``labelSelector``, ``"true"``).
    query: tuple[tuple[str, str], ...] = ()
    body: Mapping[str, Any] | None = None
    content_type: str = JSON
    #: The answer, read from the response body (a 2xx status's).
    parse: Callable[[bytes], T]
    #: The answer when the API says 404 Not Found, or :data:`RAISE` when that is an error (a ``KubeError``).
    missing: T | Literal[_Raise.RAISE] = RAISE
    #: The most bytes of the body read (None: all of it). A guard beside the API's own ``limitBytes``, which a proxy
    #: in between may not honour.
    read_limit: int | None = None
    #: Seconds the sender waits (a pair: to connect, then between reads); None: the sender's own bound.
    timeout: float | tuple[float, float] | None = None

    def recover(self, error: KubeError) -> T:
        """The answer to a failed request: :attr:`missing` for a 404 when the call has one, else ``error`` again. The
        one place where "not found" gets a meaning."""
        missing = self.missing
        if error.not_found and missing is not RAISE:
            return missing
        raise error


#: A read of several calls: yields each call, receives its answer, returns the result. Driven by each sender.
Flow = Generator[Call[Any], Any, T]


# --- reading answers ------------------------------------------------------------------------------------------------


def json_object(body: bytes) -> JsonDict:
    """The body as a JSON object (what every API answer but a log is)."""
    doc = json.loads(body)
    if not isinstance(doc, dict):
        _invalid(body)
    return doc


def list_items(body: bytes) -> list[JsonDict]:
    """The ``items`` of a list answer."""
    return list(json_object(body).get("items") or [])


def _text(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")


def _existed(body: bytes) -> bool:
    return True


def _nothing(body: bytes) -> None:
    return None


def _invalid(body: bytes) -> NoReturn:
    raise KubeError(0, "InvalidResponse", f"expected a JSON object, got {body[:200]!r}")


# --- where objects live -------------------------------------------------------------------------------------------

#: Core-group objects the provider touches that are no kind of job.
_CORE_RESOURCES: Final = {"Secret": "secrets"}


def segments(*parts: str) -> str:
    # Names come from the API or from validated input; quoted all the same, as the generated clients quote them.
    return "".join(f"/{quote(part, safe='')}" for part in parts)


def group_path(group: str, version: str) -> str:
    """The root of an API group version (``""``: the core group, ``/api/v1``)."""
    return "/api/v1" if not group else f"/apis{segments(group, version)}"


def collection_path(group: str, version: str, plural: str, namespace: str) -> str:
    return group_path(group, version) + segments("namespaces", namespace, plural)


def _kind_collection(kind: str | OwnerQuery, namespace: str) -> tuple[str, str]:
    """The collection path of ``kind`` in ``namespace`` and the content type of a patch there."""
    if isinstance(kind, OwnerQuery):
        group, version, plural = kind.group, kind.version, kind.plural
    elif kind in _CORE_RESOURCES:
        group, version, plural = "", "v1", _CORE_RESOURCES[kind]
    else:
        descriptor = kinds.get(kind)
        group, version, plural = descriptor.group, descriptor.version, descriptor.plural
    return collection_path(group, version, plural, namespace), STRATEGIC_MERGE_PATCH if not group else MERGE_PATCH


def _object_path(kind: str, name: str, namespace: str) -> tuple[str, str]:
    collection, patch_type = _kind_collection(kind, namespace)
    return collection + segments(name), patch_type


def _query(**params: str | int | bool | None) -> tuple[tuple[str, str], ...]:
    """Query parameters, None left out (the server's default), booleans spelled as the API spells them."""
    spelled = {
        key: ("true" if value else "false") if isinstance(value, bool) else value for key, value in params.items()
    }
    return tuple((key, str(value)) for key, value in spelled.items() if value is not None)


# --- the calls ------------------------------------------------------------------------------------------------------


def create(obj: Mapping[str, Any], *, dry_run: bool = False) -> Call[JsonDict]:
    """Create an object; ``dry_run``: validated and admitted as a create would be, and nothing stored."""
    path, _ = _kind_collection(obj["kind"], obj["metadata"]["namespace"])
    return Call(method="POST", path=path, query=_query(dryRun="All" if dry_run else None), body=obj, parse=json_object)


def get(kind: str, name: str, namespace: str) -> Call[JsonDict | None]:
    """One object; None when it does not exist."""
    return Call(method="GET", path=_object_path(kind, name, namespace)[0], parse=json_object, missing=None)


def delete(kind: str, name: str, namespace: str) -> Call[bool]:
    """Delete an object; whether it existed. Background propagation: the API's garbage collector removes what the
    object owns (a job's pods, its payload Secret)."""
    path = _object_path(kind, name, namespace)[0]
    body = {"propagationPolicy": "Background"}
    return Call(method="DELETE", path=path, body=body, parse=_existed, missing=False)


def _patch(kind: str, name: str, namespace: str, body: Mapping[str, Any]) -> Call[None]:
    path, patch_type = _object_path(kind, name, namespace)
    return Call(method="PATCH", path=path, body=body, content_type=patch_type, parse=_nothing)


def patch_secret(name: str, namespace: str, body: Mapping[str, Any]) -> Call[None]:
    return _patch("Secret", name, namespace, body)


def label_job(ref: JobRef, labels: Mapping[str, str]) -> Call[None]:
    """Set labels of the job object (its lease: :func:`~.deadline.lease_labels`); nothing else of it changes."""
    return _patch(ref.kind, ref.name, ref.namespace, {"metadata": {"labels": dict(labels)}})


#: Seconds a followed log may bring nothing before the sender gives up on it (the follower opens it again): a
#: half-open connection must not leave the log unread for good, and a quiet training's stream is cheap to reopen.
FOLLOW_READ_TIMEOUT: Final = 300.0


def follow_log(request: ReadLog, since_time: str | None) -> Call[str]:
    """``request``'s container log as a stream (``follow=true``), with timestamps, from ``since_time`` (RFC 3339,
    whole seconds: what the API takes; None: from the start); each line of the answer is one log line, at most
    ``request.limit_bytes`` long (:meth:`~.client.AsyncKube.stream` cuts a longer one)."""
    query = _query(container=request.container, follow=True, timestamps=True, sinceTime=since_time)
    path = _object_path("Pod", request.pod, request.namespace)[0] + "/log"
    return Call(
        method="GET",
        path=path,
        query=query,
        parse=_text,
        read_limit=request.limit_bytes,
        timeout=(10.0, FOLLOW_READ_TIMEOUT),
    )


def read_log(request: ReadLog) -> Call[str]:
    """A container's log, as :class:`~.requests.ReadLog` asks for it (the server's default for what it leaves out)."""
    query = _query(
        container=request.container,
        sinceTime=request.since_time,
        tailLines=request.tail_lines,
        limitBytes=request.limit_bytes,
        timestamps=request.timestamps or None,
        previous=request.previous or None,
    )
    path = _object_path("Pod", request.pod, request.namespace)[0] + "/log"
    return Call(method="GET", path=path, query=query, parse=_text, read_limit=request.limit_bytes)


def events(request: ReadEvents) -> Call[list[JsonDict]]:
    """The events about one object (a kubelet's "Failed to pull image ...: <why>", a controller's "Error creating:
    <why>")."""
    selector = f"involvedObject.kind={request.kind},involvedObject.name={request.name}"
    path = collection_path("", "v1", "events", request.namespace)
    return Call(method="GET", path=path, query=_query(fieldSelector=selector), parse=list_items)


def list_kind(kind: str | OwnerQuery, namespace: str, **selectors: str | None) -> Call[list[JsonDict]]:
    """Every object of ``kind`` (a job kind, ``Pod``, or the objects between a job and its pods) in ``namespace``
    that ``selectors`` (``label_selector``, ``field_selector``) select: a read of the current state."""
    path = _kind_collection(kind, namespace)[0]
    return Call(method="GET", path=path, query=_selectors(**selectors), parse=list_items)


def list_pods(namespace: str, label_selector: str) -> Call[list[JsonDict]]:
    return list_kind("Pod", namespace, label_selector=label_selector)


def owners(query: OwnerQuery, ref: JobRef) -> Call[list[JsonDict]]:
    """The objects ``query`` selects for job ``ref`` (a TrainJob's JobSet, its Jobs)."""
    selectors = {"label_selector": query.label_selector(ref.name), "field_selector": query.field_selector(ref.name)}
    return list_kind(query, ref.namespace, **selectors)


def list_objects(kind: str | OwnerQuery, namespace: str, **selectors: str | None) -> Call[JsonDict]:
    """One list of ``kind`` (items and the list's ``metadata.resourceVersion``), served from the watch cache.

    ``resourceVersion=0`` lets the apiserver answer from its cache instead of a quorum read of etcd; the watch that
    follows starts from the list's version, so nothing between the two is missed.
    """
    path = _kind_collection(kind, namespace)[0]
    return Call(method="GET", path=path, query=(*_selectors(**selectors), ("resourceVersion", "0")), parse=json_object)


def watch_objects(
    kind: str | OwnerQuery, namespace: str, resource_version: str, timeout_seconds: int, **selectors: str | None
) -> Call[JsonDict]:
    """One watch of ``kind`` from ``resource_version``, with bookmarks, which the server ends after
    ``timeout_seconds``; each line of the answer is one event (:attr:`Call.parse` reads one line)."""
    query = _query(
        watch=True, resourceVersion=resource_version, allowWatchBookmarks=True, timeoutSeconds=timeout_seconds
    )
    path = _kind_collection(kind, namespace)[0]
    # A read timeout well past the server's own end of the watch: only a dead connection trips it.
    timeout = (10.0, float(timeout_seconds + 30))
    return Call(method="GET", path=path, query=(*_selectors(**selectors), *query), parse=json_object, timeout=timeout)


def workloads(namespace: str, job_uid: str) -> Call[list[JsonDict]]:
    """The Kueue Workloads of the job whose uid is ``job_uid`` (:mod:`~.queue_limits`)."""
    path = collection_path(WORKLOAD_GROUP, WORKLOAD_VERSION, WORKLOAD_PLURAL, namespace)
    return Call(method="GET", path=path, query=_query(labelSelector=f"{JOB_UID_LABEL}={job_uid}"), parse=list_items)


def _selectors(*, label_selector: str | None = None, field_selector: str | None = None) -> tuple[tuple[str, str], ...]:
    return _query(labelSelector=label_selector, fieldSelector=field_selector)


# --- reads of several calls -----------------------------------------------------------------------------------------


def snapshot(ref: JobRef) -> Flow[Snapshot]:
    """The job and the pods it controls, as the wait core sees them."""
    job: JsonDict | None = yield get(ref.kind, ref.name, ref.namespace)
    kind = kinds.get(ref.kind)
    pods_of = kind.pods_of(ref.name)
    selector = pods_of.selector
    pods: list[JsonDict] = (yield list_pods(ref.namespace, selector)) if selector is not None and job else []
    found: list[JsonDict] = []
    for query in kind.intermediates if pods else ():
        found += yield owners(query, ref)
    # The label found them; only the job's controller ownerReference makes them the job's (the kind's one answer).
    return Snapshot(job=job, pods=pods_of.pick(job, pods, found) if selector is not None else [], now=time.time())


def delete_job(ref: JobRef) -> Flow[bool]:
    """Delete the job and its payload Secret; whether the job existed."""
    existed: bool = yield delete(ref.kind, ref.name, ref.namespace)
    # The Secret is owned by the job and garbage-collected with it; deleting it too costs one call and leaves nothing
    # behind where no garbage collector runs (or when the job was never created).
    yield delete("Secret", payload_secret_name(ref.name), ref.namespace)
    return existed
