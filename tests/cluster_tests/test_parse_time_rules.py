"""The parse-time checks of pod options against the real API server's: for each case, the provider refuses it when
the DAG is parsed exactly when kube-apiserver refuses the same fields in a Pod, and a rendered Pod that the provider
accepts is admitted (dry runs: nothing is created)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from airflow_provider_torchelastic.core.config import Elastic
from airflow_provider_torchelastic.core.pod_options import PodOptions
from airflow_provider_torchelastic.kubernetes.render import check_renderable
from tests.cluster.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster

IMAGE = "registry.example.com/ml/train:1.0"

#: (requests, limits) of the training container.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "cpu in millicores": ({"cpu": "500m"}, {}),
    "a negative cpu request": ({"cpu": "-1"}, {}),
    "a negative memory limit": ({}, {"memory": "-1Gi"}),
    "a fraction of a GPU": ({"nvidia.com/gpu": "1.5"}, {"nvidia.com/gpu": "1.5"}),
    "two GPUs": ({"nvidia.com/gpu": "2"}, {"nvidia.com/gpu": 2}),
    "two GPUs written 2.0": ({"nvidia.com/gpu": "2.0"}, {"nvidia.com/gpu": "2.0"}),
    "a GPU request below its limit": ({"nvidia.com/gpu": 1}, {"nvidia.com/gpu": 2}),
    "a device plugin's resource, limit only": ({}, {"example.com/fpga": "1"}),
    "a resource name without a domain that containers do not have": ({"storage": "1Gi"}, {}),
    "hugepages without a limit": ({"hugepages-2Mi": "4Mi"}, {"memory": "1Gi"}),
    "hugepages with memory": ({"hugepages-2Mi": "4Mi", "memory": "1Gi"}, {"hugepages-2Mi": "4Mi", "memory": "1Gi"}),
    "hugepages without cpu or memory": ({}, {"hugepages-2Mi": "4Mi"}),
}


def _provider_accepts(requests: dict[str, Any], limits: dict[str, Any]) -> bool:
    try:
        check_renderable(Elastic(), image=IMAGE, pod_options=PodOptions(requests=requests, limits=limits))
    except (ValueError, TypeError):
        return False
    return True


def _api_accepts(api: client.CoreV1Api, namespace: str, requests: dict[str, Any], limits: dict[str, Any]) -> bool:
    resources = {"requests": {k: str(v) for k, v in requests.items()}, "limits": {k: str(v) for k, v in limits.items()}}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "resources"},
        "spec": {"containers": [{"name": "c", "image": IMAGE, "resources": resources}]},
    }
    try:
        api.create_namespaced_pod(namespace, pod, dry_run="All")
    except ApiException as e:
        assert e.status == 422, e.body
        return False
    return True


def test_the_provider_refuses_at_parse_time_what_the_api_server_refuses(kube_cluster: KubeCluster) -> None:
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api_client:
        api = client.CoreV1Api(api_client)
        verdicts = {
            case: (_api_accepts(api, kube_cluster.namespace, *resources), _provider_accepts(*resources))
            for case, resources in CASES.items()
        }
        disagreements = {case: verdict for case, verdict in verdicts.items() if verdict[0] != verdict[1]}
        assert not disagreements, f"(API server, provider) accepts: {disagreements}"
        # Both sides are exercised: the cases are not all accepted, nor all refused.
        assert {api for api, _ in verdicts.values()} == {True, False}
        for case, (requests, limits) in CASES.items():
            if verdicts[case][0]:  # the provider's own rendered Pod, not only its resources, is admitted
                options = PodOptions(requests=requests, limits=limits)
                namespace = kube_cluster.namespace
                pod = check_renderable(Elastic(), image=IMAGE, pod_options=options, namespace=namespace)[-1]
                assert pod["kind"] == "Pod", pod["kind"]
                api.create_namespaced_pod(namespace, pod, dry_run="All")


#: PodOptions fields beyond resources: (tolerations, volume mounts of one volume "v").
FIELD_CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {
    "a toleration value": ([{"key": "pool", "operator": "Equal", "value": "spot-1"}], []),
    "a toleration value with a space": ([{"key": "pool", "operator": "Equal", "value": "a b"}], []),
    "a relative subPath": ([], [{"name": "v", "mountPath": "/v", "subPath": "data/x"}]),
    "an absolute subPath": ([], [{"name": "v", "mountPath": "/v", "subPath": "/data"}]),
    "a subPath out of its volume": ([], [{"name": "v", "mountPath": "/v", "subPath": "data/../.."}]),
    "a subPath with two dots in a name": ([], [{"name": "v", "mountPath": "/v", "subPath": "data..x"}]),
}


def test_tolerations_and_sub_paths_are_refused_at_parse_time_as_the_api_server_refuses_them(
    kube_cluster: KubeCluster,
) -> None:
    volumes = [{"name": "v", "emptyDir": {}}]
    verdicts = {}
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api_client:
        api = client.CoreV1Api(api_client)
        for case, (tolerations, mounts) in FIELD_CASES.items():
            container = {"name": "c", "image": IMAGE, "volumeMounts": mounts}
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "fields"},
                "spec": {"containers": [container], "tolerations": tolerations, "volumes": volumes},
            }
            try:
                api.create_namespaced_pod(kube_cluster.namespace, pod, dry_run="All")
                api_accepts = True
            except ApiException as e:
                assert e.status == 422, e.body
                api_accepts = False
            try:
                options = PodOptions(tolerations=tolerations, volumes=volumes, volume_mounts=mounts)
                check_renderable(Elastic(), image=IMAGE, pod_options=options)
                provider_accepts = True
            except (ValueError, TypeError):
                provider_accepts = False
            verdicts[case] = (api_accepts, provider_accepts)
    disagreements = {case: verdict for case, verdict in verdicts.items() if verdict[0] != verdict[1]}
    assert not disagreements, f"(API server, provider) accepts: {disagreements}"
    assert {api for api, _ in verdicts.values()} == {True, False}
