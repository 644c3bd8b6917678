"""The two senders of Kubernetes calls: :class:`SyncKube` (blocking) and :class:`AsyncKube` (``asyncio``).

A call is data built without I/O (:mod:`~.calls`, :mod:`~.discovery`); a sender sends it and hands the body back
to it, and decides nothing. So "a new verb" is one builder and one call site (``kube.send(calls.x(...))``), written
once for both. Both senders are :class:`~.requests.JobSource` implementations (a direct poll of the API); the UI
plugin's reads, the submit and the sweep go through :class:`SyncKube` too.

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
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final, TypeVar

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import calls, discovery
from airflow_provider_torchelastic.kubernetes.calls import Call, Flow
from airflow_provider_torchelastic.kubernetes.kinds import OwnerQuery
from airflow_provider_torchelastic.kubernetes.requests import ReadEvents, ReadLog
from airflow_provider_torchelastic.kubernetes.retry import LONGEST_WAIT as LONGEST_WAIT
from airflow_provider_torchelastic.kubernetes.retry import MAX_RECOVERABLE_FAILURES as MAX_RECOVERABLE_FAILURES
from airflow_provider_torchelastic.kubernetes.retry import retry_async, retry_sync
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot

__all__ = ["AsyncKube", "KubeError", "SyncKube", "retry_async", "retry_sync", "sync_kube_from_config"]

T = TypeVar("T")

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


def _unreachable(exc: BaseException) -> KubeError:
    """A request that got no answer (a refused or broken connection, a timeout): status 0, which a retry may fix."""
    return KubeError(0, type(exc).__name__, str(exc))


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
    """The blocking sender, through the ``kubernetes`` client of a cncf.kubernetes ``KubernetesHook``.

    :meth:`send` is its one request; every other method is one call of :mod:`~.calls` sent, there for the callers
    that take a client (the wait core's :class:`~.requests.JobSource`, the submit, the sweep, the UI's reads).
    ``request_timeout`` (seconds) bounds each call: the UI's page views wait less than a task does.
    """

    def __init__(self, api_client: Any, *, request_timeout: float = _REQUEST_TIMEOUT) -> None:
        self._api_client = api_client
        self._request_timeout = request_timeout

    def send(self, call: Call[T]) -> T:
        """``call``'s answer; raises :class:`KubeError`."""
        try:
            body = self._body(call)
        except KubeError as e:
            return call.recover(e)
        return call.parse(body)

    def run(self, flow: Flow[T]) -> T:
        """What ``flow`` returns, each of its calls sent in turn."""
        answer: Any = None
        while True:
            try:
                answer = self.send(flow.send(answer))
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]

    def _body(self, call: Call[Any]) -> bytes:
        """The raw response body. Raw, because kubernetes 36.0.x returns the *repr* of bytes for logs otherwise
        (kubernetes-client #2596), and JSON dicts are what render and status work with anyway."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = self._api_client.call_api(**_wire(call), _request_timeout=call.timeout or self._request_timeout)
            if call.read_limit is None:
                return bytes(response.data)
            try:
                return bytes(response.read(amt=call.read_limit))
            finally:
                response.close()  # what is left unread must not come back with the pooled connection
        except ApiException as e:
            raise _from_api_exception(e) from e
        except (HTTPError, OSError) as e:
            raise _unreachable(e) from e

    def create(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        return self.send(calls.create(obj, dry_run=dry_run))

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        return self.send(calls.get(kind, name, namespace))

    def delete(self, kind: str, name: str, namespace: str) -> bool:
        return self.send(calls.delete(kind, name, namespace))

    def patch_secret(self, name: str, namespace: str, body: Mapping[str, Any]) -> None:
        self.send(calls.patch_secret(name, namespace, body))

    def list_kind(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Every object of ``kind`` in ``namespace`` that ``label_selector`` selects, as it is now."""
        return self.send(calls.list_kind(kind, namespace, label_selector=label_selector))

    def owners(self, query: OwnerQuery, ref: JobRef) -> list[dict[str, Any]]:
        return self.send(calls.owners(query, ref))

    def served_resources(self, group: str, version: str) -> list[str] | None:
        return self.send(discovery.served_resources(group, version))

    # --- the wait core's JobSource ------------------------------------------------------------------------------

    def snapshot(self, ref: JobRef) -> Snapshot:
        return self.run(calls.snapshot(ref))

    def read_log(self, request: ReadLog) -> str:
        return self.send(calls.read_log(request))

    def events(self, request: ReadEvents) -> list[dict[str, Any]]:
        return self.send(calls.events(request))

    def delete_job(self, ref: JobRef) -> bool:
        return self.run(calls.delete_job(ref))

    def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None:
        self.send(calls.label_job(ref, labels))

    def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return self.send(calls.workloads(namespace, job_uid))


class AsyncKube:
    """The same sender through ``kubernetes_asyncio`` (inside ``async with AsyncKubernetesHook.get_conn()``), and
    :meth:`stream` for a watch."""

    def __init__(self, api_client: Any) -> None:
        self._api_client = api_client

    async def send(self, call: Call[T]) -> T:
        """``call``'s answer; raises :class:`KubeError`."""
        try:
            body = await self._body(call)
        except KubeError as e:
            return call.recover(e)
        return call.parse(body)

    async def run(self, flow: Flow[T]) -> T:
        """What ``flow`` returns, each of its calls sent in turn."""
        answer: Any = None
        while True:
            try:
                call = flow.send(answer)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            answer = await self.send(call)

    async def _open(self, call: Call[Any]) -> Any:
        """The response to ``call``, its body unread."""
        from aiohttp import ClientError
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await self._api_client.call_api(**_wire(call), _request_timeout=call.timeout or _REQUEST_TIMEOUT)
        except ApiException as e:
            raise _from_api_exception(e) from e
        except (TimeoutError, ClientError, OSError) as e:
            raise _unreachable(e) from e

    async def _body(self, call: Call[Any]) -> bytes:
        from aiohttp import ClientError

        response = await self._open(call)
        try:
            if call.read_limit is None:
                body = bytes(await response.read())
            else:
                body = b""
                while len(body) < call.read_limit and (
                    chunk := await response.content.read(call.read_limit - len(body))
                ):
                    body += chunk
        except (TimeoutError, ClientError, OSError) as e:
            raise _unreachable(e) from e
        finally:
            response.release()  # what is left unread closes the connection rather than coming back with it
        _check_status(response, body)
        return body

    async def stream(self, call: Call[T]) -> AsyncIterator[T]:
        """The answer of a watch (or a followed log), one line at a time, each read by ``call``, until the server
        ends it; a line longer than ``call.read_limit`` comes in pieces of that length.

        Raises :class:`KubeError` for an HTTP error (410 Gone included) and for a broken connection.
        """
        from aiohttp import ClientError

        response = await self._open(call)
        try:
            if not 200 <= response.status <= 299:
                _check_status(response, await response.read())
            # Chunks, not readline(): aiohttp refuses lines above 64 KiB, and a job with large templates is one.
            buffer = b""
            chunks = response.content.iter_any()
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except (TimeoutError, ClientError, OSError) as e:
                    raise _unreachable(e) from e
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                if call.read_limit is not None and len(buffer) > call.read_limit:
                    # A line without end (a log's): what is held stays bounded, passed on in pieces.
                    lines.append(buffer[: call.read_limit])
                    buffer = buffer[call.read_limit :]
                for line in lines:
                    if line.strip():
                        yield call.parse(line)
        finally:
            response.release()

    async def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        return await self.send(calls.get(kind, name, namespace))

    # --- the wait core's AsyncJobSource -------------------------------------------------------------------------

    async def snapshot(self, ref: JobRef) -> Snapshot:
        return await self.run(calls.snapshot(ref))

    async def read_log(self, request: ReadLog) -> str:
        return await self.send(calls.read_log(request))

    async def events(self, request: ReadEvents) -> list[dict[str, Any]]:
        return await self.send(calls.events(request))

    async def delete_job(self, ref: JobRef) -> bool:
        return await self.run(calls.delete_job(ref))

    async def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None:
        await self.send(calls.label_job(ref, labels))

    async def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return await self.send(calls.workloads(namespace, job_uid))


def _wire(call: Call[Any]) -> dict[str, Any]:
    """``call`` as both generated clients' ``ApiClient.call_api`` takes it, the body left unread."""
    return {
        "resource_path": call.path,
        "method": call.method,
        "query_params": list(call.query),
        "header_params": {"Accept": "application/json", "Content-Type": call.content_type},
        "body": None if call.body is None else dict(call.body),
        "auth_settings": ["BearerToken"],
        "_preload_content": False,
    }


def _check_status(response: Any, body: bytes) -> None:
    """kubernetes_asyncio checks the HTTP status only when it preloads the content, so a 404, 403 or 503 would
    otherwise come back as a Status document in place of the object: check it here."""
    if 200 <= response.status <= 299:
        return
    from kubernetes_asyncio.client.exceptions import ApiException

    error = ApiException(status=response.status, reason=response.reason)
    text: Any = body.decode("utf-8", errors="replace")  # as the client keeps it (typed bytes | None there)
    error.body, error.headers = text, response.headers
    raise _from_api_exception(error) from error
