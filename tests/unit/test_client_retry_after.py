"""``Retry-After``: the API server says how long to wait (API Priority and Fairness with a 429, an overloaded server
or a proxy with a 503), the one translation boundary carries it into ``KubeError.retry_after``, and the retry loops
wait that long (capped) instead of their own backoff."""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import urllib3

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import client as kube
from airflow_provider_torchelastic.kubernetes import retry
from airflow_provider_torchelastic.kubernetes.client import AsyncKube, SyncKube, retry_async, retry_sync
from tests.unit.fake_kube_api import Answer, fake_api, items, json_answer, status_answer

NOW = 1_800_000_000.0
JOBS = "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs"


def failing_then(errors: list[KubeError], calls: list[int]) -> Callable[[], str]:
    def call() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "ok"

    return call


# --- the decision: what retry_sync sleeps ---------------------------------------------------------------------------


def test_a_servers_retry_after_is_the_wait_capped_at_the_longest_wait() -> None:
    calls: list[int] = []
    naps: list[float] = []
    logged: list[str] = []
    errors = [
        KubeError(429, "TooManyRequests", "throttled", retry_after=7.0),
        KubeError(503, "ServiceUnavailable", "maintenance", retry_after=3600.0),
        KubeError(429, "TooManyRequests", "throttled", retry_after=0.0),
    ]
    assert retry_sync(failing_then(errors, calls), logged.append, naps.append) == "ok"
    # Never sooner than asked (capped), and never sooner than the backoff: jittered 0-1 s, 0-2 s, 0-4 s here.
    assert 7.0 <= naps[0] <= 7.0 and naps[1] == kube.LONGEST_WAIT and 0.0 <= naps[2] <= 4.0, naps
    assert len(calls) == 4
    assert all("as the server asked" in line for line in logged), logged


def test_a_short_retry_after_does_not_shorten_the_retries_below_the_backoff() -> None:
    """The API server answers every throttled request with "Retry-After: 1": taken alone, the retries would give up
    after about a dozen seconds of throttling, so the wait is the longer of the two."""
    calls: list[int] = []
    naps: list[float] = []
    errors = [KubeError(429, "TooManyRequests", "throttled", retry_after=1.0)] * kube.MAX_RECOVERABLE_FAILURES
    assert retry_sync(failing_then(errors, calls), lambda line: None, naps.append) == "ok"
    assert all(nap >= 1.0 for nap in naps) and sum(naps) > 2 * len(naps), naps


def test_without_retry_after_the_wait_is_the_backoff() -> None:
    calls: list[int] = []
    naps: list[float] = []
    logged: list[str] = []
    errors = [KubeError(503, "ServiceUnavailable", ""), KubeError(429, "TooManyRequests", "", retry_after=2.0)]
    assert retry_sync(failing_then(errors, calls), logged.append, naps.append) == "ok"
    assert 0 <= naps[0] <= kube.LONGEST_WAIT and 2.0 <= naps[1] <= kube.LONGEST_WAIT
    assert "as the server asked" not in logged[0] and "as the server asked" in logged[1]


def test_retry_after_does_not_make_an_error_recoverable() -> None:
    """A Retry-After on an answer no retry can fix (a 403 from a proxy, say) is no reason to repeat the call."""
    calls: list[int] = []
    naps: list[float] = []
    with pytest.raises(KubeError) as info:
        retry_sync(failing_then([KubeError(403, "Forbidden", "", retry_after=1.0)], calls), print, naps.append)
    assert info.value.status == 403 and len(calls) == 1 and naps == []


def test_retry_after_still_counts_against_the_failures_tolerated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "MAX_RECOVERABLE_FAILURES", 2)
    calls: list[int] = []
    naps: list[float] = []
    errors = [KubeError(429, "TooManyRequests", "", retry_after=1.0) for _ in range(5)]
    with pytest.raises(KubeError) as info:
        retry_sync(failing_then(errors, calls), print, naps.append)
    assert info.value.status == 429 and len(calls) == 3 and len(naps) == 2 and all(nap >= 1.0 for nap in naps)


def test_the_async_loop_counts_and_logs_the_first_failure_as_the_sync_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first try runs outside tenacity (a call that succeeds pays for no loop); a first failure still counts
    against the failures tolerated and is logged, and the call is not repeated at once."""
    monkeypatch.setattr(retry, "MAX_RECOVERABLE_FAILURES", 2)
    monkeypatch.setattr(retry, "_backoff", lambda state: 0.0)

    def run(errors: list[KubeError]) -> tuple[list[int], list[str], str | KubeError]:
        calls: list[int] = []
        logged: list[str] = []

        async def call() -> str:
            calls.append(1)
            if errors:
                raise errors.pop(0)
            return "ok"

        try:
            return calls, logged, asyncio.run(retry_async(call, logged.append))
        except KubeError as e:
            return calls, logged, e

    calls, logged, result = run([])
    assert (len(calls), logged, result) == (1, [], "ok")
    calls, logged, result = run([KubeError(503, "ServiceUnavailable", "down")] * 2)
    assert (len(calls), len(logged), result) == (3, 2, "ok") and "retrying" in logged[0]
    calls, logged, result = run([KubeError(503, "ServiceUnavailable", "down")] * 3)
    assert len(calls) == 3 and isinstance(result, KubeError) and result.status == 503
    calls, logged, result = run([KubeError(404, "NotFound", "gone")])
    assert len(calls) == 1 and logged == [] and isinstance(result, KubeError) and result.status == 404


# --- reading the header ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"Retry-After": "3"}, 3.0),
        ({"retry-after": " 1.5 "}, 1.5),  # header names are case-insensitive
        (urllib3.HTTPHeaderDict({"RETRY-AFTER": "2"}), 2.0),  # what the sync client keeps them in
        ({"Retry-After": email.utils.formatdate(NOW + 10, usegmt=True)}, 10.0),  # an HTTP-date
        ({"Retry-After": email.utils.formatdate(NOW - 10, usegmt=True)}, 0.0),  # a moment already past
        ({"Retry-After": "-4"}, 0.0),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "nan"}, None),
        ({"Retry-After": ""}, None),
        ({"Content-Type": "application/json"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_retry_after_header_in_seconds(headers: Mapping[str, str] | None, seconds: float | None) -> None:
    assert kube._retry_after_seconds(headers, NOW) == seconds


def test_the_kubernetes_clients_api_exception_becomes_a_kube_error_with_retry_after() -> None:
    """Built as kubernetes' rest.py builds it from the urllib3 response: ``ApiException(http_resp=r)``."""
    from kubernetes.client.exceptions import ApiException

    status = {"kind": "Status", "status": "Failure", "reason": "TooManyRequests", "code": 429, "message": "slow down"}
    response = urllib3.HTTPResponse(
        body=json.dumps(status).encode(),
        headers={"Content-Type": "application/json", "Retry-After": "4"},
        status=429,
        reason="Too Many Requests",
        preload_content=False,
    )
    error = kube._from_api_exception(ApiException(http_resp=response))
    assert (error.status, error.reason, error.retry_after, error.recoverable) == (429, "TooManyRequests", 4.0, True)
    no_header = urllib3.HTTPResponse(body=b"", status=503, reason="Service Unavailable", preload_content=False)
    assert kube._from_api_exception(ApiException(http_resp=no_header)).retry_after is None


# --- through the real clients, against a fake network ---------------------------------------------------------------


def throttled_once(retry_after: str) -> Callable[[str, str, Mapping[str, str]], Answer]:
    answered: list[str] = []

    def answer(method: str, path: str, query: Mapping[str, str]) -> Answer:
        answered.append(path)
        if len(answered) == 1:
            return status_answer(429, "TooManyRequests", "too many requests", retry_after=retry_after)
        if path == JOBS:
            return items({"kind": "PyTorchJob", "metadata": {"name": "train", "namespace": "ml"}})
        return json_answer({"kind": "PyTorchJob", "metadata": {"name": "train", "namespace": "ml"}})

    return answer


def sync_kube(url: str, retries: int | None = 0) -> Any:
    """A SyncKube on the real kubernetes client. ``retries=0``: urllib3's own retries (by default it repeats a GET
    answered 429/503 with Retry-After up to 3 times, sleeping what the header says) are off, so that what SyncKube
    sees is the server's first answer."""
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = url
    configuration.retries = retries
    return SyncKube(client.ApiClient(configuration))


def test_sync_client_honours_retry_after_from_the_api() -> None:
    with fake_api(throttled_once("2")) as api:
        sync = sync_kube(api.url)
        with pytest.raises(KubeError) as info:
            sync.list_kind("PyTorchJob", "ml", "app=x")
        assert (info.value.status, info.value.reason, info.value.retry_after) == (429, "TooManyRequests", 2.0)
    assert api.paths() == [JOBS] and api.requests[0].query == {"labelSelector": "app=x"}

    naps: list[float] = []
    with fake_api(throttled_once("2")) as api:
        sync = sync_kube(api.url)
        found = retry_sync(lambda: sync.list_kind("PyTorchJob", "ml", "app=x"), print, naps.append)
    assert [job["metadata"]["name"] for job in found] == ["train"] and naps == [2.0] and api.paths() == [JOBS, JOBS]


def test_async_client_carries_retry_after_from_the_api() -> None:
    """kubernetes_asyncio does not raise for an error status when it does not preload the body: AsyncKube builds
    the ApiException itself, and must keep the response's headers on it."""
    from kubernetes_asyncio import client

    async def get_twice(url: str) -> tuple[KubeError, dict[str, Any] | None]:
        async with client.ApiClient(client.Configuration(host=url)) as api_client:
            source = AsyncKube(api_client)
            with pytest.raises(KubeError) as info:
                await source.get("PyTorchJob", "train", "ml")
            return info.value, await source.get("PyTorchJob", "train", "ml")

    with fake_api(throttled_once("3")) as api:
        error, job = asyncio.run(get_twice(api.url))
    assert (error.status, error.reason, error.retry_after) == (429, "TooManyRequests", 3.0) and job is not None

    # Through retry_async: "0", the server asks for no wait at all, so the test waits for nothing.
    def zero_then_job(method: str, path: str, query: Mapping[str, str]) -> Answer:
        if len(api.requests) == 1:
            return status_answer(503, "ServiceUnavailable", "", retry_after="0")
        return json_answer({"kind": "PyTorchJob", "metadata": {"name": "train", "namespace": "ml"}})

    async def retried(url: str) -> tuple[dict[str, Any] | None, list[str]]:
        async with client.ApiClient(client.Configuration(host=url)) as api_client:
            source = AsyncKube(api_client)
            logged: list[str] = []
            job = await retry_async(functools.partial(source.get, "PyTorchJob", "train", "ml"), logged.append)
        return job, logged

    with fake_api(zero_then_job) as api:
        job, logged = asyncio.run(retried(api.url))
    assert job is not None and len(logged) == 1 and re.search(r"retrying in [01] s as the server asked", logged[0])
