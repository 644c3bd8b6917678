"""Every fault the proxy injects is visible to a real client, sync and async, and the proxy is transparent otherwise.

These also pin down how the clients themselves react (useful when writing retry logic): the sync client's urllib3
pool retries idempotent requests (GET, PUT, DELETE) on dropped connections, read timeouts and 429/503 *with*
Retry-After, up to 3 times; it never retries POST or PATCH. kubernetes_asyncio (aiohttp) retries an idempotent
request once after a dropped connection, and never on a status code.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tests.cluster.proxy import FaultProxy, Match
from tests.cluster.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def proxied(kube_cluster: KubeCluster, fault_proxy: FaultProxy, tmp_path: Path) -> Iterator[client.CoreV1Api]:
    kubeconfig = kube_cluster.proxied_kubeconfig(fault_proxy, tmp_path / "kubeconfig-proxy")
    with config.new_client_from_config(config_file=str(kubeconfig)) as api:
        yield client.CoreV1Api(api)


@pytest.fixture
def labelled_configmaps(kube_cluster: KubeCluster) -> Iterator[tuple[str, list[str], str]]:
    """Three ConfigMaps with a unique label; yields (label selector, names, resourceVersion before they existed)."""
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api:
        v1, ns, label = client.CoreV1Api(api), kube_cluster.namespace, unique("set")
        start_rv = v1.list_namespaced_config_map(ns).metadata.resource_version
        names = [f"{label}-{i}" for i in range(3)]
        for name in names:
            v1.create_namespaced_config_map(ns, {"metadata": {"name": name, "labels": {"set": label}}})
        yield f"set={label}", names, start_rv
        v1.delete_collection_namespaced_config_map(ns, label_selector=f"set={label}")


def status_body(e: ApiException) -> dict[str, object]:
    body: dict[str, object] = json.loads(e.body)
    return body


def test_proxy_is_transparent(kube_cluster: KubeCluster, fault_proxy: FaultProxy, proxied: client.CoreV1Api) -> None:
    assert proxied.read_namespace(kube_cluster.namespace).metadata.name == kube_cluster.namespace
    [request] = fault_proxy.requests
    assert (request.method, request.path, request.fault) == (
        "GET",
        f"/api/v1/namespaces/{kube_cluster.namespace}",
        None,
    )


@pytest.mark.parametrize(("code", "reason"), [(500, "InternalError"), (503, "ServiceUnavailable")])
def test_injected_status_is_a_kubernetes_status(
    kube_cluster: KubeCluster, fault_proxy: FaultProxy, proxied: client.CoreV1Api, code: int, reason: str
) -> None:
    fault_proxy.fail_next(1, status=code)
    with pytest.raises(ApiException) as excinfo:
        proxied.list_namespaced_config_map(kube_cluster.namespace)
    assert excinfo.value.status == code
    body = status_body(excinfo.value)
    assert (body["kind"], body["status"], body["reason"], body["code"]) == ("Status", "Failure", reason, code)
    proxied.list_namespaced_config_map(kube_cluster.namespace)  # the fault was used up
    assert [r.fault for r in fault_proxy.requests] == ["status", None]


def test_429_with_retry_after(kube_cluster: KubeCluster, fault_proxy: FaultProxy, proxied: client.CoreV1Api) -> None:
    ns = kube_cluster.namespace
    # POST is not retried by urllib3: the 429 and its Retry-After reach the caller.
    fault_proxy.fail_next(1, status=429, retry_after=2, match=Match(method="POST"))
    with pytest.raises(ApiException) as excinfo:
        proxied.create_namespaced_config_map(ns, {"metadata": {"name": unique("never")}})
    assert excinfo.value.status == 429
    assert excinfo.value.headers["Retry-After"] == "2"
    assert status_body(excinfo.value)["details"] == {"retryAfterSeconds": 2}

    # GET is retried by urllib3 after honouring Retry-After: the caller only sees the delay.
    fault_proxy.fail_next(1, status=429, retry_after=1, match=Match(method="GET"))
    started = time.monotonic()
    proxied.list_namespaced_config_map(ns)
    assert time.monotonic() - started >= 0.9
    assert [r.fault for r in fault_proxy.requests][-2:] == ["status", None]


def test_dropped_connections_raise(
    kube_cluster: KubeCluster, fault_proxy: FaultProxy, proxied: client.CoreV1Api
) -> None:
    ns = kube_cluster.namespace
    fault_proxy.drop_next(1, match=Match(method="POST"))
    with pytest.raises(urllib3.exceptions.ProtocolError):  # not retried: POST is not idempotent
        proxied.create_namespaced_config_map(ns, {"metadata": {"name": unique("dropped")}})

    fault_proxy.drop_next(10, match=Match(method="GET"))
    with pytest.raises(urllib3.exceptions.MaxRetryError):  # GET: 1 try + 3 retries, all dropped
        proxied.list_namespaced_config_map(ns)
    drops = [r for r in fault_proxy.requests if r.fault == "drop"]
    assert len(drops) == 1 + 4
    fault_proxy.clear()
    proxied.list_namespaced_config_map(ns)


def test_stalled_request_times_out_but_still_happens(
    kube_cluster: KubeCluster, fault_proxy: FaultProxy, proxied: client.CoreV1Api
) -> None:
    ns, name = kube_cluster.namespace, unique("stalled")
    fault_proxy.stall_next(1, seconds=2.5, match=Match(method="POST"))
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        proxied.create_namespaced_config_map(ns, {"metadata": {"name": name}}, _request_timeout=1)
    # The request was forwarded after the stall: a timeout does not mean the write did not happen.
    deadline = time.monotonic() + 10
    while True:
        try:
            proxied.read_namespaced_config_map(name, ns)
            break
        except ApiException as e:
            assert e.status == 404 and time.monotonic() < deadline
            time.sleep(0.3)
    proxied.delete_namespaced_config_map(name, ns)


@pytest.mark.parametrize("clean", [True, False], ids=["clean-end", "reset"])
def test_cut_watch_ends_the_stream_early(
    kube_cluster: KubeCluster,
    fault_proxy: FaultProxy,
    proxied: client.CoreV1Api,
    labelled_configmaps: tuple[str, list[str], str],
    clean: bool,
) -> None:
    selector, names, _ = labelled_configmaps
    fault_proxy.cut_watch_next(1, after_events=2, clean=clean)
    resp = proxied.list_namespaced_config_map(
        kube_cluster.namespace, label_selector=selector, watch=True, timeout_seconds=30, _preload_content=False
    )
    started, events = time.monotonic(), []
    try:
        for line in iter_resp_lines(resp):
            events.append(json.loads(line))
    except urllib3.exceptions.ProtocolError:
        assert not clean, "a clean cut must end the stream without an error"
    else:
        assert clean, "a reset must surface as an error"
    finally:
        resp.release_conn()
    assert time.monotonic() - started < 10  # well before the server's 30 s timeout
    assert [e["type"] for e in events] == ["ADDED", "ADDED"]
    assert {e["object"]["metadata"]["name"] for e in events} < set(names)


def test_watch_stream_resumes_after_a_cut(
    kube_cluster: KubeCluster,
    fault_proxy: FaultProxy,
    proxied: client.CoreV1Api,
    labelled_configmaps: tuple[str, list[str], str],
) -> None:
    selector, names, start_rv = labelled_configmaps
    fault_proxy.cut_watch_next(1, after_events=2, clean=True)
    seen, w = [], watch.Watch()
    # No timeout_seconds: Watch.stream then reconnects from the last resourceVersion it saw when a stream ends.
    for event in w.stream(
        proxied.list_namespaced_config_map, kube_cluster.namespace, label_selector=selector, resource_version=start_rv
    ):
        seen.append(event["object"].metadata.name)
        if len(seen) == len(names):
            w.stop()
    assert seen == names
    watches = [r for r in fault_proxy.requests if r.watch]
    assert [r.fault for r in watches] == ["cut_watch", None]
    assert watches[1].query["resourceVersion"] != [start_rv]  # resumed from the 2nd event, not from the start


def test_expired_watch(kube_cluster: KubeCluster, fault_proxy: FaultProxy, proxied: client.CoreV1Api) -> None:
    ns = kube_cluster.namespace
    fault_proxy.expire_watch_next(1)
    resp = proxied.list_namespaced_config_map(ns, watch=True, resource_version="5", _preload_content=False)
    try:
        events = [json.loads(line) for line in iter_resp_lines(resp)]
    finally:
        resp.release_conn()
    assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [("ERROR", 410, "Expired")]

    # Watch.stream with a timeout does not relist by itself: the 410 reaches the caller.
    fault_proxy.expire_watch_next(1)
    with pytest.raises(ApiException) as excinfo:
        for _ in watch.Watch().stream(proxied.list_namespaced_config_map, ns, resource_version="5", timeout_seconds=5):
            pass
    assert excinfo.value.status == 410


def test_async_client_sees_faults(kube_cluster: KubeCluster, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    kubeconfig = kube_cluster.proxied_kubeconfig(fault_proxy, tmp_path / "kubeconfig-proxy")
    asyncio.run(_async_faults(kubeconfig, kube_cluster.namespace, fault_proxy))


async def _async_faults(kubeconfig: Path, ns: str, proxy: FaultProxy) -> None:
    import aiohttp
    from kubernetes_asyncio import client as aclient
    from kubernetes_asyncio import config as aconfig
    from kubernetes_asyncio.client.rest import ApiException as AsyncApiException

    api_client = await aconfig.new_client_from_config(config_file=str(kubeconfig))
    async with api_client:
        v1 = aclient.CoreV1Api(api_client)
        proxy.fail_next(1, status=429, retry_after=3)
        with pytest.raises(AsyncApiException) as excinfo:
            await v1.list_namespaced_config_map(ns)
        assert excinfo.value.status == 429
        assert excinfo.value.headers is not None and excinfo.value.headers["Retry-After"] == "3"

        proxy.fail_next(1, status=503)
        with pytest.raises(AsyncApiException) as excinfo:
            await v1.list_namespaced_config_map(ns)
        assert excinfo.value.status == 503

        proxy.drop_next(2)  # aiohttp retries an idempotent request once after a dropped connection
        with pytest.raises(aiohttp.ClientError):
            await v1.list_namespaced_config_map(ns)

        proxy.stall_next(1, seconds=2)
        with pytest.raises(asyncio.TimeoutError):
            await v1.list_namespaced_config_map(ns, _request_timeout=0.5)

        proxy.cut_watch_next(1, after_events=0, clean=False)
        with pytest.raises(aiohttp.ClientError):
            # _preload_content=False returns the raw aiohttp response (the stubs say the model).
            resp: Any = await v1.list_namespaced_config_map(ns, watch=True, timeout_seconds=30, _preload_content=False)
            async with resp:
                await resp.content.read()

        await v1.list_namespaced_config_map(ns)  # all faults used up
    assert proxy.pending_faults == 0
