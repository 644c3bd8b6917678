"""The local control plane behaves like a real cluster for what the provider uses: both Python clients can create,
get, list and watch ConfigMaps and PyTorchJobs, stale watches get 410, the status subresource is separate, and
nothing listens beyond loopback."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tests.cluster import control_plane as cp
from tests.cluster.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def pytorchjob(name: str) -> dict[str, Any]:
    """A minimal valid PyTorchJob. Suspended, so the simulated operator creates no pods for it."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"test": "control-plane"}},
        "spec": {
            "runPolicy": {"suspend": True},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": 1,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "spec": {"containers": [{"name": "pytorch", "image": "python:3.11", "command": ["true"]}]}
                    },
                }
            },
        },
    }


@pytest.fixture(scope="module")
def api(kube_cluster: KubeCluster) -> Iterator[client.ApiClient]:
    api_client = config.new_client_from_config(config_file=str(kube_cluster.kubeconfig))
    with api_client:
        yield api_client


def test_crd_namespace_and_identities_are_installed(kube_cluster: KubeCluster, api: client.ApiClient) -> None:
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    established = {c.type: c.status for c in crd.status.conditions}
    assert established.get("Established") == "True"
    assert {"status", "scale"} <= set(crd.spec.versions[0].subresources.to_dict())
    assert client.CoreV1Api(api).read_namespace(kube_cluster.namespace).status.phase == "Active"
    for path in (kube_cluster.kubeconfig, kube_cluster.sa_kubeconfig, kube_cluster.info.operator_kubeconfig,
                 kube_cluster.info.kubelet_kubeconfig):  # fmt: skip
        kubeconfig = json.loads(path.read_text())
        assert kubeconfig["apiVersion"] == "v1" and kubeconfig["kind"] == "Config"
        assert kubeconfig["clusters"][0]["cluster"]["server"] == kube_cluster.api_url
    sa_context = json.loads(kube_cluster.sa_kubeconfig.read_text())["contexts"][0]["context"]
    assert sa_context["namespace"] == kube_cluster.namespace


def test_nothing_listens_beyond_loopback(kube_cluster: KubeCluster) -> None:
    records = cp.read_pids(kube_cluster.state_dir)
    assert {"etcd", "kube-apiserver"} <= {r.name for r in records}
    listening = []
    for record in records:
        proc = record.process()
        assert proc is not None, f"{record.name} is not running"
        # The simulated kubelet's children are the pods' processes: on a cluster each has a network namespace of its
        # own, and torch's c10d store there listens on every address. Only the cluster's own servers count here.
        children = [] if record.name == "sim-kubelet" else proc.children(recursive=True)
        for p in (proc, *children):
            try:
                conns = p.net_connections(kind="inet")
            except psutil.Error:
                continue
            listening += [(record.name, c.laddr) for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "expected etcd and the apiserver to listen"
    assert all(addr.ip == "127.0.0.1" for _, addr in listening), listening


def test_sync_client_configmap_create_get_list_watch(kube_cluster: KubeCluster, api: client.ApiClient) -> None:
    v1 = client.CoreV1Api(api)
    ns, name = kube_cluster.namespace, unique("cm")
    start_rv = v1.list_namespaced_config_map(ns).metadata.resource_version

    v1.create_namespaced_config_map(ns, {"metadata": {"name": name}, "data": {"payload": "x" * 100}})
    assert v1.read_namespaced_config_map(name, ns).data == {"payload": "x" * 100}
    assert name in {cm.metadata.name for cm in v1.list_namespaced_config_map(ns).items}

    events = []
    w = watch.Watch()
    for event in w.stream(
        v1.list_namespaced_config_map, ns, resource_version=start_rv, field_selector=f"metadata.name={name}",
        timeout_seconds=10,
    ):  # fmt: skip
        events.append((event["type"], event["object"].metadata.name))
        w.stop()
    assert events == [("ADDED", name)]
    v1.delete_namespaced_config_map(name, ns)


def test_sync_client_pytorchjob_create_get_list_watch(kube_cluster: KubeCluster, api: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api)
    ns, name = kube_cluster.namespace, unique("pj")
    start_rv = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["metadata"]["resourceVersion"]

    created = custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, pytorchjob(name))
    # The CRD's structural default (runPolicy.suspend) and the name check run in the real apiserver.
    assert created["metadata"]["generation"] == 1
    got = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    assert got["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, label_selector="test=control-plane")
    assert name in {item["metadata"]["name"] for item in listed["items"]}

    w = watch.Watch()
    seen = None
    for event in w.stream(
        custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, resource_version=start_rv,
        field_selector=f"metadata.name={name}", timeout_seconds=10,
    ):  # fmt: skip
        seen = (event["type"], event["object"]["metadata"]["name"])
        w.stop()
    assert seen == ("ADDED", name)

    deleted = custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    assert deleted["kind"] == "Status" and deleted["status"] == "Success"  # unlike pods, which return the object


def test_pytorchjob_status_subresource_is_separate(kube_cluster: KubeCluster, api: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api)
    ns, name = kube_cluster.namespace, unique("pj-status")
    body = pytorchjob(name)
    body["status"] = {"conditions": [{"type": "Created", "status": "True", "reason": "Ignored"}]}
    created = custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    assert "Ignored" not in json.dumps(created.get("status", {}))  # .status in a create body is dropped

    marker = {"type": "Created", "status": "True", "reason": "PyTorchJobCreated", "message": unique("marker")}
    # A /status write persists status and ignores spec changes. Assertions use the write's own response, because
    # the simulated operator may write status right after.
    patched = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, PLURAL, name,
        {"status": {"conditions": [marker]}, "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 3}}}},
    )  # fmt: skip
    assert marker in patched["status"]["conditions"]
    assert patched["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert patched["metadata"]["generation"] == 1

    # A main-resource write ignores status and bumps generation only for the spec change.
    other = {**marker, "message": unique("ignored")}
    main = custom.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, name,
        {"status": {"conditions": [other]}, "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2}}}},
    )  # fmt: skip
    assert other["message"] not in json.dumps(main.get("status", {}))
    assert main["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert main["metadata"]["generation"] == 2
    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def first_watch_line_or_status(call: Any) -> dict[str, Any]:
    """The 410 of a stale watch arrives either as the HTTP status or as a 200 whose first event is an ERROR carrying a
    410 Status (the watch cache answers this way). Normalize both to the Status dict."""
    try:
        resp = call()
    except ApiException as e:
        body: dict[str, Any] = json.loads(e.body)
        return body
    try:
        first: dict[str, Any] = json.loads(next(iter_resp_lines(resp)))
    finally:
        resp.release_conn()
    assert first["type"] == "ERROR", first
    status: dict[str, Any] = first["object"]
    return status


def test_watch_from_stale_resource_version_gets_410(kube_cluster: KubeCluster, api: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api)
    ns = kube_cluster.namespace
    # The pytorchjobs watch cache starts when the CRD is installed, long after revision 1: "1" is always too old.
    # (Not so for built-in resources: their caches start at boot, near revision 1, and 1.20 grows the window
    # dynamically, so "1" may still be served; the fault proxy's expire_watch_next() covers those.)
    status = first_watch_line_or_status(
        lambda: custom.list_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, watch=True, resource_version="1", timeout_seconds=5, _preload_content=False
        )
    )
    assert (status["code"], status["reason"]) == (410, "Expired")

    # Through Watch.stream with a timeout (which disables its one automatic relist) it surfaces as ApiException(410).
    with pytest.raises(ApiException) as excinfo:
        for _ in watch.Watch().stream(
            custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, resource_version="1", timeout_seconds=5
        ):
            pass
    assert excinfo.value.status == 410


def test_async_client_configmap_and_pytorchjob(kube_cluster: KubeCluster) -> None:
    asyncio.run(_async_roundtrip(kube_cluster))


async def _async_roundtrip(kube_cluster: KubeCluster) -> None:
    from kubernetes_asyncio import client as aclient
    from kubernetes_asyncio import config as aconfig
    from kubernetes_asyncio import watch as awatch
    from kubernetes_asyncio.client.rest import ApiException as AsyncApiException

    ns = kube_cluster.namespace
    api_client = await aconfig.new_client_from_config(config_file=str(kube_cluster.kubeconfig))
    async with api_client:
        v1 = aclient.CoreV1Api(api_client)
        custom = aclient.CustomObjectsApi(api_client)

        cm_name = unique("acm")
        start_rv = (await v1.list_namespaced_config_map(ns)).metadata.resource_version
        await v1.create_namespaced_config_map(ns, {"metadata": {"name": cm_name}, "data": {"k": "v"}})  # type: ignore[arg-type]
        assert (await v1.read_namespaced_config_map(cm_name, ns)).data == {"k": "v"}
        assert cm_name in {cm.metadata.name for cm in (await v1.list_namespaced_config_map(ns)).items}
        w = awatch.Watch()
        seen = []
        async for event in w.stream(
            v1.list_namespaced_config_map, ns, resource_version=start_rv,
            field_selector=f"metadata.name={cm_name}", timeout_seconds=10,
        ):  # fmt: skip
            seen.append((event["type"], event["object"].metadata.name))
            w.stop()
        assert seen == [("ADDED", cm_name)]

        pj_name = unique("apj")
        start_rv = (await custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL))["metadata"][
            "resourceVersion"
        ]
        await custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, pytorchjob(pj_name))
        got = await custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, pj_name)
        assert got["metadata"]["name"] == pj_name
        # kubernetes_asyncio picks json-patch for a dict body unless told otherwise (the server then answers 400).
        patched = await custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, pj_name, {"metadata": {"labels": {"patched": "yes"}}},
            _content_type="application/merge-patch+json",  # accepted at runtime; the .pyi stubs omit it
        )  # type: ignore[call-arg]  # fmt: skip
        assert patched["metadata"]["labels"]["patched"] == "yes"
        w = awatch.Watch()
        types = []
        async for event in w.stream(
            custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, resource_version=start_rv,
            field_selector=f"metadata.name={pj_name}", timeout_seconds=10,
        ):  # fmt: skip
            types.append(event["type"])
            if event["object"]["metadata"].get("labels", {}).get("patched") == "yes":
                w.stop()
        assert types[:2] == ["ADDED", "MODIFIED"]

        with pytest.raises(AsyncApiException) as excinfo:
            async for _ in awatch.Watch().stream(
                custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, resource_version="1",
                timeout_seconds=5,
            ):  # fmt: skip
                pass
        assert excinfo.value.status == 410

        await custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, pj_name)
        await v1.delete_namespaced_config_map(cm_name, ns)
