"""Property-based contracts: configurations drawn from the whole valid space render objects every contract accepts;
invalid ones are refused when they are constructed (DAG-parse time), with a message naming the field.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_torchelastic.core.config import (
    CleanPodPolicy,
    Elastic,
    Master,
    PyTorch,
    RestartPolicy,
    RunPolicy,
    TaskConfig,
    Worker,
)
from airflow_provider_torchelastic.core.naming import RunIdentity
from airflow_provider_torchelastic.core.pod_options import (
    UNSET,
    JobOptions,
    PodOptions,
    config_map_key_ref,
    secret_key_ref,
)
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.render import (
    UI_FOOTER,
    UI_SUMMARY_LIMIT,
    render_manifests,
    summarize_for_ui,
)
from tests.contract.schemas import validate_rendered

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------------ building blocks

dns_label = st.from_regex(r"\A[a-z]([-a-z0-9]{0,20}[a-z0-9])?\Z")
image = st.sampled_from(["img:1", "registry.example.com/ml/train:2.6-cuda12", "ghcr.io/a/b@sha256:" + "a" * 64])
label_value = st.from_regex(r"\A([A-Za-z0-9]([-_.A-Za-z0-9]{0,20}[A-Za-z0-9])?)?\Z")
env_name = st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,12}\Z").filter(
    lambda n: not n.startswith("PET_") and n not in {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}
)
optional = st.none() | st.booleans()


def user_key(prefix: str) -> st.SearchStrategy[str]:
    return st.from_regex(r"\A[a-z]([-a-z0-9]{0,10}[a-z0-9])?\Z").map(lambda name: f"{prefix}/{name}")


def nnodes() -> st.SearchStrategy[int | str]:
    pairs = st.tuples(st.integers(1, 6), st.integers(0, 6)).map(lambda p: f"{p[0]}:{p[0] + p[1]}")
    return st.integers(1, 6) | pairs


nproc = st.integers(1, 16) | st.sampled_from(["auto", "cpu", "gpu", "4"])
run_policy = st.none() | st.builds(
    RunPolicy,
    clean_pod_policy=st.none() | st.sampled_from(CleanPodPolicy),
    ttl_seconds_after_finished=st.none() | st.integers(0, 10**6),
    active_deadline_seconds=st.none() | st.integers(1, 10**6),
    backoff_limit=st.none() | st.integers(0, 10),
)

# Options (operator level) and replicas use disjoint resource names, so that merged requests never exceed limits.
option_resources = st.integers(1, 64).flatmap(
    lambda limit: st.fixed_dictionaries(
        {},
        optional={
            "requests": st.integers(1, limit).map(lambda r: {"memory": f"{r}Gi", "ephemeral-storage": f"{r}Gi"}),
            "limits": st.just({"memory": f"{limit}Gi"}),
        },
    )
)
replica_resources = st.integers(1, 8).flatmap(
    lambda gpus: st.fixed_dictionaries(
        {},
        optional={
            "requests": st.sampled_from([{"cpu": "500m"}, {"cpu": "2", "nvidia.com/gpu": gpus}]),
            "limits": st.just({"cpu": "4", "nvidia.com/gpu": gpus}),
        },
    ).filter(lambda r: "nvidia.com/gpu" not in r.get("requests", {}) or "limits" in r)
)

env_value: st.SearchStrategy[Any] = (
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
    | st.builds(secret_key_ref, dns_label, env_name, optional=optional)
    | st.builds(config_map_key_ref, dns_label, env_name, optional=optional)
    | st.just({"fieldRef": {"fieldPath": "metadata.name"}})
    | st.just({"resourceFieldRef": {"resource": "limits.memory", "containerName": "pytorch"}})
)
env_from = st.lists(
    st.builds(lambda kind, name: {kind: {"name": name}}, st.sampled_from(["secretRef", "configMapRef"]), dns_label)
    | st.builds(lambda name: {"secretRef": {"name": name, "optional": True}, "prefix": "S_"}, dns_label),
    max_size=3,
)
toleration = st.one_of(
    st.builds(
        lambda key, effect: {"key": key, "operator": "Exists", **({"effect": effect} if effect else {})},
        st.sampled_from(["nvidia.com/gpu", "dedicated", "example.com/spot"]),
        st.none() | st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
    ),
    st.builds(lambda v: {"key": "dedicated", "operator": "Equal", "value": v, "effect": "NoSchedule"}, label_value),
    st.just({"operator": "Exists"}),
    st.builds(
        lambda s: {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": s,
        },
        st.integers(0, 3600),
    ),
)
affinity = st.sampled_from(
    [
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]
                }
            }
        },
        {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 50,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": {"app": "train"}},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        },
    ]
)
# Volume definitions are fixed per name, so that options at two levels never disagree about one volume.
VOLUMES = {
    "data": {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
    "scratch": {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}},
    "creds": {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
    "conf": {"name": "conf", "configMap": {"name": "conf"}},
}


@st.composite
def volumes_and_mounts(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(VOLUMES)), unique=True, max_size=3))
    mounts = [
        {"name": name, "mountPath": f"/mnt/{name}", **({"readOnly": True} if draw(st.booleans()) else {})}
        for name in names
        if draw(st.booleans())
    ]
    return {"volumes": [VOLUMES[name] for name in names], "volume_mounts": mounts}


pod_template = st.none() | st.sampled_from(
    [
        {"spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000}}},
        {"metadata": {"labels": {"tpl.example.com/team": "ml"}}, "spec": {"hostIPC": True}},
        {
            "spec": {
                "containers": [
                    {"name": "pytorch", "workingDir": "/workspace", "securityContext": {"privileged": False}},
                    {"name": "logger", "image": "fluent/bit:3", "resources": {"limits": {"cpu": "100m"}}},
                ],
                "initContainers": [{"name": "warm", "image": "busybox:1", "command": ["sh", "-c", "true"]}],
            }
        },
        {"metadata": {"annotations": {"tpl.example.com/note": "x"}}, "spec": {"dnsPolicy": "ClusterFirstWithHostNet"}},
    ]
)


@st.composite
def pod_options(draw: st.DrawFn, *, resources: bool = True) -> PodOptions:
    """``resources=False`` for per-replica options: the operator-level options own these resource names, and a
    replica limit below an operator-level request is an invalid combination (refused at construction)."""
    env = draw(st.dictionaries(env_name, env_value, max_size=4))
    as_list = draw(st.booleans())
    return PodOptions(
        image_pull_policy=draw(st.none() | st.sampled_from(["Always", "IfNotPresent", "Never"])),
        image_pull_secrets=draw(st.lists(dns_label, max_size=2)),
        env=[{"name": k, **({"value": v} if isinstance(v, str) else {"valueFrom": v})} for k, v in env.items()]
        if as_list
        else env,
        env_from=draw(env_from),
        node_selector=draw(st.dictionaries(user_key("node.example.com"), label_value, max_size=2)),
        tolerations=draw(st.lists(toleration, max_size=3)),
        affinity=draw(st.none() | affinity),
        service_account_name=draw(st.none() | dns_label),
        labels=draw(
            st.dictionaries(user_key("opt.example.com") | st.just("kueue.x-k8s.io/queue-name"), label_value, max_size=3)
        ),
        annotations=draw(st.dictionaries(user_key("opt.example.com"), st.text(max_size=30), max_size=3)),
        priority_class_name=draw(st.none() | dns_label),
        shm_size=draw(st.sampled_from([UNSET, None, "64Mi", "2Gi", "500M"])),
        pod_template=draw(pod_template),
        **draw(volumes_and_mounts()),
        **draw(option_resources if resources else st.just({})),
    )


def replica(cls: type[Master] | type[Worker], **extra: Any) -> st.SearchStrategy[Any]:
    return st.builds(
        lambda resources, **kw: cls(**resources, **kw, **extra),
        replica_resources,
        image=st.none() | image,
        restart_policy=st.sampled_from(RestartPolicy),
        pod=st.none() | pod_options(resources=False),
    )


# One node is a plain Pod, which honours only the deadline of a RunPolicy (Elastic refuses the rest).
single_node_run_policy = st.none() | st.builds(RunPolicy, active_deadline_seconds=st.none() | st.integers(1, 10**6))
elastic = nnodes().flatmap(
    lambda n: st.builds(
        Elastic,
        nnodes=st.just(n),
        nproc_per_node=nproc,
        start_method=st.sampled_from(["spawn", "fork"]),
        monitor_interval=st.sampled_from([0.1, 1, 5, 30.0]),
        max_restarts=st.integers(0, 5),
        rdzv_configs=st.dictionaries(
            st.sampled_from(["timeout", "join_timeout", "last_call_timeout"]), st.integers(1, 3600)
        ),
        run_policy=single_node_run_policy if str(n).split(":")[-1] == "1" else run_policy,
    )
)
pytorch = st.integers(0, 6).flatmap(
    lambda workers: st.builds(
        PyTorch,
        master=replica(Master),
        worker=replica(Worker, replicas=workers),
        run_policy=run_policy,
        nproc_per_node=nproc,
        start_method=st.sampled_from(["spawn", "fork"]),
    )
)
job_options = st.builds(
    JobOptions,
    suspend=st.booleans(),
    scheduling_policy=st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "minAvailable": st.integers(0, 10),
            "queue": dns_label,
            "priorityClass": dns_label,
            "scheduleTimeoutSeconds": st.integers(0, 3600),
            "minResources": st.just({"cpu": "8", "nvidia.com/gpu": 4}),
        },
    ),
)
identity = st.builds(
    RunIdentity,
    dag_id=st.text(min_size=1, max_size=250),
    task_id=st.text(min_size=1, max_size=250),
    run_id=st.text(min_size=1, max_size=250),
    map_index=st.integers(-1, 100_000),
    try_number=st.integers(0, 1000),
)


@SETTINGS
@given(
    config=elastic | pytorch,
    options=st.none() | pod_options(),
    job=st.none() | job_options,
    who=identity,
    payload=st.binary(max_size=64),
    operator_image=image,
)
def test_every_valid_configuration_renders_what_the_cluster_accepts(
    config: TaskConfig,
    options: PodOptions | None,
    job: JobOptions | None,
    who: RunIdentity,
    payload: bytes,
    operator_image: str,
) -> None:
    if kinds.for_config(config) is kinds.POD:
        job = None  # job options are refused for a single Pod (tested in test_render_contract)
    manifests = render_manifests(
        config,
        identity=who,
        namespace="ml",
        image=operator_image,
        payload=payload,
        pod_options=options,
        job_options=job,
    )
    validate_rendered(manifests)
    assert manifests == render_manifests(
        config,
        identity=who,
        namespace="ml",
        image=operator_image,
        payload=payload,
        pod_options=options,
        job_options=job,
    )
    summary = summarize_for_ui(manifests)
    assert len(summary) <= UI_SUMMARY_LIMIT and summary.endswith(UI_FOOTER + "\n")
    documents = list(yaml.safe_load_all(summary))  # whatever level of detail fitted, it is valid YAML
    if len(documents) == 2:
        assert documents[1] == manifests[1]


# ---------------------------------------------------------------------------------------------- invalid

not_label_value = st.text(min_size=1, max_size=80).filter(
    lambda v: (
        len(v) > 63
        or not all(c in string.ascii_letters + string.digits + "-_." for c in v)
        or not v[0].isalnum()
        or not v[-1].isalnum()
    )
)

INVALID: dict[str, tuple[Callable[[Any], object], st.SearchStrategy[Any]]] = {
    "image_pull_policy": (
        lambda v: PodOptions(image_pull_policy=v),
        st.text().filter(lambda v: v not in ("Always", "IfNotPresent", "Never")),
    ),
    "env": (
        lambda v: PodOptions(env={v: "x"}),
        st.text().filter(lambda v: not v or v[0].isdigit() or "=" in v or " " in v),
    ),
    "env value": (lambda v: PodOptions(env={"A": v}), st.integers() | st.floats() | st.lists(st.text(), max_size=2)),
    "labels": (lambda v: PodOptions(labels={"example.com/x": v}), not_label_value),
    "node_selector": (lambda v: PodOptions(node_selector={"k": v}), not_label_value),
    "tolerations": (
        lambda v: PodOptions(tolerations=[{"key": "k", "operator": v}]),
        st.text().filter(lambda v: v not in ("Exists", "Equal")),
    ),
    "volumes": (
        lambda v: PodOptions(volumes=[{"name": v, "emptyDir": {}}]),
        # Not a DNS-1123 label ("0" or "a-1" are valid labels, so isalnum/islower are not the rule).
        st.text().filter(lambda v: len(v) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", v)),
    ),
    "volume_mounts": (
        lambda v: PodOptions(volume_mounts=[{"name": "a", "mountPath": v}]),
        st.text().filter(lambda v: not v.startswith("/")),
    ),
    "shm_size": (lambda v: PodOptions(shm_size=v), st.sampled_from(["lots", "0", "-1Gi", "1GB", ""]) | st.booleans()),
    "service_account_name": (
        lambda v: PodOptions(service_account_name=v),
        st.text().filter(lambda v: v != v.lower() or not v or "_" in v),
    ),
    "requests": (lambda v: PodOptions(requests={"cpu": v}), st.sampled_from(["fast", "1 cpu", "", "1.2.3"])),
    "restartPolicy": (
        lambda v: PodOptions(pod_template={"spec": {"restartPolicy": v}}),
        st.sampled_from(["Always", "Never"]),
    ),
    "affinity": (
        lambda v: PodOptions(affinity={v: {}}),
        st.text().filter(lambda v: v not in ("nodeAffinity", "podAffinity", "podAntiAffinity")),
    ),
    "nnodes": (
        lambda v: Elastic(nnodes=v),
        st.integers(max_value=0) | st.sampled_from(["4:2", "0:1", "a", "1:2:3", "-1"]),
    ),
    "nproc_per_node": (
        lambda v: Elastic(nproc_per_node=v),
        st.integers(max_value=0) | st.sampled_from(["many", "0", "1.5"]),
    ),
    "scheduling_policy": (
        lambda v: JobOptions(scheduling_policy={v: 1}),
        st.text().filter(
            lambda v: v not in ("minAvailable", "queue", "minResources", "priorityClass", "scheduleTimeoutSeconds")
        ),
    ),
    "replicas": (lambda v: PyTorch(worker=Worker(replicas=v)), st.integers(max_value=-1)),
    "map_index": (lambda v: RunIdentity(dag_id="d", task_id="t", run_id="r", map_index=v), st.integers(max_value=-2)),
}


@pytest.mark.parametrize("field", sorted(INVALID))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_invalid_values_are_refused_at_construction(field: str, data: st.DataObject) -> None:
    build, values = INVALID[field]
    value = data.draw(values)
    with pytest.raises((ValueError, TypeError)) as excinfo:
        build(value)
    assert field.split()[0] in str(excinfo.value)
