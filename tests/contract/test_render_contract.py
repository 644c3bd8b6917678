"""Rendered objects against the real contracts: the PyTorchJob CRD schema, the webhook rules, the Pod schema."""

from __future__ import annotations

import base64
import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from airflow_provider_torchelastic.core.config import (
    CleanPodPolicy,
    Elastic,
    Master,
    PyTorch,
    RestartPolicy,
    RunPolicy,
    Worker,
)
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions, config_map_key_ref, secret_key_ref
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.pod_template import (
    MAX_SECRET_BYTES,
    PAYLOAD_KEY,
    PAYLOAD_PATH,
    RESULT_FILE,
)
from airflow_provider_torchelastic.kubernetes.render import (
    UI_FOOTER,
    check_renderable,
    elide_payload,
    payload_secret_owner_reference,
    render_manifests,
    summarize_for_ui,
    to_yaml,
)
from tests.contract.builders import IMAGE, identity, pod_specs, pytorch_container, render, workload
from tests.contract.schemas import (
    KUBERNETES_VERSIONS,
    REPO_ROOT,
    WebhookRejection,
    check_webhook_rules,
    pod_template_as_object,
    validate_pod,
    validate_pod_template,
    validate_pytorchjob,
    validate_rendered,
)

GPU_OPTIONS = PodOptions(
    limits={"nvidia.com/gpu": 8},
    requests={"cpu": "16", "memory": "64Gi"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    labels={"kueue.x-k8s.io/queue-name": "gpu-queue"},
    image_pull_secrets=["regcred"],
    image_pull_policy="IfNotPresent",
    env={
        "WANDB_PROJECT": "nightly",
        "HF_TOKEN": secret_key_ref("hf", "token"),
        "MODE": config_map_key_ref("settings", "mode", optional=True),
    },
    env_from=[{"secretRef": {"name": "s3-creds"}}, {"configMapRef": {"name": "defaults"}, "prefix": "CFG_"}],
    volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}],
    volume_mounts=[{"name": "data", "mountPath": "/data", "readOnly": True}],
    service_account_name="trainer",
    priority_class_name="high",
    annotations={"example.com/team": "ml"},
    affinity={
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
            }
        }
    },
    shm_size="16Gi",
)

CANONICAL: dict[str, tuple[Any, PodOptions | None, JobOptions | None]] = {
    "single-pod": (Elastic(), None, None),
    "single-pod-gpu": (Elastic(nproc_per_node="gpu"), GPU_OPTIONS, None),
    "elastic-range": (Elastic(nnodes="1:4", nproc_per_node=8, max_restarts=3), GPU_OPTIONS, None),
    "elastic-fixed": (Elastic(nnodes=2, run_policy=RunPolicy(backoff_limit=0)), None, JobOptions(suspend=True)),
    "master-worker": (
        PyTorch(
            master=Master(image="img/master:1", requests={"cpu": "2"}, restart_policy=RestartPolicy.EXIT_CODE),
            worker=Worker(replicas=3, limits={"nvidia.com/gpu": "1"}, pod=PodOptions(shm_size=None)),
            run_policy=RunPolicy(clean_pod_policy=CleanPodPolicy.RUNNING, ttl_seconds_after_finished=600),
            nproc_per_node=4,
        ),
        GPU_OPTIONS,
        JobOptions(scheduling_policy={"queue": "team-a", "minAvailable": 4, "minResources": {"cpu": "10"}}),
    ),
    "master-only": (PyTorch(worker=Worker(replicas=0)), None, None),
}


@pytest.mark.parametrize("case", sorted(CANONICAL))
def test_canonical_renders_meet_every_contract(case: str) -> None:
    config, options, job_options = CANONICAL[case]
    validate_rendered(render(config, pod_options=options, job_options=job_options))


# ------------------------------------------------------------------------------ the validators can fail


def _valid_job() -> dict[str, Any]:
    return workload(render(Elastic(nnodes=2)))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "nprocPerNode"), 2),
        (("spec", "pytorchReplicaSpecs", "Worker", "replicas"), "two"),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0, "imagePullPolcy"), "Always"),
        (
            ("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0, "resources"),
            {"limits": {"cpu": [1]}},
        ),
        (("spec", "elasticPolicy", "maxReplica"), 3),
        (("spec", "runPolicy"), {"backoffLimit": "3"}),
    ],
)
def test_crd_schema_rejects_known_bad_objects(path: tuple[Any, ...], value: Any) -> None:
    job = _valid_job()
    target = job
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_pytorchjob(job)


def test_only_strict_mode_catches_a_typo() -> None:
    job = _valid_job()
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    validate_pytorchjob(job, strict=False)
    with pytest.raises(jsonschema.ValidationError, match="imagePullPolcy"):
        validate_pytorchjob(job, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_pod_schema_rejects_known_bad_objects(version: str) -> None:
    pod = workload(render(Elastic()))
    typo = copy.deepcopy(pod)
    typo["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        validate_pod(typo, version)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, version, strict=True)
    template = {"metadata": {}, "spec": copy.deepcopy(pod["spec"])}
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "23456"
    with pytest.raises(jsonschema.ValidationError):
        validate_pod_template(template, version)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod_template_as_object(template), version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(CANONICAL))
def test_cached_validator_agrees_with_kubernetes_validate(case: str, version: str) -> None:
    config, options, job_options = CANONICAL[case]
    for manifest in render(config, pod_options=options, job_options=job_options):
        if manifest["kind"] == "PyTorchJob":
            for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
                kubernetes_validate.validate(pod_template_as_object(replica["template"]), version, strict=True)
        else:
            assert kubernetes_validate.validate(manifest, version, strict=True) == version


def _mutate(job: dict[str, Any], how: str) -> None:
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    if how == "name":
        job["metadata"]["name"] = "1-starts-with-digit"
    elif how == "replica-key":
        replicas["Launcher"] = replicas.pop("Worker")
    elif how == "no-pytorch":
        replicas["Worker"]["template"]["spec"]["containers"][0]["name"] = "main"
    elif how == "no-image":
        del replicas["Worker"]["template"]["spec"]["containers"][0]["image"]
    elif how == "master-replicas":
        replicas["Master"] = copy.deepcopy(replicas["Worker"])
        del replicas["Master"]["replicas"]
    elif how == "elastic-without-worker":
        replicas["Master"] = copy.deepcopy(replicas.pop("Worker"))
        replicas["Master"]["replicas"] = 1
    elif how == "both-nproc":
        spec["elasticPolicy"]["nProcPerNode"] = 2
    elif how == "managed-by":
        spec["runPolicy"] = {"managedBy": "me"}
    elif how == "worker-zero":
        replicas["Worker"]["replicas"] = 0


@pytest.mark.parametrize(
    "how",
    [
        "name",
        "replica-key",
        "no-pytorch",
        "no-image",
        "master-replicas",
        "elastic-without-worker",
        "both-nproc",
        "managed-by",
        "worker-zero",
    ],
)
def test_webhook_rules_reject_what_the_schema_allows(how: str) -> None:
    job = _valid_job()
    check_webhook_rules(job)
    _mutate(job, how)
    if how not in ("replica-key", "elastic-without-worker"):
        validate_pytorchjob(job)  # the CRD schema alone lets these through (or does not know the key)
    with pytest.raises(WebhookRejection):
        check_webhook_rules(job)


# ------------------------------------------------------------------------------------------- shapes


def test_single_node_is_one_pod_running_the_runner() -> None:
    config = Elastic(nproc_per_node=4, run_policy=RunPolicy(active_deadline_seconds=3600))
    assert kinds.for_config(config) is kinds.POD
    secret, pod = render(config)
    assert pod["kind"] == "Pod"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["activeDeadlineSeconds"] == 3600
    container = pytorch_container(pod["spec"])
    command = container["command"]
    assert command[:3] == ["python", "-m", "airflow_provider_torchelastic.runner"]
    assert command[command.index("--nnodes") + 1] == "1"
    assert command[command.index("--payload") + 1] == PAYLOAD_PATH
    assert command[command.index("--result-file") + 1] == RESULT_FILE == container["terminationMessagePath"]
    assert command[command.index("--max-result-bytes") + 1] == "4096"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"]
    assert {"name": "PYTHONUNBUFFERED", "value": "1"} in container["env"]
    assert secret["metadata"]["name"] == pod["metadata"]["name"] + "-payload"


def test_elastic_range_is_a_pytorchjob_with_elastic_policy() -> None:
    job = workload(render(Elastic(nnodes="1:4", nproc_per_node=8, max_restarts=2)))
    spec = job["spec"]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert spec["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 4, "rdzvBackend": "c10d", "maxRestarts": 2}
    assert spec["nprocPerNode"] == "8"
    assert "nProcPerNode" not in spec["elasticPolicy"]
    assert list(spec["pytorchReplicaSpecs"]) == ["Worker"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "Never"
    # PET_NNODES comes from the training operator, so the command line must not fix it.
    assert "--nnodes" not in pytorch_container(worker["template"]["spec"])["command"]
    assert "runPolicy" not in spec
    assert "restartPolicy" not in worker["template"]["spec"]


def test_master_worker_job() -> None:
    config = PyTorch(
        master=Master(image="img/master:2", requests={"cpu": "2"}, restart_policy="ExitCode"),
        worker=Worker(replicas=3, limits={"nvidia.com/gpu": 1}, restart_policy="OnFailure"),
        run_policy=RunPolicy(backoff_limit=2, active_deadline_seconds=60),
        nproc_per_node="gpu",
    )
    job = workload(render(config))
    spec = job["spec"]
    master, worker = spec["pytorchReplicaSpecs"]["Master"], spec["pytorchReplicaSpecs"]["Worker"]
    assert (master["replicas"], master["restartPolicy"]) == (1, "ExitCode")
    assert (worker["replicas"], worker["restartPolicy"]) == (3, "OnFailure")
    assert pytorch_container(master["template"]["spec"])["image"] == "img/master:2"
    assert pytorch_container(worker["template"]["spec"])["image"] == IMAGE
    assert pytorch_container(master["template"]["spec"])["resources"] == {"requests": {"cpu": "2"}}
    assert pytorch_container(worker["template"]["spec"])["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert spec["nprocPerNode"] == "gpu"
    assert "elasticPolicy" not in spec
    assert spec["runPolicy"] == {"activeDeadlineSeconds": 60, "backoffLimit": 2}


def test_master_only_job_has_no_worker_entry() -> None:
    job = workload(render(PyTorch(worker=Worker(replicas=0))))
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    check_webhook_rules(job)


def test_job_options_render_into_run_policy() -> None:
    options = JobOptions(suspend=True, scheduling_policy={"queue": "q", "minAvailable": 2, "priorityClass": "p"})
    job = workload(render(Elastic(nnodes=2), job_options=options))
    assert job["spec"]["runPolicy"] == {
        "schedulingPolicy": {"queue": "q", "minAvailable": 2, "priorityClass": "p"},
        "suspend": True,
    }
    validate_pytorchjob(job)


def test_job_options_on_a_single_pod_are_an_error() -> None:
    with pytest.raises(ValueError, match="JobOptions"):
        render(Elastic(), job_options=JobOptions(suspend=True))


# ------------------------------------------------------------------------------------ customization


def test_platform_options_reach_every_pod() -> None:
    for config in (Elastic(), Elastic(nnodes="2:3"), PyTorch(worker=Worker(replicas=1))):
        manifests = render(config, pod_options=GPU_OPTIONS)
        validate_rendered(manifests)
        job = workload(manifests)
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        for spec in pod_specs(job).values():
            container = pytorch_container(spec)
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
            assert container["imagePullPolicy"] == "IfNotPresent"
            assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in container[
                "env"
            ]
            assert {"secretRef": {"name": "s3-creds"}} in container["envFrom"]
            assert {"name": "data", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
            assert spec["imagePullSecrets"] == [{"name": "regcred"}]
            assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
            assert spec["serviceAccountName"] == "trainer"
            assert spec["priorityClassName"] == "high"
            assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
            assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in spec["volumes"]


def test_replica_options_override_and_extend_the_operators() -> None:
    base = PodOptions(env={"A": "base", "B": "base"}, tolerations=[{"key": "a", "operator": "Exists"}])
    config = PyTorch(
        worker=Worker(
            replicas=2,
            pod=PodOptions(
                env={"B": "worker"},
                tolerations=[{"key": "b", "operator": "Exists"}],
                shm_size=None,
                limits={"nvidia.com/gpu": 2},
            ),
        )
    )
    specs = pod_specs(workload(render(config, pod_options=base)))
    master, worker = pytorch_container(specs["Master"]), pytorch_container(specs["Worker"])
    assert {"name": "B", "value": "base"} in master["env"]
    assert {"name": "B", "value": "worker"} in worker["env"] and {"name": "A", "value": "base"} in worker["env"]
    assert [t["key"] for t in specs["Worker"]["tolerations"]] == ["a", "b"]
    assert [t["key"] for t in specs["Master"]["tolerations"]] == ["a"]
    assert all(v["name"] != "dshm" for v in specs["Worker"]["volumes"])
    assert any(v["name"] == "dshm" for v in specs["Master"]["volumes"])
    assert "resources" not in master and worker["resources"] == {"limits": {"nvidia.com/gpu": "2"}}


def test_replica_resources_win_over_pod_options_key_by_key() -> None:
    config = PyTorch(worker=Worker(replicas=1, requests={"cpu": "8"}))
    specs = pod_specs(workload(render(config, pod_options=PodOptions(requests={"cpu": "1", "memory": "4Gi"}))))
    assert pytorch_container(specs["Worker"])["resources"]["requests"] == {"cpu": "8", "memory": "4Gi"}
    assert pytorch_container(specs["Master"])["resources"]["requests"] == {"cpu": "1", "memory": "4Gi"}


def test_pod_template_keeps_sidecars_and_security_context() -> None:
    template = {
        "metadata": {"labels": {"team": "ml"}, "annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
            "containers": [
                {"name": "pytorch", "securityContext": {"allowPrivilegeEscalation": False}},
                {"name": "metrics", "image": "prom/exporter:1"},
            ],
            "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
        },
    }
    for config in (Elastic(), Elastic(nnodes=3)):
        manifests = render(config, pod_options=PodOptions(pod_template=template))
        validate_rendered(manifests)
        for spec in pod_specs(workload(manifests)).values():
            assert [c["name"] for c in spec["containers"]] == ["pytorch", "metrics"]
            assert spec["securityContext"]["runAsUser"] == 1000
            assert pytorch_container(spec)["securityContext"] == {"allowPrivilegeEscalation": False}
            assert spec["initContainers"][0]["name"] == "fetch"


def test_pod_template_from_a_kubernetes_object() -> None:
    from kubernetes.client import V1Container, V1ObjectMeta, V1PodSpec, V1PodTemplateSpec, V1Toleration

    template = V1PodTemplateSpec(
        metadata=V1ObjectMeta(labels={"team": "ml"}),
        spec=V1PodSpec(containers=[V1Container(name="logger", image="fluent/bit:3")], host_ipc=True),
    )
    options = PodOptions(pod_template=template, tolerations=[V1Toleration(key="gpu", operator="Exists")])
    manifests = render(Elastic(nnodes=2), pod_options=options)
    validate_rendered(manifests)
    spec = pod_specs(workload(manifests))["Worker"]
    assert spec["hostIPC"] is True
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert [c["name"] for c in spec["containers"]] == ["pytorch", "logger"]


# ------------------------------------------------------------------------------------------- conflicts


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pod_template": {"spec": {"containers": [{"name": "pytorch", "command": ["bash"]}]}}}, "command"),
        ({"pod_template": {"spec": {"containers": [{"name": "pytorch", "args": ["x"]}]}}}, "args"),
        ({"pod_template": {"spec": {"restartPolicy": "Always", "containers": []}}}, "restartPolicy"),
        ({"pod_template": {"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}}}, "managed-by"),
        ({"labels": {"torchelastic.airflow.apache.org/dag-id": "x"}}, "dag-id"),
        ({"labels": {"training.kubeflow.org/job-name": "x"}}, "job-name"),
        ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "env"),
        ({"env": {"PET_NNODES": "2"}}, "PET_NNODES"),
        ({"env": {"MASTER_ADDR": "x"}}, "MASTER_ADDR"),
    ],
)
def test_conflicts_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PodOptions(**kwargs)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            PodOptions(
                env={"A": "options"},
                pod_template={"spec": {"containers": [{"name": "pytorch", "env": [{"name": "A", "value": "tpl"}]}]}},
            ),
            "env",
        ),
        (
            PodOptions(volume_mounts=[{"name": "x", "mountPath": "/dev/shm"}], volumes=[{"name": "x", "emptyDir": {}}]),
            "/dev/shm",
        ),
        (PodOptions(volumes=[{"name": "dshm", "emptyDir": {}}]), "dshm"),
        (PodOptions(volume_mounts=[{"name": "missing", "mountPath": "/m"}]), "missing"),
        (
            PodOptions(service_account_name="a", pod_template={"spec": {"serviceAccountName": "b"}}),
            "serviceAccountName",
        ),
        (PodOptions(node_selector={"a": "1"}, pod_template={"spec": {"nodeSelector": {"a": "2"}}}), "nodeSelector"),
        (PodOptions(requests={"nvidia.com/gpu": 1}), "nvidia.com/gpu"),
        (PodOptions(requests={"cpu": "4"}, limits={"cpu": "2"}), "cpu"),
        (PodOptions(requests={"nvidia.com/gpu": 1}, limits={"nvidia.com/gpu": 2}), "overcommit"),
        (PodOptions(pod_template={"spec": {"containers": [{"name": "side"}]}}), "image"),
    ],
)
def test_conflicts_with_the_generated_pod_are_clear_errors(options: PodOptions, match: str) -> None:
    for config in (Elastic(), Elastic(nnodes=2)):
        with pytest.raises(ValueError, match=match):
            render(config, pod_options=options)
        with pytest.raises(ValueError, match=match):
            check_renderable(config, image=IMAGE, pod_options=options)


def test_image_may_come_from_the_replica_or_template_only() -> None:
    config = PyTorch(master=Master(image="m:1"), worker=Worker(replicas=1, image="w:1"))
    validate_rendered(render(config, image=None))
    templated = PodOptions(pod_template={"spec": {"containers": [{"name": "pytorch", "image": "t:1"}]}})
    validate_rendered(render(Elastic(nnodes=2), image=None, pod_options=templated))
    with pytest.raises(ValueError, match="image"):
        render(Elastic(), image=None)


def _images(manifests: list[dict[str, Any]]) -> dict[str, str]:
    return {kind: pytorch_container(spec)["image"] for kind, spec in pod_specs(workload(manifests)).items()}


def test_image_precedence_replica_operator_template_default() -> None:
    template = PodOptions(pod_template={"spec": {"containers": [{"name": "pytorch", "image": "tpl:1"}]}})
    config = PyTorch(master=Master(image="master:1"), worker=Worker(replicas=1))

    def images(image: str | None, options: PodOptions | None, default: str | None = "default:1") -> dict[str, str]:
        manifests = render_manifests(
            config,
            identity=identity(),
            namespace="ml",
            image=image,
            payload=b"",
            pod_options=options,
            default_image=default,
        )
        validate_rendered(manifests)
        return _images(manifests)

    assert images("op:1", template) == {"Master": "master:1", "Worker": "op:1"}
    assert images(None, template) == {"Master": "master:1", "Worker": "tpl:1"}
    assert images(None, None) == {"Master": "master:1", "Worker": "default:1"}
    # The operator's image replaces the template's without a conflict: the template is the lower layer.
    assert _images(render(Elastic(), pod_options=template)) == {"Pod": IMAGE}


def test_no_image_anywhere_names_every_place_an_image_can_come_from() -> None:
    for config in (Elastic(), Elastic(nnodes=2), PyTorch(master=Master(image="m:1"), worker=Worker(replicas=1))):
        with pytest.raises(ValueError) as info:
            render(config, image=None)
        message = str(info.value)
        assert ".image: expected an image" in message and message.endswith("got None"), message
        for place in ("image=", "Master/Worker(image=", "pod_template", "[torch_elastic] image"):
            assert place in message, (place, message)
        assert "AIRFLOW__TORCH_ELASTIC__IMAGE" in message


def test_parse_time_check_may_leave_the_image_to_run_time() -> None:
    check_renderable(Elastic(nnodes=2), image=None, require_image=False)
    with pytest.raises(ValueError, match="image"):
        check_renderable(Elastic(nnodes=2), image=None)
    # Side containers are known at parse time: their images are still required.
    sidecar = PodOptions(pod_template={"spec": {"containers": [{"name": "side"}]}})
    with pytest.raises(ValueError, match=r"containers\[1\]\.image"):
        check_renderable(Elastic(), image=None, pod_options=sidecar, require_image=False)


@pytest.mark.parametrize("image", ["Registry/Train:1", "a b", "train:", "{{ var.value.image }}"])
def test_render_refuses_what_is_not_an_image_reference(image: str) -> None:
    with pytest.raises(ValueError, match=r"^image: expected an image reference"):
        render(Elastic(), image=image)
    with pytest.raises(ValueError, match=r"^default_image: expected an image reference"):
        render(Elastic(), image=None, default_image=image)


# --------------------------------------------------------------------------------------------- payload


def test_payload_is_mounted_read_only_from_an_immutable_secret() -> None:
    """A Secret (issue 20, item 1): Kubernetes' built-in view role reads ConfigMaps, not Secrets."""
    secret, job = render(Elastic(nnodes=2), payload=b"abc")
    assert secret["kind"] == "Secret" and secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"][PAYLOAD_KEY]) == b"abc"
    assert secret["immutable"] is True
    spec = pod_specs(job)["Worker"]
    volume = next(v for v in spec["volumes"] if v.get("secret"))
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in pytorch_container(spec)["volumeMounts"] if m["name"] == volume["name"])
    assert mount["readOnly"] is True and PAYLOAD_PATH.startswith(mount["mountPath"] + "/")


def test_payload_too_large_fails_before_anything_is_created() -> None:
    limit = MAX_SECRET_BYTES - len(PAYLOAD_KEY)
    render(Elastic(), payload=b"x" * limit)
    with pytest.raises(ValueError, match=rf"{limit + 1} bytes.*limit {limit}.*by reference"):
        render(Elastic(), payload=b"x" * (limit + 1))


@pytest.mark.parametrize(("kind", "api_version"), [("PyTorchJob", "kubeflow.org/v1"), ("Pod", "v1")])
def test_owner_reference_patch(kind: str, api_version: str) -> None:
    patch = payload_secret_owner_reference(owner_name="job", owner_uid="1234", kind=kind)
    assert patch == {
        "metadata": {"ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": "job", "uid": "1234"}]}
    }
    secret = render(Elastic())[0]
    secret["metadata"].update(patch["metadata"])
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(secret, version, strict=True)


# ---------------------------------------------------------------------------------------- determinism


def test_render_is_deterministic_per_try() -> None:
    config = Elastic(nnodes="2:4")
    assert render(config, pod_options=GPU_OPTIONS) == render(config, pod_options=GPU_OPTIONS)
    first, second = workload(render(config)), workload(render(config, try_number=2))
    assert first["metadata"]["name"] != second["metadata"]["name"]


# ------------------------------------------------------------------------------------------ UI summary


def test_summary_shows_the_whole_job_when_it_fits() -> None:
    # One node (a Pod): a two-node PyTorchJob with its run context no longer fits the 4000 characters whole.
    manifests = render(Elastic(), payload=b"x" * 5000)
    text = summarize_for_ui(manifests)
    assert len(text) <= 4000
    assert text.rstrip("\n").splitlines()[-1] == UI_FOOTER
    documents = list(yaml.safe_load_all(text))
    assert documents[0]["data"][PAYLOAD_KEY] == "<5000 bytes, cloudpickle payload>"
    assert documents[1] == manifests[1]


def test_summary_of_a_huge_job_still_fits_and_says_where_the_rest_is() -> None:
    options = PodOptions(env={f"VARIABLE_NUMBER_{i}": "x" * 50 for i in range(200)})
    config = PyTorch(worker=Worker(replicas=7, limits={"nvidia.com/gpu": 8}))
    text = summarize_for_ui(render(config, pod_options=options))
    assert len(text) <= 4000
    assert text.rstrip("\n").splitlines()[-1] == UI_FOOTER
    digest = next(iter(yaml.safe_load_all(text)))
    assert digest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 7
    assert digest["spec"]["pytorchReplicaSpecs"]["Worker"]["pytorch"]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_yaml_round_trips_and_stays_block_style_in_key_order() -> None:
    documents = [
        {"z": 1, "a": {"list": [1, "two", {"k": None}], "empty": {}, "none": []}},
        {"float": 1e100, "inf": float("inf"), "tiny": 1e-9, "text": "yes", "multi": "a\nb", "key: colon": "x"},
        {"unicode": "naïve ✓", "quote": 'it\'s "quoted"', "number_like": "1.0", "octal_like": "0755"},
    ]
    text = to_yaml(documents)
    assert list(yaml.safe_load_all(text)) == documents
    assert text.startswith("---\n")
    assert "z: 1\na:\n" in text, text  # key order kept, nested mappings in block style
    assert "{k" not in text, text


def test_summary_is_cut_when_even_the_digest_is_too_long() -> None:
    text = summarize_for_ui(render(PyTorch(worker=Worker(replicas=1))), limit=300)
    assert len(text) <= 300
    assert text.endswith(UI_FOOTER + "\n")


def test_rendering_imports_no_airflow_kubernetes_or_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import airflow_provider_torchelastic.kubernetes.render, airflow_provider_torchelastic.core.pod_options\n"
        "from airflow_provider_torchelastic.core.config import Elastic\n"
        "from airflow_provider_torchelastic.core.pod_options import PodOptions\n"
        "from airflow_provider_torchelastic.kubernetes.render import check_renderable\n"
        "check_renderable(Elastic(nnodes=2), image='i:1', pod_options=PodOptions(labels={'a': 'b'}))\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'airflow', 'kubernetes', 'torch', 'yaml'})\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_a_manifests_xcom_from_before_the_payload_was_a_secret_is_still_elided() -> None:
    """execute_complete reads the manifests XCom that the deferring try pushed, maybe before an upgrade."""
    legacy = {"kind": "ConfigMap", "metadata": {"name": "j-payload"}, "binaryData": {PAYLOAD_KEY: "YWJj"}}
    assert elide_payload(legacy)["binaryData"][PAYLOAD_KEY] == "<3 bytes, cloudpickle payload>"
    secret = render(Elastic(), payload=b"abcd")[0]
    assert elide_payload(secret)["data"][PAYLOAD_KEY] == "<4 bytes, cloudpickle payload>"
    assert elide_payload(elide_payload(secret)) == elide_payload(secret)
