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


def _provider_renders(**options: Any) -> bool:
    """Whether the provider takes these pod options, from the DAG file to a rendered job."""
    try:
        check_renderable(Elastic(), image=IMAGE, pod_options=PodOptions(**options))
    except (ValueError, TypeError):
        return False
    return True


def _provider_accepts(requests: dict[str, Any], limits: dict[str, Any]) -> bool:
    return _provider_renders(requests=requests, limits=limits)


def _api_admits(api: client.CoreV1Api, namespace: str, spec: dict[str, Any]) -> bool:
    """Whether the API server admits a Pod of this spec (a dry run); a refusal must be a 422 (invalid)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "fields"}, "spec": spec}
    try:
        api.create_namespaced_pod(namespace, pod, dry_run="All")
    except ApiException as e:
        assert e.status == 422, e.body
        return False
    return True


def _api_accepts(api: client.CoreV1Api, namespace: str, requests: dict[str, Any], limits: dict[str, Any]) -> bool:
    resources = {"requests": {k: str(v) for k, v in requests.items()}, "limits": {k: str(v) for k, v in limits.items()}}
    return _api_admits(api, namespace, {"containers": [{"name": "c", "image": IMAGE, "resources": resources}]})


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

UNKNOWN_SOURCE = "a source named as kubectl abbreviates it"
#: Volumes (one, named "v"): its source.
VOLUME_CASES: dict[str, dict[str, Any]] = {
    "a claim": {"persistentVolumeClaim": {"claimName": "data", "readOnly": True}},
    "a claim without its name": {"persistentVolumeClaim": {"readOnly": True}},
    UNKNOWN_SOURCE: {"pvc": {"claimName": "data"}},
    "a Secret": {"secret": {"secretName": "creds", "defaultMode": 256}},
    "a Secret named as a ConfigMap is": {"secret": {"name": "creds"}},
    "a ConfigMap": {"configMap": {"name": "settings"}},
    "a ConfigMap without its name": {"configMap": {"optional": True}},
    "a host path": {"hostPath": {"path": "/mnt/data", "type": "Directory"}},
    "a host path without its path": {"hostPath": {"type": "Directory"}},
    "NFS without a path": {"nfs": {"server": "nas.example.com"}},
    "a CSI volume without a driver": {"csi": {"readOnly": True}},
}


def test_volume_sources_are_refused_at_parse_time_as_the_api_server_refuses_them(kube_cluster: KubeCluster) -> None:
    verdicts = {}
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api_client:
        api = client.CoreV1Api(api_client)
        for case, source in VOLUME_CASES.items():
            volumes = [{"name": "v", **source}]
            spec = {"containers": [{"name": "c", "image": IMAGE}], "volumes": volumes}
            verdicts[case] = (_api_admits(api, kube_cluster.namespace, spec), _provider_renders(volumes=volumes))
        # The one case where the provider is stricter, on purpose: the API server drops a source it does not know
        # and defaults a volume of no source to an emptyDir, so the claim meant would silently not be mounted.
        volume = {"name": "v", **VOLUME_CASES[UNKNOWN_SOURCE]}
        spec = {"containers": [{"name": "c", "image": IMAGE}], "volumes": [volume]}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "v"}, "spec": spec}
        admitted = api.create_namespaced_pod(kube_cluster.namespace, pod, dry_run="All")
        assert (
            admitted.spec.volumes[0].empty_dir is not None and admitted.spec.volumes[0].persistent_volume_claim is None
        )
    assert verdicts.pop(UNKNOWN_SOURCE) == (True, False)
    disagreements = {case: verdict for case, verdict in verdicts.items() if verdict[0] != verdict[1]}
    assert not disagreements, f"(API server, provider) accepts: {disagreements}"
    assert {api for api, _ in verdicts.values()} == {True, False}


def test_tolerations_and_sub_paths_are_refused_at_parse_time_as_the_api_server_refuses_them(
    kube_cluster: KubeCluster,
) -> None:
    volumes = [{"name": "v", "emptyDir": {}}]
    verdicts = {}
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api_client:
        api = client.CoreV1Api(api_client)
        for case, (tolerations, mounts) in FIELD_CASES.items():
            container = {"name": "c", "image": IMAGE, "volumeMounts": mounts}
            spec = {"containers": [container], "tolerations": tolerations, "volumes": volumes}
            api_accepts = _api_admits(api, kube_cluster.namespace, spec)
            provider_accepts = _provider_renders(tolerations=tolerations, volumes=volumes, volume_mounts=mounts)
            verdicts[case] = (api_accepts, provider_accepts)
    disagreements = {case: verdict for case, verdict in verdicts.items() if verdict[0] != verdict[1]}
    assert not disagreements, f"(API server, provider) accepts: {disagreements}"
    assert {api for api, _ in verdicts.values()} == {True, False}


_NODE_TERM: dict[str, Any] = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}
_HOST: dict[str, Any] = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "t"}}}


def _preferred_node(weight: int, term: dict[str, Any]) -> dict[str, Any]:
    preferred = [{"weight": weight, "preference": term}]
    return {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}}


def _required_pods(kind: str, term: dict[str, Any]) -> dict[str, Any]:
    return {"affinity": {kind: {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}}


_ZONE: dict[str, Any] = {
    "maxSkew": 1,
    "topologyKey": "topology.kubernetes.io/zone",
    "whenUnsatisfiable": "DoNotSchedule",
}


def _spread(changes: dict[str, Any]) -> dict[str, Any]:
    # minDomains is left out: kube-apiserver 1.20 predates it (and drops it unchecked).
    return {"topologySpreadConstraints": [{**_ZONE, **changes}]}


def _sidecar_ports(*ports: dict[str, Any]) -> dict[str, Any]:
    return {"containers": [{"name": "metrics", "image": IMAGE, "ports": list(ports)}]}


#: Pod spec fields, given in the pod template (and, for affinity, as ``PodOptions.affinity`` too).
SPEC_CASES: dict[str, dict[str, Any]] = {
    "a preferred node": _preferred_node(50, _NODE_TERM),
    "a weight of 0": _preferred_node(0, _NODE_TERM),
    "a weight of 101": _preferred_node(101, _NODE_TERM),
    "In without values": _preferred_node(1, {"matchExpressions": [{"key": "gpu", "operator": "In", "values": []}]}),
    "Exists with values": _preferred_node(
        1, {"matchExpressions": [{"key": "g", "operator": "Exists", "values": ["a"]}]}
    ),
    "Lt with one value": _preferred_node(1, {"matchExpressions": [{"key": "n", "operator": "Lt", "values": ["4"]}]}),
    "Lt with two values": _preferred_node(
        1, {"matchExpressions": [{"key": "n", "operator": "Lt", "values": ["4", "5"]}]}
    ),
    "a lowercase operator": _preferred_node(1, {"matchExpressions": [{"key": "g", "operator": "exists"}]}),
    "a key with a space": _preferred_node(1, {"matchExpressions": [{"key": "a b", "operator": "Exists"}]}),
    "a node name field": _preferred_node(
        1, {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}
    ),
    "a node label field": _preferred_node(
        1, {"matchFields": [{"key": "metadata.labels", "operator": "In", "values": ["n"]}]}
    ),
    "no node selector terms": {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    },
    "pods on one host": _required_pods("podAffinity", _HOST),
    "pods apart, in named namespaces": _required_pods("podAntiAffinity", {**_HOST, "namespaces": ["team-a"]}),
    "no topology key": _required_pods("podAffinity", {"labelSelector": {}}),
    "a namespace in capitals": _required_pods("podAffinity", {**_HOST, "namespaces": ["Team"]}),
    "a Gt in a label selector": _required_pods(
        "podAffinity",
        {**_HOST, "labelSelector": {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}},
    ),
    "a sidecar": {"containers": [{"name": "log-shipper", "image": IMAGE}]},
    "a sidecar named in capitals": {"containers": [{"name": "Sidecar", "image": IMAGE}]},
    "an init container named as a container": {"initContainers": [{"name": "c", "image": IMAGE}]},
    "a named port": _sidecar_ports({"name": "metrics", "containerPort": 9090}),
    "a port name of 17 characters": _sidecar_ports({"name": "prometheus-metric", "containerPort": 9090}),
    "a port name in capitals": _sidecar_ports({"name": "Metrics", "containerPort": 9090}),
    "a port name of digits": _sidecar_ports({"name": "9090", "containerPort": 9090}),
    "a port name with two hyphens": _sidecar_ports({"name": "a--b", "containerPort": 9090}),
    "port 0": _sidecar_ports({"containerPort": 0}),
    "port 65536": _sidecar_ports({"containerPort": 65536}),
    "a host port": _sidecar_ports({"containerPort": 80, "hostPort": 8080, "protocol": "UDP"}),
    "a negative host port": _sidecar_ports({"containerPort": 80, "hostPort": -1}),
    "a lowercase protocol": _sidecar_ports({"containerPort": 80, "protocol": "tcp"}),
    "an empty name and protocol": _sidecar_ports({"name": "", "containerPort": 80, "protocol": ""}),
    "two ports of one name": _sidecar_ports({"name": "a", "containerPort": 1}, {"name": "a", "containerPort": 2}),
    "a sidecar mounting a volume the pod lacks": {
        "containers": [{"name": "metrics", "image": IMAGE, "volumeMounts": [{"name": "none", "mountPath": "/n"}]}]
    },
    "an init container mounting a volume of the pod": {
        "initContainers": [{"name": "fetch", "image": IMAGE, "volumeMounts": [{"name": "data", "mountPath": "/d"}]}],
        "volumes": [{"name": "data", "emptyDir": {}}],
    },
    "a zone spread": _spread({}),
    "a spread of skew 0": _spread({"maxSkew": 0}),
    "a spread without a topology key": _spread({"topologyKey": ""}),
    "a spread that never gives up": _spread({"whenUnsatisfiable": "Never"}),
    "two spreads of one key": {"topologySpreadConstraints": [_ZONE, {**_ZONE, "maxSkew": 2}]},
    "two spreads of one key, one of them soft": {
        "topologySpreadConstraints": [_ZONE, {**_ZONE, "whenUnsatisfiable": "ScheduleAnyway"}]
    },
    "a known DNS policy": {"dnsPolicy": "ClusterFirstWithHostNet"},
    "an empty DNS policy": {"dnsPolicy": ""},
    "an unknown DNS policy": {"dnsPolicy": "Cluster"},
    "DNS policy None without a config": {"dnsPolicy": "None"},
    "DNS policy None with nameservers": {"dnsPolicy": "None", "dnsConfig": {"nameservers": ["10.0.0.10"]}},
}


def test_scheduling_containers_and_dns_are_refused_at_parse_time_as_the_api_server_refuses_them(
    kube_cluster: KubeCluster,
) -> None:
    verdicts = {}
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api_client:
        api = client.CoreV1Api(api_client)
        for case, fields in SPEC_CASES.items():
            # The same spec both ways: beside the provider's own "pytorch" container, a sidecar "c" (a name an init
            # container's may clash with).
            spec = {**fields, "containers": [{"name": "c", "image": IMAGE}, *fields.get("containers", [])]}
            api_accepts = _api_admits(api, kube_cluster.namespace, spec)
            provider_accepts = _provider_renders(pod_template={"spec": spec})
            if set(fields) == {"affinity"}:
                assert _provider_renders(affinity=fields["affinity"]) == provider_accepts, case
            verdicts[case] = (api_accepts, provider_accepts)
    disagreements = {case: verdict for case, verdict in verdicts.items() if verdict[0] != verdict[1]}
    assert not disagreements, f"(API server, provider) accepts: {disagreements}"
    assert {api for api, _ in verdicts.values()} == {True, False}
