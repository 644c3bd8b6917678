"""Affinity, containers, ports, DNS and mounts are checked before anything runs, by the API server's rules (the
cluster tier compares the two: tests/cluster_tests/test_parse_time_rules.py)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchelastic import PodOptions

HOST: dict[str, Any] = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "train"}}}
GPU_NODES: dict[str, Any] = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100", "h100"]}]}


def _node(required: list[Any] | None = None, preferred: list[Any] | None = None) -> dict[str, Any]:
    node: dict[str, Any] = {}
    if required is not None:
        node["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": required}
    if preferred is not None:
        node["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return {"nodeAffinity": node}


VALID: dict[str, dict[str, Any]] = {
    "node terms": _node([GPU_NODES, {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]),
    "a preferred node": _node(preferred=[{"weight": 100, "preference": GPU_NODES}]),
    "Gt and Exists": _node(
        [
            {
                "matchExpressions": [
                    {"key": "cores", "operator": "Gt", "values": ["8"]},
                    {"key": "x", "operator": "Exists"},
                ]
            }
        ]
    ),
    "Lt with a signed value": _node(
        [{"matchExpressions": [{"key": "gpu-count", "operator": "Lt", "values": ["+16"]}]}]
    ),
    "pods of one version apart": {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{**HOST, "matchLabelKeys": ["pod-template-hash"]}]
        }
    },
    "pods spread over hosts": {
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": HOST}]}
    },
    "pods together in a zone": {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {**HOST, "topologyKey": "topology.kubernetes.io/zone", "namespaces": ["team-a"]}
            ]
        }
    },
    "an empty node affinity": {"nodeAffinity": {}},
}


@pytest.mark.parametrize("affinity", VALID.values(), ids=VALID)
def test_affinities_the_api_server_takes_are_kept_as_given(affinity: dict[str, Any]) -> None:
    assert dict(PodOptions(affinity=affinity).affinity or {}) == affinity


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "a weight of 0": (
        _node(preferred=[{"weight": 0, "preference": GPU_NODES}]),
        "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight: "
        "expected an int from 1 to 100, got 0",
    ),
    "a weight over 100": (
        {
            "podAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 101, "podAffinityTerm": HOST}]
            }
        },
        ".weight: expected an int from 1 to 100, got 101",
    ),
    "no weight": (_node(preferred=[{"preference": GPU_NODES}]), ".weight: expected an int from 1 to 100, got None"),
    "no preference": (_node(preferred=[{"weight": 5}]), ".preference: expected a preference mapping"),
    "no node selector terms": (_node([]), "nodeSelectorTerms: expected at least one node selector term, got []"),
    "In without values": (
        _node([{"matchExpressions": [{"key": "gpu", "operator": "In", "values": []}]}]),
        "nodeSelectorTerms[0].matchExpressions[0].values: expected at least one value with operator In, got []",
    ),
    "Exists with values": (
        _node([{"matchExpressions": [{"key": "gpu", "operator": "Exists", "values": ["a"]}]}]),
        ".values: expected no values with operator Exists, got ['a']",
    ),
    "Gt with two values": (
        _node([{"matchExpressions": [{"key": "cores", "operator": "Gt", "values": ["1", "2"]}]}]),
        ".values: expected exactly one value with operator Gt",
    ),
    "an unknown operator": (
        _node([{"matchExpressions": [{"key": "gpu", "operator": "in", "values": ["a"]}]}]),
        ".operator: expected one of In, NotIn, Exists, DoesNotExist, Gt, Lt, got 'in'",
    ),
    "a key that is no label key": (
        _node([{"matchExpressions": [{"key": "a b", "operator": "Exists"}]}]),
        "matchExpressions[0].key: expected a label key",
    ),
    "a node field other than its name": (
        _node([{"matchFields": [{"key": "metadata.labels", "operator": "In", "values": ["a"]}]}]),
        "matchFields[0].key: expected 'metadata.name'",
    ),
    "a node field with Exists": (
        _node([{"matchFields": [{"key": "metadata.name", "operator": "Exists"}]}]),
        "matchFields[0].operator: expected one of In, NotIn, got 'Exists'",
    ),
    "no topology key": (
        {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}},
        "requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey: expected a node label key",
    ),
    "a Gt in a label selector": (
        {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {**HOST, "labelSelector": {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}}
                ]
            }
        },
        "labelSelector.matchExpressions[0].operator: expected one of In, NotIn, Exists, DoesNotExist, got 'Gt'",
    ),
    "a namespace that is no name": (
        {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{**HOST, "namespaces": ["Team_A"]}]}},
        "namespaces[0]: expected a namespace name",
    ),
    "a label selector value that is no label value": (
        {
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {**HOST, "labelSelector": {"matchLabels": {"a": "b c"}}}
                ]
            }
        },
        "labelSelector.matchLabels['a']: expected a label value",
    ),
    # The API server lets a node term's values through, but the scheduler parses each term into a label selector and
    # one it cannot parse matches no node: the pod would stay Pending for good.
    "a node term value that is no label value": (
        _node([{"matchExpressions": [{"key": "gpu", "operator": "NotIn", "values": ["a100", "h100 sxm"]}]}]),
        "nodeSelectorTerms[0].matchExpressions[0].values[1]: expected a label value",
    ),
    "a Gt value that is no integer": (
        _node(
            preferred=[
                {
                    "weight": 1,
                    "preference": {"matchExpressions": [{"key": "cores", "operator": "Gt", "values": ["8 cores"]}]},
                }
            ]
        ),
        "preference.matchExpressions[0].values[0]: expected an integer (operator Gt compares a node label's value as "
        "a number), got '8 cores'",
    ),
    "an Lt value past int64": (
        _node([{"matchExpressions": [{"key": "memory-gib", "operator": "Lt", "values": [str(2**63)]}]}]),
        "matchExpressions[0].values[0]: expected an integer (operator Lt",
    ),
    "an Lt value with an underscore": (
        _node([{"matchExpressions": [{"key": "memory-gib", "operator": "Lt", "values": ["1_000"]}]}]),
        "matchExpressions[0].values[0]: expected an integer (operator Lt",
    ),
    # The API server checks a pod term's selector values itself (1.27 and later).
    "a label selector expression value that is no label value": (
        {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {**HOST, "labelSelector": {"matchExpressions": [{"key": "a", "operator": "In", "values": ["x/y"]}]}}
                ]
            }
        },
        "labelSelector.matchExpressions[0].values[0]: expected a label value",
    ),
    "a pod term's mismatchLabelKeys that are no label keys": (
        {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{**HOST, "mismatchLabelKeys": ["a b"]}]
            }
        },
        "requiredDuringSchedulingIgnoredDuringExecution[0].mismatchLabelKeys[0]: expected a label key",
    ),
    "an unknown kind of affinity": ({"nodeAffinities": {}}, "affinity: expected only the keys nodeAffinity"),
    "terms not in a list": (
        {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": HOST}},
        "requiredDuringSchedulingIgnoredDuringExecution: expected a list",
    ),
}


@pytest.mark.parametrize(("affinity", "message"), INVALID.values(), ids=INVALID)
def test_an_affinity_the_api_server_refuses_fails_at_parse_time_naming_the_field(
    affinity: dict[str, Any], message: str
) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        PodOptions(affinity=affinity)
    assert message in str(raised.value)
    assert str(raised.value).startswith("PodOptions.affinity")


def test_a_pod_templates_affinity_is_checked_by_the_same_rules() -> None:
    template = {"spec": {"affinity": _node(preferred=[{"weight": 0, "preference": GPU_NODES}])}}
    with pytest.raises(ValueError, match=r"pod_template\.spec\.affinity\.nodeAffinity\.preferred.*weight"):
        PodOptions(pod_template=template)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"containers": [{"name": "Sidecar", "image": "busybox"}]}, "containers['Sidecar'].name: expected a DNS-1123"),
        ({"initContainers": [{"image": "busybox"}]}, "initContainers: expected a list of containers, each with a name"),
        (
            {"containers": [{"name": "a", "image": "x"}], "initContainers": [{"name": "a", "image": "x"}]},
            "containers and initContainers: expected unique names (this one is given twice), got 'a'",
        ),
        ({"dnsPolicy": "ClusterFirstWithHostnet"}, "dnsPolicy: expected one of ClusterFirst, ClusterFirstWithHostNet"),
        ({"dnsPolicy": "None"}, "dnsConfig: expected nameservers when dnsPolicy is 'None', got None"),
        (
            {
                "containers": [
                    {"name": "m", "image": "x:1", "ports": [{"name": "prometheus-metrics", "containerPort": 1}]}
                ]
            },
            "containers['m'].ports[0].name: expected a port name: <= 15 of [-a-z0-9]",
        ),
        (
            {"containers": [{"name": "m", "image": "x:1", "ports": [{"containerPort": 70000}]}]},
            "containers['m'].ports[0].containerPort: expected a port number from 1 to 65535, got 70000",
        ),
        (
            {"initContainers": [{"name": "m", "image": "x:1", "ports": [{"containerPort": 1, "protocol": "tcp"}]}]},
            "initContainers['m'].ports[0].protocol: expected one of TCP, UDP, SCTP, got 'tcp'",
        ),
        (
            {
                "containers": [
                    {"name": "m", "image": "x:1", "ports": [{"name": "a", "containerPort": p} for p in (1, 2)]}
                ]
            },
            "containers['m'].ports (name): expected unique names (this one is given twice), got 'a'",
        ),
    ],
)
def test_pod_template_containers_ports_and_dns_are_checked_at_parse_time(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        PodOptions(pod_template={"spec": spec})
    assert message in str(raised.value)


def test_a_pod_template_with_valid_sidecars_ports_and_dns_is_kept() -> None:
    spec = {
        "initContainers": [{"name": "fetch-data", "image": "busybox"}],
        "containers": [
            {
                "name": "log-shipper",
                "image": "fluent/fluent-bit:3.0",
                "ports": [{"name": "http", "containerPort": 2020}],
            }
        ],
        "dnsPolicy": "None",
        "dnsConfig": {"nameservers": ["10.0.0.10"]},
    }
    assert dict(PodOptions(pod_template={"spec": spec}).template["spec"]) == spec


def test_every_containers_mounts_must_name_a_volume_of_the_pod() -> None:
    from airflow_provider_torchelastic import Elastic
    from airflow_provider_torchelastic.kubernetes.render import check_renderable

    def render(spec: dict[str, Any], **options: Any) -> None:
        pod_options = PodOptions(pod_template={"spec": spec}, **options)
        check_renderable(Elastic(), image="registry.example.com/train:1", pod_options=pod_options)

    sidecar = {
        "name": "shipper",
        "image": "fluent/fluent-bit:3.0",
        "volumeMounts": [{"name": "logs", "mountPath": "/l"}],
    }
    with pytest.raises(ValueError, match=r"containers\['shipper'\]\.volumeMounts\['/l'\]\.name: expected a pod volume"):
        render({"containers": [sidecar]})
    with pytest.raises(ValueError, match=r"initContainers\['shipper'\]\.volumeMounts\['/l'\]\.name: expected a pod"):
        render({"initContainers": [sidecar]})
    render({"containers": [sidecar]}, volumes=[{"name": "logs", "emptyDir": {}}])  # the volume from PodOptions
    render({"initContainers": [sidecar], "volumes": [{"name": "logs", "emptyDir": {}}]})  # or from the template


ZONE_SPREAD: dict[str, Any] = {
    "maxSkew": 1,
    "topologyKey": "topology.kubernetes.io/zone",
    "whenUnsatisfiable": "DoNotSchedule",
    "labelSelector": {"matchLabels": {"app": "train"}},
}


@pytest.mark.parametrize(
    ("constraints", "message"),
    [
        ([{**ZONE_SPREAD, "maxSkew": 0}], "topologySpreadConstraints[0].maxSkew: expected an int >= 1, got 0"),
        ([{**ZONE_SPREAD, "topologyKey": ""}], "topologySpreadConstraints[0].topologyKey: expected a node label key"),
        ([{**ZONE_SPREAD, "whenUnsatisfiable": "Never"}], "whenUnsatisfiable: expected one of DoNotSchedule, Schedule"),
        ([ZONE_SPREAD, {**ZONE_SPREAD, "maxSkew": 2}], "[1]: expected one constraint per topologyKey and whenUnsat"),
        ([{**ZONE_SPREAD, "minDomains": 0}], "minDomains: expected an int >= 1, with whenUnsatisfiable DoNotSchedule"),
        (
            [{**ZONE_SPREAD, "whenUnsatisfiable": "ScheduleAnyway", "minDomains": 2}],
            "minDomains: expected an int >= 1, with whenUnsatisfiable DoNotSchedule, got 2",
        ),
        (ZONE_SPREAD, "topologySpreadConstraints: expected a list"),
        (
            [{**ZONE_SPREAD, "labelSelector": {"matchLabels": {"app": "train job"}}}],
            "topologySpreadConstraints[0].labelSelector.matchLabels['app']: expected a label value",
        ),
        (
            [{**ZONE_SPREAD, "labelSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]}}],
            "labelSelector.matchExpressions[0].values: expected at least one value with operator In, got []",
        ),
        ([{**ZONE_SPREAD, "matchLabelKeys": "pod-template-hash"}], "matchLabelKeys: expected a list of label keys"),
        (
            [{**ZONE_SPREAD, "matchLabelKeys": ["a b"]}],
            "topologySpreadConstraints[0].matchLabelKeys[0]: expected a label",
        ),
    ],
)
def test_topology_spread_constraints_are_checked_at_parse_time(constraints: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        PodOptions(pod_template={"spec": {"topologySpreadConstraints": constraints}})
    assert message in str(raised.value)


def test_valid_topology_spread_constraints_are_kept() -> None:
    constraints = [ZONE_SPREAD, {**ZONE_SPREAD, "whenUnsatisfiable": "ScheduleAnyway", "maxSkew": 3}]
    constraints.append({**ZONE_SPREAD, "topologyKey": "kubernetes.io/hostname", "minDomains": 2})
    constraints.append({**ZONE_SPREAD, "topologyKey": "rack", "matchLabelKeys": ["pod-template-hash"]})
    selector = {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["eval", ""]}]}
    constraints.append({**ZONE_SPREAD, "topologyKey": "node.kubernetes.io/instance-type", "labelSelector": selector})
    template = PodOptions(pod_template={"spec": {"topologySpreadConstraints": constraints}}).template
    assert template["spec"]["topologySpreadConstraints"] == constraints
