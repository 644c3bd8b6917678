"""PodOptions and JobOptions: validated at construction, normalized, merged per replica."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from airflow_provider_torchelastic.core.config import Master, Worker
from airflow_provider_torchelastic.core.pod_options import (
    DEFAULT_SHM_SIZE,
    UNSET,
    JobOptions,
    PodOptions,
    config_map_key_ref,
    merge_pod_options,
    secret_key_ref,
)


def test_defaults() -> None:
    options = PodOptions()
    assert options.effective_shm_size == DEFAULT_SHM_SIZE
    assert options.env_vars == ()
    assert options.template == {"metadata": {}, "spec": {}}
    assert PodOptions(shm_size=None).effective_shm_size is None


def test_env_mapping_and_list_forms_are_equivalent() -> None:
    by_mapping = PodOptions(env={"A": "1", "TOKEN": secret_key_ref("hf", "token"), "M": config_map_key_ref("c", "k")})
    by_list = PodOptions(
        env=[
            {"name": "A", "value": "1"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "M", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        ]
    )
    assert by_mapping.env_vars == by_list.env_vars


def test_kubernetes_objects_are_converted() -> None:
    from kubernetes.client import (
        V1EmptyDirVolumeSource,
        V1EnvVar,
        V1EnvVarSource,
        V1LocalObjectReference,
        V1SecretKeySelector,
        V1Toleration,
        V1Volume,
        V1VolumeMount,
    )

    options = PodOptions(
        env=[V1EnvVar(name="T", value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name="s", key="k")))],
        image_pull_secrets=[V1LocalObjectReference(name="regcred")],
        tolerations=[V1Toleration(key="gpu", operator="Exists")],
        volumes=[V1Volume(name="scratch", empty_dir=V1EmptyDirVolumeSource())],
        volume_mounts=[V1VolumeMount(name="scratch", mount_path="/scratch")],
    )
    assert options.env_vars == ({"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},)
    assert options.image_pull_secrets == ("regcred",)
    assert options.tolerations == ({"key": "gpu", "operator": "Exists"},)
    assert options.volumes == ({"name": "scratch", "emptyDir": {}},)
    assert options.volume_mounts == ({"name": "scratch", "mountPath": "/scratch"},)


def test_values_are_copied_not_shared() -> None:
    labels = {"team": "ml"}
    toleration = {"key": "gpu", "operator": "Exists"}
    options = PodOptions(labels=labels, tolerations=[toleration])
    labels["team"] = "other"
    toleration["key"] = "other"
    assert options.labels == {"team": "ml"} and isinstance(options.labels, MappingProxyType)
    assert options.tolerations[0]["key"] == "gpu"


def test_gpu_quantities_are_normalized_to_strings() -> None:
    assert PodOptions(limits={"nvidia.com/gpu": 8}).limits == {"nvidia.com/gpu": "8"}


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"image_pull_policy": "Sometimes"}, ValueError, "image_pull_policy"),
        ({"image_pull_secrets": "regcred"}, TypeError, "image_pull_secrets"),
        ({"image_pull_secrets": ["Bad_Name"]}, ValueError, "image_pull_secrets"),
        ({"env": {"1A": "x"}}, ValueError, "env"),
        ({"env": {"A": 1}}, TypeError, "env"),
        ({"env": [{"name": "A", "value": "1", "valueFrom": {}}]}, ValueError, "env"),
        ({"env": {"A": {"secretKeyRef": {"name": "s"}}}}, ValueError, "secretKeyRef.key"),
        ({"env": {"A": {"secretRef": {"name": "s"}}}}, ValueError, "valueFrom"),
        ({"env": {"PET_RDZV_ENDPOINT": "x"}}, ValueError, "PET_RDZV_ENDPOINT"),
        ({"env_from": [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]}, ValueError, "env_from"),
        ({"env_from": [{"secret": {"name": "a"}}]}, ValueError, "env_from"),
        ({"requests": {"cpu": "fast"}}, ValueError, "requests"),
        ({"limits": {"nvidia.com/gpu": [1]}}, ValueError, "limits"),
        ({"limits": {"gpu": 1}}, ValueError, r"limits: expected .*'nvidia\.com/gpu'.*got 'gpu'"),
        ({"requests": {"GPU": 1}}, ValueError, r"requests: expected .*'amd\.com/gpu'.*got 'GPU'"),
        ({"node_selector": {"zone": "a b"}}, ValueError, "node_selector"),
        ({"tolerations": [{"key": "gpu", "operator": "Maybe"}]}, ValueError, "tolerations"),
        ({"tolerations": [{"key": "gpu", "efect": "NoSchedule"}]}, ValueError, "efect"),
        ({"tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]}, ValueError, "value"),
        ({"tolerations": [{"key": "g", "operator": "Exists", "tolerationSeconds": 5}]}, ValueError, "NoExecute"),
        ({"tolerations": [{"operator": "Equal", "value": "x"}]}, ValueError, "Exists"),
        ({"tolerations": [{"key": "pool", "value": "a b"}]}, ValueError, r"tolerations\[0\]\.value: expected a label"),
        ({"affinity": {"nodeAfinity": {}}}, ValueError, "nodeAfinity"),
        ({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}, ValueError, "volumes"),
        ({"volumes": [{"name": "a"}]}, ValueError, "volume source"),
        (
            {"volumes": [{"name": "a", "pvc": {"claimName": "d"}}]},
            ValueError,
            r"volumes\[0\]\.pvc: expected a volume source",
        ),
        ({"volumes": [{"name": "a", "persistentVolumeClaim": {}}]}, ValueError, r"persistentVolumeClaim\.claimName"),
        ({"volumes": [{"name": "a", "secret": {"name": "s"}}]}, ValueError, r"volumes\[0\]\.secret\.secretName"),
        ({"volumes": [{"name": "a", "nfs": {"server": "nas"}}]}, ValueError, r"volumes\[0\]\.nfs\.path"),
        ({"volume_mounts": [{"name": "a", "mountPath": "rel"}]}, ValueError, "mountPath"),
        ({"volume_mounts": [{"name": "a", "mountPath": "/a", "readonly": True}]}, ValueError, "readonly"),
        ({"volume_mounts": [{"name": "a", "mountPath": "/a", "subPath": "/etc"}]}, ValueError, "subPath.*relative"),
        ({"volume_mounts": [{"name": "a", "mountPath": "/a", "subPathExpr": "x/../.."}]}, ValueError, "'\\.\\.'"),
        ({"service_account_name": "Trainer"}, ValueError, "service_account_name"),
        # "false" is truthy: a string here would mount the token its author meant to keep out
        ({"automount_service_account_token": "false"}, TypeError, r"automount_service_account_token.*'false'"),
        ({"automount_service_account_token": 0}, TypeError, "automount_service_account_token"),
        ({"priority_class_name": ""}, ValueError, "priority_class_name"),
        ({"labels": {"team": "a/b"}}, ValueError, "labels"),
        ({"labels": {"app.kubernetes.io/managed-by": "me"}}, ValueError, "managed-by"),
        ({"annotations": {"torchelastic.airflow.apache.org/run-id": "x"}}, ValueError, "annotations"),
        ({"annotations": {"a": 1}}, TypeError, "annotations"),
        ({"shm_size": "lots"}, ValueError, "shm_size"),
        ({"shm_size": "0"}, ValueError, "shm_size"),
        ({"pod_template": "spec: {}"}, TypeError, "pod_template"),
        ({"pod_template": {"kind": "Pod"}}, ValueError, "pod_template"),
        ({"pod_template": {"spec": {"containers": [{"name": "pytorch", "command": ["x"]}]}}}, ValueError, "command"),
        ({"pod_template": {"spec": {"restartPolicy": "Never"}}}, ValueError, "restartPolicy"),
        ({"pod_template": {"spec": {"containers": [{"image": "x"}]}}}, ValueError, "containers"),
        (
            {"pod_template": {"spec": {"containers": [{"name": "pytorch", "ports": [{"containerPort": 9090}]}]}}},
            ValueError,
            r"containers\['pytorch'\]\.ports\[0\].*named port",
        ),
        ({"pod_template": {"metadata": {"labels": {"training.kubeflow.org/replica-type": "x"}}}}, ValueError, "labels"),
        ({"volumes": [{"name": "a", "emptyDir": object()}]}, TypeError, "volumes"),
        # "$" would let a trailing newline through: every pattern must match the whole value
        ({"labels": {"team": "ml\n"}}, ValueError, "labels"),
        ({"node_selector": {"zone\n": "a"}}, ValueError, "node_selector"),
        ({"service_account_name": "trainer\n"}, ValueError, "service_account_name"),
        ({"env": {"A\n": "x"}}, ValueError, "env"),
        ({"volumes": [{"name": "data\n", "emptyDir": {}}]}, ValueError, "volumes"),
        ({"limits": {"cpu": "1\n"}}, ValueError, "limits"),
        ({"requests": {"cpu\n": "1"}}, ValueError, "requests"),
        ({"shm_size": "1Gi\n"}, ValueError, "shm_size"),
        ({"pod_template": {"spec": {"containers": [{"name": "side", "image": "Side:1"}]}}}, ValueError, "image"),
        ({"pod_template": {"spec": {"initContainers": [{"name": "i", "image": "i:1\n"}]}}}, ValueError, "image"),
        (
            {"pod_template": {"spec": {"containers": [{"name": "pytorch", "resources": {"limits": {"gpu": 1}}}]}}},
            ValueError,
            r"containers\['pytorch'\]\.resources\.limits: expected .*'nvidia\.com/gpu'",
        ),
        (
            {"pod_template": {"spec": {"initContainers": [{"name": "i", "resources": {"requests": {"cpu": "x"}}}]}}},
            ValueError,
            r"initContainers\['i'\]\.resources\.requests\['cpu'\]",
        ),
    ],
)
def test_invalid_options_name_the_field(kwargs: dict[str, Any], exc: type[Exception], field: str) -> None:
    with pytest.raises(exc, match=field) as excinfo:
        PodOptions(**kwargs)
    assert str(excinfo.value).startswith("PodOptions.")


def test_merge_rules() -> None:
    base = PodOptions(
        env={"A": "1", "B": "1"},
        labels={"x": "1", "y": "1"},
        tolerations=[{"key": "a", "operator": "Exists"}],
        image_pull_secrets=["one"],
        volumes=[{"name": "v", "emptyDir": {}}],
        volume_mounts=[{"name": "v", "mountPath": "/v"}],
        service_account_name="base",
        shm_size="4Gi",
        requests={"cpu": "1"},
        pod_template={"spec": {"hostIPC": True}},
    )
    replica = PodOptions(
        env={"B": "2", "C": "2"},
        labels={"y": "2"},
        tolerations=[{"key": "a", "operator": "Exists"}, {"key": "b", "operator": "Exists"}],
        image_pull_secrets=["two"],
        volumes=[{"name": "v", "emptyDir": {"medium": "Memory"}}],
        volume_mounts=[{"name": "v", "mountPath": "/w"}],
        requests={"memory": "1Gi"},
        pod_template={"spec": {"hostNetwork": True}},
    )
    merged = merge_pod_options(base, replica)
    assert [(v["name"], v["value"]) for v in merged.env_vars] == [("A", "1"), ("B", "2"), ("C", "2")]
    assert merged.labels == {"x": "1", "y": "2"}
    assert [t["key"] for t in merged.tolerations] == ["a", "b"]
    assert merged.image_pull_secrets == ("one", "two")
    assert merged.volumes == ({"name": "v", "emptyDir": {"medium": "Memory"}},)
    assert [m["mountPath"] for m in merged.volume_mounts] == ["/v", "/w"]
    assert merged.service_account_name == "base"
    assert merged.effective_shm_size == "4Gi"  # the replica left shm_size UNSET
    assert merged.requests == {"cpu": "1", "memory": "1Gi"}
    assert merged.template["spec"] == {"hostNetwork": True}  # a replica's template replaces the operator's
    assert merge_pod_options(base, PodOptions(shm_size=None)).effective_shm_size is None
    assert merge_pod_options(None, None) == PodOptions()
    assert merge_pod_options(base, None) is base and merge_pod_options(None, replica) is replica
    assert replica.shm_size is UNSET


def test_token_automount_merges_as_a_scalar() -> None:
    assert PodOptions().automount_service_account_token is None
    on = PodOptions(automount_service_account_token=True)
    assert merge_pod_options(on, PodOptions()).automount_service_account_token is True
    off = PodOptions(automount_service_account_token=False)
    assert merge_pod_options(on, off).automount_service_account_token is False


def test_replicas_take_pod_options() -> None:
    assert Worker(replicas=1, pod=PodOptions(labels={"a": "b"})).pod == PodOptions(labels={"a": "b"})
    with pytest.raises(TypeError, match=r"Master\.pod"):
        Master(pod={"labels": {}})  # type: ignore[arg-type]


def test_job_options() -> None:
    options = JobOptions(scheduling_policy={"queue": "q", "minResources": {"nvidia.com/gpu": 8}})
    assert options.scheduling_policy == {"queue": "q", "minResources": {"nvidia.com/gpu": "8"}}


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"suspend": "yes"}, TypeError, "suspend"),
        ({"scheduling_policy": {"queueName": "q"}}, ValueError, "queueName"),
        ({"scheduling_policy": {"minAvailable": "2"}}, TypeError, "minAvailable"),
        ({"scheduling_policy": {"minAvailable": 2**31}}, ValueError, "minAvailable"),
        ({"scheduling_policy": {"queue": ""}}, ValueError, "queue"),
        ({"scheduling_policy": {"minResources": {"cpu": "x"}}}, ValueError, "minResources"),
        ({"scheduling_policy": {"minResources": {"gpu": 8}}}, ValueError, "nvidia.com/gpu"),
    ],
)
def test_invalid_job_options(kwargs: dict[str, Any], exc: type[Exception], field: str) -> None:
    with pytest.raises(exc, match=field):
        JobOptions(**kwargs)
