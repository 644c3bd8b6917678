"""Thin Kubernetes I/O: create, get, list, read logs, delete; sync and async twins that decide nothing.

Objects travel as the API's own JSON dicts (what :mod:`render` produces and :mod:`status` reads). API errors are
translated once, here, into :class:`KubeError` carrying the HTTP status and the Status reason, chained ``from``
the client's exception; callers test ``status``/``reason``, never message text.

The kubernetes clients are imported lazily: importing this module must stay cheap for the DAG parse path.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, Final, TypeVar

from airflow_provider_torchelastic.status import (
    EmitLog,
    FetchJob,
    JobRef,
    ReadLog,
    Request,
    Sleep,
    Snapshot,
    WaitDecision,
)

__all__ = ["AsyncKube", "KubeError", "SyncKube", "drive_async", "drive_sync", "retry_async", "retry_sync"]

PYTORCHJOB: Final = ("kubeflow.org", "v1", "pytorchjobs")
#: Statuses worth retrying: throttled, server trouble, gateway trouble.
TRANSIENT_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
_REQUEST_TIMEOUT: Final = 60  # seconds: a half-open connection must not hang a poll forever

T = TypeVar("T")


class KubeError(Exception):
    """An API call failed. ``status`` is the HTTP status (0 when the connection itself failed)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason

    @property
    def transient(self) -> bool:
        return self.status == 0 or self.status in TRANSIENT_STATUSES

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def _from_api_exception(exc: Any) -> KubeError:
    status = int(getattr(exc, "status", 0) or 0)
    body = getattr(exc, "body", None)
    reason, message = str(getattr(exc, "reason", "") or ""), ""
    if body:
        try:
            doc = json.loads(body)
            reason, message = doc.get("reason", reason) or reason, doc.get("message", "")
        except (ValueError, TypeError, AttributeError):
            message = str(body)[:500]
    return KubeError(status, reason, message)


def _retry_after(attempt: int) -> float:
    # Bounded exponential backoff with jitter: 1, 2, 4, 8, 16, 30, 30... seconds.
    return min(30.0, 2.0**attempt) * (0.5 + random.random() / 2)


# --- which API call does what: built once, without I/O, for both clients ------------------------------------------

_Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _create_call(core: Any, custom: Any, obj: Mapping[str, Any]) -> _Call:
    namespace, kind = obj["metadata"]["namespace"], obj["kind"]
    if kind == "ConfigMap":
        return core.create_namespaced_config_map, (namespace, obj), {}
    if kind == "Pod":
        return core.create_namespaced_pod, (namespace, obj), {}
    return custom.create_namespaced_custom_object, (*PYTORCHJOB[:2], namespace, PYTORCHJOB[2], obj), {}


def _get_call(core: Any, custom: Any, kind: str, name: str, namespace: str) -> _Call:
    if kind == "Pod":
        return core.read_namespaced_pod, (name, namespace), {}
    if kind == "ConfigMap":
        return core.read_namespaced_config_map, (name, namespace), {}
    return custom.get_namespaced_custom_object, (*PYTORCHJOB[:2], namespace, PYTORCHJOB[2], name), {}


def _delete_call(core: Any, custom: Any, kind: str, name: str, namespace: str) -> _Call:
    # Background propagation: the API's garbage collector removes what the job owns (pods, the payload ConfigMap).
    body = {"propagationPolicy": "Background"}
    if kind == "Pod":
        return core.delete_namespaced_pod, (name, namespace), {"body": body}
    if kind == "ConfigMap":
        return core.delete_namespaced_config_map, (name, namespace), {"body": body}
    return custom.delete_namespaced_custom_object, (*PYTORCHJOB[:2], namespace, PYTORCHJOB[2], name), {"body": body}


def _log_call(core: Any, request: ReadLog) -> _Call:
    kwargs: dict[str, Any] = {"container": "pytorch", "timestamps": True}
    if request.since_seconds is not None:
        kwargs["since_seconds"] = request.since_seconds
    return core.read_namespaced_pod_log, (request.pod, request.namespace), kwargs


def _list_pods_call(core: Any, namespace: str, label_selector: str) -> _Call:
    return core.list_namespaced_pod, (namespace,), {"label_selector": label_selector}


class SyncKube:
    """Blocking calls through the ``kubernetes`` client of a cncf.kubernetes ``KubernetesHook``."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    def _body(self, call: _Call) -> bytes:
        """The raw response body. Raw, because kubernetes 36.0.x returns the *repr* of bytes for logs otherwise
        (kubernetes-client #2596), and JSON dicts are what render and status work with anyway."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        fn, args, kwargs = call
        try:
            response = fn(*args, _request_timeout=_REQUEST_TIMEOUT, _preload_content=False, **kwargs)
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

    def patch_configmap(self, name: str, namespace: str, body: Mapping[str, Any]) -> None:
        # The sync client sends a dict body as a JSON merge patch.
        self._body((self._core.patch_namespaced_config_map, (name, namespace, body), {}))

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        doc = _json(self._body(_list_pods_call(self._core, namespace, label_selector)))
        return list(doc.get("items", []))

    def snapshot(self, ref: JobRef) -> Snapshot:
        job = self.get(ref.kind, ref.name, ref.namespace)
        pods = self.list_pods(ref.namespace, ref.label_selector) if ref.kind == "PyTorchJob" and job else []
        return Snapshot(job=job, pods=pods, now=time.time())

    def read_log(self, request: ReadLog) -> str:
        return self._body(_log_call(self._core, request)).decode("utf-8", errors="replace")

    def delete(self, kind: str, name: str, namespace: str) -> bool:
        """Delete an object (and, through garbage collection, what it owns). False if it was gone already."""
        try:
            self._body(_delete_call(self._core, self._custom, kind, name, namespace))
        except KubeError as e:
            if e.not_found:
                return False
            raise
        return True


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
            error.body = body.decode("utf-8", errors="replace")
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

    async def snapshot(self, ref: JobRef) -> Snapshot:
        job = await self.get(ref.kind, ref.name, ref.namespace)
        pods = await self.list_pods(ref.namespace, ref.label_selector) if ref.kind == "PyTorchJob" and job else []
        return Snapshot(job=job, pods=pods, now=time.time())

    async def read_log(self, request: ReadLog) -> str:
        return (await self._body(_log_call(self._core, request))).decode("utf-8", errors="replace")

    async def delete(self, kind: str, name: str, namespace: str) -> bool:
        try:
            await self._body(_delete_call(self._core, self._custom, kind, name, namespace))
        except KubeError as e:
            if e.not_found:
                return False
            raise
        return True


def _json(body: bytes) -> dict[str, Any]:
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise KubeError(0, "InvalidResponse", f"expected a JSON object, got {body[:200]!r}")
    return doc


# --- retries and drivers --------------------------------------------------------------------------------------------

#: Consecutive transient failures of one call tolerated before giving up (about 5 minutes of backoff).
MAX_TRANSIENT_FAILURES: Final = 12


def _delay_before_retry(error: KubeError, failures: int, log: Callable[[str], None]) -> float | None:
    """Seconds to wait before retrying after the ``failures``-th consecutive error; None: give up and raise."""
    if not error.transient or failures > MAX_TRANSIENT_FAILURES:
        return None
    delay = _retry_after(failures)
    log(f"Kubernetes API error ({error}); retrying in {delay:.0f} s")
    return delay


def retry_sync(call: Callable[[], T], log: Callable[[str], None], sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, retried with bounded backoff while the API answers 429/5xx or the connection fails."""
    failures = 0
    while True:
        try:
            return call()
        except KubeError as e:
            failures += 1
            delay = _delay_before_retry(e, failures, log)
            if delay is None:
                raise
            sleep(delay)


async def retry_async(call: Callable[[], Awaitable[T]], log: Callable[[str], None]) -> T:
    """The same as :func:`retry_sync`, awaiting."""
    failures = 0
    while True:
        try:
            return await call()
        except KubeError as e:
            failures += 1
            delay = _delay_before_retry(e, failures, log)
            if delay is None:
                raise
            await asyncio.sleep(delay)


def _no_log_text(error: KubeError, log: Callable[[str], None]) -> str:
    # Logs are best effort: a pod being created or deleted answers 400/404; the next poll tries again.
    if error.status not in (400, 404) and not error.transient:
        log(f"could not read logs: {error}")
    return ""


def drive_sync(
    flow: Generator[Request, Any, WaitDecision],
    kube: SyncKube,
    log: Callable[[str], None],
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> WaitDecision:
    """Carry out the requests of :func:`status.watch_job` with blocking calls; returns its decision."""
    answer: Any = None
    while True:
        try:
            request = flow.send(answer)
        except StopIteration as stop:
            return stop.value
        answer = None
        if isinstance(request, FetchJob):
            answer = retry_sync(functools.partial(kube.snapshot, request.ref), log, sleep)
        elif isinstance(request, ReadLog):
            try:
                answer = kube.read_log(request)
            except KubeError as e:
                answer = _no_log_text(e, log)
        elif isinstance(request, Sleep):
            sleep(request.seconds)
        elif isinstance(request, EmitLog):
            log(request.line)


async def drive_async(
    flow: Generator[Request, Any, WaitDecision],
    kube: AsyncKube,
    log: Callable[[str], None],
) -> WaitDecision:
    """Carry out the requests of :func:`status.watch_job` with awaited calls; returns its decision."""
    answer: Any = None
    while True:
        try:
            request = flow.send(answer)
        except StopIteration as stop:
            return stop.value
        answer = None
        if isinstance(request, FetchJob):
            answer = await retry_async(functools.partial(kube.snapshot, request.ref), log)
        elif isinstance(request, ReadLog):
            try:
                answer = await kube.read_log(request)
            except KubeError as e:
                answer = _no_log_text(e, log)
        elif isinstance(request, Sleep):
            await asyncio.sleep(request.seconds)
        elif isinstance(request, EmitLog):
            log(request.line)
