"""Thin Kubernetes I/O: create, get, list, read logs, delete; sync and async twins that decide nothing.

Both clients are :class:`~wait.JobSource` implementations (a direct poll of the API); which API path a kind of job
lives at comes from its descriptor (:mod:`kinds`). The UI plugin's reads (its job and pod lists, log tails) go
through :class:`SyncKube` too.

Objects travel as the API's own JSON dicts (what :mod:`render` produces and :mod:`status` reads). API errors are
translated once, here, into :class:`KubeError` carrying the HTTP status, the Status reason and the server's
``Retry-After``, chained ``from`` the client's exception; callers test ``status``/``reason``, never message text.

The kubernetes clients are imported lazily: importing this module must stay cheap for the DAG parse path.
"""

from __future__ import annotations

import email.utils
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final

from airflow_provider_torchelastic.core.naming import TRAINING_CONTAINER
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.kinds import OwnerQuery
from airflow_provider_torchelastic.kubernetes.pod_template import payload_secret_name
from airflow_provider_torchelastic.kubernetes.retry import LONGEST_WAIT as LONGEST_WAIT
from airflow_provider_torchelastic.kubernetes.retry import MAX_RECOVERABLE_FAILURES as MAX_RECOVERABLE_FAILURES
from airflow_provider_torchelastic.kubernetes.retry import retry_async, retry_sync
from airflow_provider_torchelastic.kubernetes.status import JobRef, Snapshot
from airflow_provider_torchelastic.kubernetes.workloads import workloads_call

__all__ = ["AsyncKube", "KubeError", "SyncKube", "retry_async", "retry_sync", "sync_kube_from_config"]

_REQUEST_TIMEOUT: Final = 60  # seconds: a half-open connection must not hang a poll forever


def _from_api_exception(exc: Any) -> KubeError:
    """The one translation of a client's ``ApiException`` (sync or async) into :class:`KubeError`."""
    status = int(getattr(exc, "status", 0) or 0)
    body = getattr(exc, "body", None)
    reason, message = str(getattr(exc, "reason", "") or ""), ""
    details: dict[str, Any] | None = None
    if body:
        try:
            doc = json.loads(body)
            reason, message = doc.get("reason", reason) or reason, str(doc.get("message", ""))
            found = doc.get("details")
            details = dict(found) if isinstance(found, dict) else None
        except (ValueError, TypeError, AttributeError):
            message = str(body)[:500]
    retry_after = _retry_after_seconds(getattr(exc, "headers", None), time.time())
    return KubeError(status, reason, message, details=details, retry_after=retry_after)


def _retry_after_seconds(headers: Any, now: float) -> float | None:
    """The ``Retry-After`` header in seconds from ``now``: delay-seconds (what the API server sends) or an HTTP-date
    (what a proxy in front of it may send); None when absent or unreadable, 0 for a moment already past.

    ``headers`` is whatever mapping the client keeps them in (urllib3's ``HTTPHeaderDict``, aiohttp's
    ``CIMultiDictProxy``, a plain dict); the name is matched without regard to case, as HTTP says.
    """
    found = (str(value) for key, value in (headers or {}).items() if str(key).lower() == "retry-after")
    value = next(found, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - now
        except (TypeError, ValueError, IndexError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


# --- which API call does what: built once, without I/O, for both clients ------------------------------------------

_Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
# Core-group kinds the provider creates; any other kind is a custom resource addressed by its descriptor.
_CORE_VERBS: Final = {
    "Pod": ("create_namespaced_pod", "read_namespaced_pod", "delete_namespaced_pod", "patch_namespaced_pod"),
    "Secret": (
        "create_namespaced_secret",
        "read_namespaced_secret",
        "delete_namespaced_secret",
        "patch_namespaced_secret",
    ),
}


def _custom_path(kind: str, namespace: str) -> tuple[str, str, str, str]:
    descriptor = kinds.get(kind)
    return descriptor.group, descriptor.version, namespace, descriptor.plural


def _create_call(core: Any, custom: Any, obj: Mapping[str, Any]) -> _Call:
    namespace, kind = obj["metadata"]["namespace"], obj["kind"]
    if kind in _CORE_VERBS:
        return getattr(core, _CORE_VERBS[kind][0]), (namespace, obj), {}
    return custom.create_namespaced_custom_object, (*_custom_path(kind, namespace), obj), {}


def _get_call(core: Any, custom: Any, kind: str, name: str, namespace: str) -> _Call:
    if kind in _CORE_VERBS:
        return getattr(core, _CORE_VERBS[kind][1]), (name, namespace), {}
    return custom.get_namespaced_custom_object, (*_custom_path(kind, namespace), name), {}


def _delete_call(core: Any, custom: Any, kind: str, name: str, namespace: str) -> _Call:
    # Background propagation: the API's garbage collector removes what the job owns (pods, the payload Secret).
    body = {"propagationPolicy": "Background"}
    if kind in _CORE_VERBS:
        return getattr(core, _CORE_VERBS[kind][2]), (name, namespace), {"body": body}
    return custom.delete_namespaced_custom_object, (*_custom_path(kind, namespace), name), {"body": body}


def _label_patch_call(core: Any, custom: Any, ref: JobRef, labels: Mapping[str, str]) -> _Call:
    """A merge patch of the job object's labels (the lease, :mod:`~.sweep`); nothing else of it changes."""
    body = {"metadata": {"labels": dict(labels)}}
    if ref.kind in _CORE_VERBS:
        return getattr(core, _CORE_VERBS[ref.kind][3]), (ref.name, ref.namespace, body), {}
    return custom.patch_namespaced_custom_object, (*_custom_path(ref.kind, ref.namespace), ref.name, body), {}


def _log_call(
    core: Any,
    pod: str,
    namespace: str,
    since_seconds: int | None,
    tail_lines: int | None = None,
    *,
    container: str = TRAINING_CONTAINER,
    limit_bytes: int | None = None,
    timestamps: bool = True,
    previous: bool = False,
) -> _Call:
    # None leaves a parameter to the server's default (for timestamps and previous: without).
    options = {"since_seconds": since_seconds, "tail_lines": tail_lines, "limit_bytes": limit_bytes}
    flags = {"timestamps": timestamps or None, "previous": previous or None}
    kwargs = {name: value for name, value in {**options, **flags}.items() if value is not None}
    return core.read_namespaced_pod_log, (pod, namespace), {"container": container, **kwargs}


def _events_call(core: Any, pod: str, namespace: str) -> _Call:
    """The events about one pod (the kubelet's "Failed to pull image ...: <why>")."""
    selector = f"involvedObject.kind=Pod,involvedObject.name={pod}"
    return core.list_namespaced_event, (namespace,), {"field_selector": selector}


def _owners_call(custom: Any, query: OwnerQuery, name: str, namespace: str) -> _Call:
    """List the objects ``query`` selects for job ``name``."""
    selectors = {"label_selector": query.label_selector(name), "field_selector": query.field_selector(name)}
    return _collection_call(None, custom, query, namespace, **selectors)


def _collection_call(core: Any, custom: Any, kind: str | OwnerQuery, namespace: str, **kwargs: Any) -> _Call:
    """List (or, with ``watch=True``, watch) every object of ``kind`` (a job kind, ``Pod``, or the objects between a
    job and its pods) in ``namespace``; a keyword that is None is left out."""
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    if isinstance(kind, OwnerQuery):  # the path is the same for built-in groups (``batch``)
        return custom.list_namespaced_custom_object, (kind.group, kind.version, namespace, kind.plural), kwargs
    if kind == "Pod":
        return core.list_namespaced_pod, (namespace,), kwargs
    return custom.list_namespaced_custom_object, _custom_path(kind, namespace), kwargs


def _list_pods_call(core: Any, namespace: str, label_selector: str) -> _Call:
    return core.list_namespaced_pod, (namespace,), {"label_selector": label_selector}


def sync_kube_from_config(kubeconfig: str | None = None, context: str | None = None) -> SyncKube:
    """A client outside Airflow (the sweep's command line): ``kubeconfig``, else in-cluster, else ~/.kube/config."""
    from kubernetes import client, config

    if kubeconfig is None and context is None:
        try:
            config.load_incluster_config()
            return SyncKube(client.ApiClient())
        except config.ConfigException:
            pass
    return SyncKube(config.new_client_from_config(config_file=kubeconfig, context=context))


class SyncKube:
    """Blocking calls through the ``kubernetes`` client of a cncf.kubernetes ``KubernetesHook``.

    ``request_timeout`` (seconds) bounds each call: the UI's page views wait less than a task does.
    """

    def __init__(self, api_client: Any, *, request_timeout: float = _REQUEST_TIMEOUT) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._api_client = api_client
        self._request_timeout = request_timeout

    def _body(self, call: _Call) -> bytes:
        """The raw response body. Raw, because kubernetes 36.0.x returns the *repr* of bytes for logs otherwise
        (kubernetes-client #2596), and JSON dicts are what render and status work with anyway."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        fn, args, kwargs = call
        try:
            response = fn(*args, _request_timeout=self._request_timeout, _preload_content=False, **kwargs)
            return bytes(response.data)
        except ApiException as e:
            raise _from_api_exception(e) from e
        except (HTTPError, OSError) as e:
            raise KubeError(0, type(e).__name__, str(e)) from e

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return _json(self._body(_create_call(self._core, self._custom, obj)))

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return _json(self._body(_get_call(self._core, self._custom, kind, name, namespace)))
        except KubeError as e:
            if e.not_found:
                return None
            raise

    def patch_secret(self, name: str, namespace: str, body: Mapping[str, Any]) -> None:
        # The sync client sends a dict body as a JSON merge patch.
        self._body((self._core.patch_namespaced_secret, (name, namespace, body), {}))

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        doc = _json(self._body(_list_pods_call(self._core, namespace, label_selector)))
        return list(doc.get("items", []))

    def list_kind(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Every object of ``kind`` in ``namespace`` that ``label_selector`` selects. A read of the current state
        (no ``resourceVersion``), unlike :meth:`AsyncKube.list_objects`, which starts a watch from the cache."""
        call = _collection_call(self._core, self._custom, kind, namespace, label_selector=label_selector)
        return list(_json(self._body(call)).get("items") or [])

    def snapshot(self, ref: JobRef) -> Snapshot:
        job = self.get(ref.kind, ref.name, ref.namespace)
        kind = kinds.get(ref.kind)
        selector = kind.pod_selector(ref.name)
        pods = self.list_pods(ref.namespace, selector) if selector is not None and job else []
        owners = [owner for query in (kind.intermediates if pods else ()) for owner in self.owners(query, ref)]
        # The label found them; only the job's controller ownerReference makes them the job's.
        return Snapshot(job=job, pods=kind.controlled_pods(job, pods, owners), now=time.time())

    def owners(self, query: OwnerQuery, ref: JobRef) -> list[dict[str, Any]]:
        """The objects between job ``ref`` and its pods that ``query`` selects (a TrainJob's JobSet, its Jobs)."""
        return list(_json(self._body(_owners_call(self._custom, query, ref.name, ref.namespace))).get("items") or [])

    def read_log(
        self,
        pod: str,
        namespace: str,
        since_seconds: int | None,
        tail_lines: int | None = None,
        *,
        container: str = TRAINING_CONTAINER,
        limit_bytes: int | None = None,
        timestamps: bool = True,
        previous: bool = False,
    ) -> str:
        """The training container's log (the kind's ``log_container``); ``limit_bytes`` bounds what one read may
        cost, ``timestamps=False`` leaves the lines as the container wrote them (what a person reads), and
        ``previous=True`` reads the container that ran before its last restart."""
        call = _log_call(
            self._core,
            pod,
            namespace,
            since_seconds,
            tail_lines,
            container=container,
            limit_bytes=limit_bytes,
            timestamps=timestamps,
            previous=previous,
        )
        return self._body(call).decode("utf-8", errors="replace")

    def delete(self, kind: str, name: str, namespace: str) -> bool:
        """Delete an object (and, through garbage collection, what it owns). False if it was gone already."""
        try:
            self._body(_delete_call(self._core, self._custom, kind, name, namespace))
        except KubeError as e:
            if e.not_found:
                return False
            raise
        return True

    def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None:
        """Set labels of the job object (its lease: :func:`~.deadline.lease_labels`)."""
        self._body(_label_patch_call(self._core, self._custom, ref, labels))

    def pod_events(self, pod: str, namespace: str) -> list[dict[str, Any]]:
        """The events about ``pod``."""
        return list(_json(self._body(_events_call(self._core, pod, namespace))).get("items") or [])

    def delete_job(self, ref: JobRef) -> bool:
        """Delete the job and its payload Secret; whether the job existed."""
        existed = self.delete(ref.kind, ref.name, ref.namespace)
        # The Secret is owned by the job and garbage-collected with it; deleting it too costs one call and leaves
        # nothing behind where no garbage collector runs (or when the job was never created).
        self.delete("Secret", payload_secret_name(ref.name), ref.namespace)
        return existed

    def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return list(_json(self._body(workloads_call(self._custom, namespace, job_uid))).get("items") or [])

    # --- what the preflight asks: discovery, access reviews, the version, one custom object ----------------------

    def served_resources(self, group: str, version: str) -> list[str] | None:
        """The resource names the API serves in ``group``/``version`` (``""``: the core group), subresources
        included (``pods/log``); ``None`` when the group version is not served at all."""
        if group:
            call: _Call = (self._custom.get_api_resources, (group, version), {})
        elif version == "v1":
            call = (self._core.get_api_resources, (), {})
        else:  # pragma: no cover - the core group has one version
            raise ValueError(f"version: the core group serves v1, got {version!r}")
        try:
            doc = _json(self._body(call))
        except KubeError as e:
            if e.not_found:
                return None
            raise
        return [str(resource.get("name", "")) for resource in doc.get("resources", [])]

    def access_review(self, verb: str, resource: str, group: str, namespace: str, subresource: str = "") -> bool:
        """Whether this identity may ``verb`` the ``resource`` (``subresource``) of ``group`` in ``namespace``: one
        SelfSubjectAccessReview (authorization.k8s.io/v1), which any authenticated identity may create."""
        from kubernetes import client

        attributes = {"verb": verb, "resource": resource, "group": group, "namespace": namespace}
        if subresource:
            attributes["subresource"] = subresource
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        api = client.AuthorizationV1Api(self._api_client)
        doc = _json(self._body((api.create_self_subject_access_review, (body,), {})))
        return bool(doc.get("status", {}).get("allowed", False))

    def server_version(self) -> dict[str, Any]:
        """``/version``: ``gitVersion``, ``major``, ``minor``..."""
        from kubernetes import client

        return _json(self._body((client.VersionApi(self._api_client).get_code, (), {})))

    def get_crd(self, name: str) -> dict[str, Any] | None:
        """The CustomResourceDefinition ``name`` (``plural.group``); None when it is not installed."""
        from kubernetes import client

        api = client.ApiextensionsV1Api(self._api_client)
        try:
            return _json(self._body((api.read_custom_resource_definition, (name,), {})))
        except KubeError as e:
            if e.not_found:
                return None
            raise

    def get_custom(self, group: str, version: str, plural: str, name: str, namespace: str) -> dict[str, Any] | None:
        """One namespaced custom object that is no job kind (a Kueue LocalQueue); None when it does not exist."""
        try:
            call: _Call = (self._custom.get_namespaced_custom_object, (group, version, namespace, plural, name), {})
            return _json(self._body(call))
        except KubeError as e:
            if e.not_found:
                return None
            raise


class AsyncKube:
    """The same calls through ``kubernetes_asyncio`` (inside ``async with AsyncKubernetesHook.get_conn()``)."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes_asyncio import client

        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    async def _body(self, call: _Call) -> bytes:
        """The raw response body. kubernetes_asyncio checks the HTTP status only when it preloads the content, so
        a 404, 403 or 503 would otherwise come back as a Status document in place of the object: check it here."""
        from aiohttp import ClientError
        from kubernetes_asyncio.client.exceptions import ApiException

        fn, args, kwargs = call
        try:
            response = await fn(*args, _request_timeout=_REQUEST_TIMEOUT, _preload_content=False, **kwargs)
            body = await response.read()
        except ApiException as e:
            raise _from_api_exception(e) from e
        except (TimeoutError, ClientError, OSError) as e:
            raise KubeError(0, type(e).__name__, str(e)) from e
        if not 200 <= response.status <= 299:
            error = ApiException(status=response.status, reason=response.reason)
            error.body, error.headers = body.decode("utf-8", errors="replace"), response.headers
            raise _from_api_exception(error) from error
        return bytes(body)

    async def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return _json(await self._body(_get_call(self._core, self._custom, kind, name, namespace)))
        except KubeError as e:
            if e.not_found:
                return None
            raise

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        doc = _json(await self._body(_list_pods_call(self._core, namespace, label_selector)))
        return list(doc.get("items", []))

    async def pod_events(self, pod: str, namespace: str) -> list[dict[str, Any]]:
        """The events about ``pod``."""
        return list(_json(await self._body(_events_call(self._core, pod, namespace))).get("items") or [])

    async def snapshot(self, ref: JobRef) -> Snapshot:
        job = await self.get(ref.kind, ref.name, ref.namespace)
        kind = kinds.get(ref.kind)
        selector = kind.pod_selector(ref.name)
        pods = await self.list_pods(ref.namespace, selector) if selector is not None and job else []
        owners: list[dict[str, Any]] = []
        for query in kind.intermediates if pods else ():
            owners += (
                _json(await self._body(_owners_call(self._custom, query, ref.name, ref.namespace))).get("items") or []
            )
        return Snapshot(job=job, pods=kind.controlled_pods(job, pods, owners), now=time.time())

    async def read_log(
        self,
        pod: str,
        namespace: str,
        since_seconds: int | None,
        tail_lines: int | None = None,
        *,
        container: str = TRAINING_CONTAINER,
        previous: bool = False,
        limit_bytes: int | None = None,
    ) -> str:
        call = _log_call(
            self._core,
            pod,
            namespace,
            since_seconds,
            tail_lines,
            container=container,
            limit_bytes=limit_bytes,
            previous=previous,
        )
        body = await self._body(call)
        return body.decode("utf-8", errors="replace")

    async def list_objects(self, kind: str | OwnerQuery, namespace: str, **selectors: str | None) -> dict[str, Any]:
        """One list of ``kind`` (items and the list's ``metadata.resourceVersion``), served from the watch cache;
        ``selectors``: ``label_selector``, ``field_selector``.

        ``resourceVersion=0`` lets the apiserver answer from its cache instead of a quorum read of etcd; the watch
        that follows starts from the list's version, so nothing between the two is missed.
        """
        call = _collection_call(self._core, self._custom, kind, namespace, resource_version="0", **selectors)
        return _json(await self._body(call))

    async def watch_objects(
        self, kind: str | OwnerQuery, namespace: str, resource_version: str, timeout_seconds: int, **selectors: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch of ``kind`` from ``resource_version`` (with bookmarks), until the server ends it.

        Raises :class:`KubeError` for an HTTP error (410 Gone included) and for a broken connection.
        """
        from aiohttp import ClientError
        from kubernetes_asyncio.client.exceptions import ApiException

        fn, args, kwargs = _collection_call(
            self._core,
            self._custom,
            kind,
            namespace,
            **selectors,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_seconds,
        )
        try:
            # A read timeout well past the server's own end of the watch: only a dead connection trips it.
            response = await fn(*args, _request_timeout=(10, timeout_seconds + 30), _preload_content=False, **kwargs)
        except ApiException as e:
            raise _from_api_exception(e) from e
        except (TimeoutError, ClientError, OSError) as e:
            raise KubeError(0, type(e).__name__, str(e)) from e
        try:
            if not 200 <= response.status <= 299:
                error = ApiException(status=response.status, reason=response.reason)
                error.body = (await response.read()).decode("utf-8", errors="replace")
                error.headers = response.headers
                raise _from_api_exception(error) from error
            # Chunks, not readline(): aiohttp refuses lines above 64 KiB, and a job with large templates is one.
            buffer = b""
            chunks = response.content.iter_any()
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except (TimeoutError, ClientError, OSError) as e:
                    raise KubeError(0, type(e).__name__, str(e)) from e
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _json(line)
        finally:
            response.release()

    async def delete(self, kind: str, name: str, namespace: str) -> bool:
        try:
            await self._body(_delete_call(self._core, self._custom, kind, name, namespace))
        except KubeError as e:
            if e.not_found:
                return False
            raise
        return True

    async def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None:
        await self._body(_label_patch_call(self._core, self._custom, ref, labels))

    async def delete_job(self, ref: JobRef) -> bool:
        existed = await self.delete(ref.kind, ref.name, ref.namespace)
        await self.delete("Secret", payload_secret_name(ref.name), ref.namespace)
        return existed

    async def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return list(_json(await self._body(workloads_call(self._custom, namespace, job_uid))).get("items") or [])


def _json(body: bytes) -> dict[str, Any]:
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise KubeError(0, "InvalidResponse", f"expected a JSON object, got {body[:200]!r}")
    return doc
