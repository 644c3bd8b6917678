"""Rendered TrainJobs against the real contracts: the derived TrainJob and JobSet CRD schemas, the Trainer's webhook
rules (``trainjob_schemas.check_trainjob_rules``), the Pod schema of the pod the Trainer makes of them, and the
runner's settings from the env the torch plugin injects. The kind is not in the table of kinds yet, so every render
here names its renderer."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_torchelastic.core.config import Elastic, Master, PyTorch, RunPolicy, TaskConfig, Worker
from airflow_provider_torchelastic.core.launch import config_to_launch_spec, runner_command
from airflow_provider_torchelastic.core.naming import MAX_JOB_NAME_LENGTH, fit_job_name, job_name
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions, secret_key_ref
from airflow_provider_torchelastic.kubernetes.kinds import trainjob
from airflow_provider_torchelastic.kubernetes.pod_template import MAX_RESULT_BYTES, PAYLOAD_PATH, RESULT_FILE
from airflow_provider_torchelastic.kubernetes.sweep import lease_labels
from airflow_provider_torchelastic.runner.agent import parse_settings
from tests.contract import builders
from tests.contract.builders import IMAGE, identity
from tests.contract.schemas import KUBERNETES_VERSIONS, validate_pod_template, validate_secret
from tests.contract.trainjob_schemas import (
    MIRRORED_CEL_RULES,
    TORCH_DISTRIBUTED,
    TRAINJOB_CRD,
    TrainerRejection,
    check_trainjob_rules,
    jobset_for,
    load,
    pod_env,
    trainer_pod_template,
    validate_jobset,
    validate_trainjob,
)

GPUS = {"nvidia.com/gpu": "8"}
CONFIGS: dict[str, TaskConfig] = {
    "elastic-2": Elastic(nnodes=2),
    "elastic-3:3-nproc-8": Elastic(nnodes="3:3", nproc_per_node=8),
    "elastic-auto": Elastic(nnodes=4, nproc_per_node="auto", rdzv_configs={"join_timeout": 600}),
    "elastic-deadline": Elastic(nnodes=2, run_policy=RunPolicy(active_deadline_seconds=3600)),
    "master-worker": PyTorch(master=Master(limits=GPUS), worker=Worker(replicas=3, limits=GPUS), nproc_per_node=8),
    "master-worker-default": PyTorch(worker=Worker(replicas=1), start_method="fork"),
}
OPTIONS: dict[str, PodOptions | None] = {
    "none": None,
    # Every PodOptions field that has a place in a TrainJob.
    "full": PodOptions(
        image_pull_secrets=["regcred"],
        env={"WANDB_PROJECT": "nightly", "HF_TOKEN": secret_key_ref("hf", "token")},
        requests={"cpu": "16", "memory": "64Gi"},
        limits=GPUS,
        node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}],
        volume_mounts=[{"name": "data", "mountPath": "/data", "readOnly": True}],
        service_account_name="trainer",
        labels={"kueue.x-k8s.io/queue-name": "team-a", "example.com/team": "ml"},
        annotations={"example.com/owner": "ml-platform"},
        shm_size="16Gi",
    ),
    # The pod template's parts with a place: pod and container security, the grace period (not schedulingGates:
    # Kubernetes 1.25, the oldest we claim, has no such field).
    "template": PodOptions(
        shm_size=None,
        pod_template={
            "spec": {
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                "terminationGracePeriodSeconds": 60,
                "containers": [
                    {
                        "name": "pytorch",
                        "image": "registry.example.com/ml/template:1",
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                        "env": [{"name": "FROM_TEMPLATE", "value": "1"}],
                        "resources": {"limits": {"memory": "32Gi"}},
                    }
                ],
            }
        },
    ),
}


def render(
    config: TaskConfig,
    *,
    pod_options: PodOptions | None = None,
    job_options: JobOptions | None = None,
    runtime: trainjob.Runtime = trainjob.TORCH_DISTRIBUTED,
    image: str | None = IMAGE,
    **identity_overrides: Any,
) -> list[dict[str, Any]]:
    return builders.render(
        config,
        pod_options=pod_options,
        job_options=job_options,
        image=image,
        renderer=functools.partial(trainjob.render_trainjob, runtime=runtime),
        **identity_overrides,
    )


def check_all_contracts(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """Every contract of one render; the TrainJob."""
    secret, job = manifests
    runtime = load(TORCH_DISTRIBUTED)
    validate_trainjob(job)
    check_trainjob_rules(job, runtime)
    jobset = jobset_for(job, runtime)
    validate_jobset(jobset)
    template = trainer_pod_template(jobset)
    for version in KUBERNETES_VERSIONS:
        validate_secret(secret, version)
        validate_pod_template(template, version)
    # The pods mount the payload Secret this render made.
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["torchelastic-payload"]["secret"]["secretName"] == secret["metadata"]["name"]
    return job


@pytest.mark.parametrize("options", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_every_valid_configuration_renders_a_trainjob_the_contracts_accept(config: str, options: str) -> None:
    job = check_all_contracts(render(CONFIGS[config], pod_options=OPTIONS[options]))
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }


def test_job_options_render_and_meet_the_contracts() -> None:
    job = check_all_contracts(render(Elastic(nnodes=2), job_options=JobOptions(suspend=True)))
    assert job["spec"]["suspend"] is True
    assert "suspend" not in check_all_contracts(render(Elastic(nnodes=2)))["spec"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.integers(min_value=2, max_value=99_999),
    nproc=st.one_of(st.integers(min_value=1, max_value=64), st.sampled_from(["auto", "cpu", "gpu"])),
    dag_id=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=200),
    task_id=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=200),
    try_number=st.integers(min_value=1, max_value=9),
)
def test_any_node_count_and_identity_renders_names_jobset_accepts(
    nodes: int, nproc: int | str, dag_id: str, task_id: str, try_number: int
) -> None:
    config = Elastic(nnodes=nodes, nproc_per_node=nproc)
    _, job = render(config, dag_id=dag_id, task_id=task_id, try_number=try_number)
    validate_trainjob(job)
    check_trainjob_rules(job, load(TORCH_DISTRIBUTED))
    name = job["metadata"]["name"]
    assert len(name) <= trainjob.TORCH_DISTRIBUTED.max_job_name_length == 44
    assert name == trainjob.trainjob_name(identity(dag_id=dag_id, task_id=task_id, try_number=try_number))
    assert len(f"{trainjob.node_hostname(name, nodes - 1)}-abcde") <= 63
    assert job["spec"]["trainer"]["numNodes"] == nodes
    assert job["spec"]["trainer"].get("numProcPerNode") == (nproc if isinstance(nproc, int) else None)


# ------------------------------------------------------------------------------------------- what maps where


def test_the_trainer_block_carries_the_runner_and_the_node_settings() -> None:
    config = PyTorch(master=Master(limits=GPUS), worker=Worker(replicas=3, limits=GPUS), nproc_per_node=8)
    _, job = render(config, pod_options=PodOptions(requests={"cpu": "16"}))
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 4 and trainer["numProcPerNode"] == 8
    assert trainer["image"] == IMAGE
    assert trainer["resourcesPerNode"] == {"requests": {"cpu": "16"}, "limits": GPUS}
    launch = config_to_launch_spec(config)
    expected = runner_command(
        launch,
        payload_path=PAYLOAD_PATH,
        result_file=RESULT_FILE,
        max_result_bytes=MAX_RESULT_BYTES,
        payload_sha256=trainer["command"][trainer["command"].index("--payload-sha256") + 1],
    )
    assert trainer["command"] == expected and "--nnodes" not in trainer["command"]
    env = {item["name"]: item for item in trainer["env"]}
    assert not set(env) & trainjob.RESERVED_ENV
    assert {"TORCHELASTIC_CONTEXT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHONUNBUFFERED", "TORCHELASTIC_IMAGE"} <= set(
        env
    )


def _patch(job: dict[str, Any]) -> dict[str, Any]:
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == trainjob.PATCH_MANAGER == "torchelastic.airflow.apache.org/provider"
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"
    pod: dict[str, Any] = rjob["template"]["spec"]["template"]
    return pod


def test_the_patch_carries_the_payload_the_labels_and_the_pod_options() -> None:
    options = OPTIONS["full"]
    assert options is not None
    _, job = render(Elastic(nnodes=2), pod_options=options)
    pod = _patch(job)
    (node,) = pod["spec"]["containers"]
    assert node["name"] == "node" and "env" not in node  # the webhook refuses env on the node container's patch
    assert {m["mountPath"] for m in node["volumeMounts"]} == {"/var/run/torchelastic", "/dev/shm", "/data"}
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"torchelastic-payload", "dshm", "data"}
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["nodeSelector"] == dict(options.node_selector)
    assert pod["spec"]["tolerations"] == list(options.tolerations)
    # The provider's labels reach the pods (the wait, the sweep and the UI select by them); the queue label stays on
    # the TrainJob, the workload Kueue admits.
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "airflow-provider-torchelastic"
    assert labels["torchelastic.airflow.apache.org/identity"] == identity().digest
    assert labels["example.com/team"] == "ml" and "kueue.x-k8s.io/queue-name" not in labels
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "ml-platform"


def test_the_template_container_is_the_node_container() -> None:
    _, job = render(Elastic(nnodes=2), pod_options=OPTIONS["template"], image=None)
    trainer, pod = job["spec"]["trainer"], _patch(job)
    assert trainer["image"] == "registry.example.com/ml/template:1"
    assert trainer["resourcesPerNode"] == {"limits": {"memory": "32Gi"}}
    assert {"name": "FROM_TEMPLATE", "value": "1"} in trainer["env"]
    (node,) = pod["spec"]["containers"]
    assert node["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60


def test_deadline_and_suspend_are_the_trainjobs_own() -> None:
    config = Elastic(nnodes=2, run_policy=RunPolicy(active_deadline_seconds=600))
    _, job = render(config, job_options=JobOptions(suspend=True))
    assert job["spec"]["activeDeadlineSeconds"] == 600 and job["spec"]["suspend"] is True


@pytest.mark.parametrize("config", ["elastic-2", "elastic-3:3-nproc-8", "master-worker"])
def test_the_runner_reads_node_count_rank_and_master_from_the_trainers_env(config: str) -> None:
    """The torch plugin's PET_* (as the Trainer injects them) and the rendered command give every node the same
    static rendezvous on node 0's address, and each its own rank."""
    _, job = render(CONFIGS[config])
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    template = trainer_pod_template(jobset_for(job, load(TORCH_DISTRIBUTED)))
    node = next(c for c in template["spec"]["containers"] if c["name"] == "node")
    assert node["command"][:3] == ["python", "-m", "airflow_provider_torchelastic.runner"]
    for index in range(trainer["numNodes"]):
        settings = parse_settings(node["command"][3:], pod_env(template, index=index))
        assert settings.rdzv_backend == "static"
        assert settings.rdzv_endpoint == f"{trainjob.node_hostname(name, 0)}.{name}:29500"
        assert settings.rdzv_configs["rank"] == index
        assert settings.min_nodes == settings.max_nodes == trainer["numNodes"]
        assert settings.nproc_per_node == str(config_to_launch_spec(CONFIGS[config]).nproc_per_node)


# ------------------------------------------------------------------------------------------- what has no place


@pytest.mark.parametrize(
    ("pod_options", "job_options", "named"),
    [
        (PodOptions(image_pull_policy="Always"), None, "PodOptions.image_pull_policy"),
        (PodOptions(env_from=[{"secretRef": {"name": "s3"}}]), None, "PodOptions.env_from"),
        (PodOptions(priority_class_name="high"), None, "PodOptions.priority_class_name"),
        (PodOptions(automount_service_account_token=True), None, "PodOptions.automount_service_account_token"),
        (PodOptions(automount_service_account_token=False), None, "PodOptions.automount_service_account_token"),
        (PodOptions(pod_template={"spec": {"hostNetwork": True}}), None, "pod_template.spec.hostNetwork"),
        (
            PodOptions(pod_template={"spec": {"initContainers": [{"name": "fetch", "image": "busybox"}]}}),
            None,
            "pod_template.spec.initContainers",
        ),
        (
            PodOptions(pod_template={"spec": {"containers": [{"name": "sidecar", "image": "envoy"}]}}),
            None,
            "containers['sidecar']",
        ),
        (
            PodOptions(pod_template={"spec": {"containers": [{"name": "pytorch", "workingDir": "/w"}]}}),
            None,
            "containers['pytorch'].workingDir",
        ),
        (
            PodOptions(
                pod_template={
                    "spec": {"containers": [{"name": "pytorch", "ports": [{"name": "m", "containerPort": 9}]}]}
                }
            ),
            None,
            "containers['pytorch'].ports",
        ),
        (
            PodOptions(
                pod_template={
                    "spec": {"containers": [{"name": "pytorch", "env": [{"name": "PET_NNODES", "value": "9"}]}]}
                }
            ),
            None,
            "env['PET_NNODES']",
        ),
        (PodOptions(), JobOptions(scheduling_policy={"queue": "q"}), "JobOptions.scheduling_policy"),
        (
            PodOptions(
                volumes=[{"name": "data", "emptyDir": {}}],
                volume_mounts=[
                    {"name": "data", "mountPath": "/a", "subPath": "a"},
                    {"name": "data", "mountPath": "/b", "subPath": "b"},
                ],
            ),
            None,
            "volumeMounts['data']",
        ),
    ],
)
def test_what_a_trainjob_has_no_place_for_is_an_error_naming_it(
    pod_options: PodOptions, job_options: JobOptions | None, named: str
) -> None:
    with pytest.raises(ValueError, match="a TrainJob cannot take") as raised:
        render(Elastic(nnodes=2), pod_options=pod_options, job_options=job_options)
    assert named in str(raised.value)


# ------------------------------------------------------------------------------------------- names


def test_a_long_name_is_cut_to_the_trainjob_budget_keeping_its_hash() -> None:
    long = identity(dag_id="a" * 120, task_id="b" * 120)
    _, job = render(Elastic(nnodes=99_999), dag_id="a" * 120, task_id="b" * 120)
    name = job["metadata"]["name"]
    full = job_name(long)
    assert len(full) == MAX_JOB_NAME_LENGTH and len(name) == 44
    assert name.endswith(long.digest) and name == fit_job_name(full, 44) == trainjob.trainjob_name(long)
    assert len(trainjob.node_hostname(name, 99_998) + "-abcde") == 63
    # Another try, another name; the same try, the same name.
    assert trainjob.trainjob_name(identity(dag_id="a" * 120, task_id="b" * 120, try_number=2)) != name
    check_trainjob_rules(job, load(TORCH_DISTRIBUTED))


def test_a_name_that_fits_is_kept_and_a_foreign_name_is_refused() -> None:
    assert fit_job_name("train-abcdef0123", 44) == "train-abcdef0123"
    with pytest.raises(ValueError, match="expected a job_name"):
        fit_job_name("x" * 60, 44)


def test_a_runtime_with_longer_replicated_jobs_leaves_less_room() -> None:
    runtime = trainjob.Runtime(
        name="torch-with-init",
        containers={"node": ("node",), "dataset-initializer": ("dataset-initializer",)},
    )
    assert runtime.max_job_name_length == 63 - len("-dataset-initializer-0-") - 5 - 6
    _, job = render(Elastic(nnodes=2), runtime=runtime, dag_id="d" * 80)
    assert len(job["metadata"]["name"]) == runtime.max_job_name_length
    assert job["spec"]["runtimeRef"]["name"] == "torch-with-init"


# ------------------------------------------------------------------------------------------- the webhook's rules


def _cel_rules(schema: dict[str, Any], path: str = "") -> set[tuple[str, str]]:
    found = {(path, rule["rule"]) for rule in schema.get("x-kubernetes-validations", [])}
    for name, sub in (schema.get("properties") or {}).items():
        found |= _cel_rules(sub, f"{path}.{name}".lstrip("."))
    if "items" in schema:
        found |= _cel_rules(schema["items"], f"{path}[]")
    return found


def test_every_cel_rule_of_the_crd_is_mirrored() -> None:
    """The schema check cannot run CEL: each rule outside status is mirrored by check_trainjob_rules, and a new
    upstream rule fails here until it is."""
    (version,) = load(TRAINJOB_CRD)["spec"]["versions"]
    rules = {(path, rule) for path, rule in _cel_rules(version["schema"]["openAPIV3Schema"]) if "status" not in path}
    assert rules == MIRRORED_CEL_RULES


def _job() -> dict[str, Any]:
    return copy.deepcopy(render(Elastic(nnodes=2))[1])


def test_the_lease_renewal_keeps_the_immutable_fields_and_a_trainer_change_is_refused() -> None:
    runtime = load(TORCH_DISTRIBUTED)
    job = copy.deepcopy(render(Elastic(nnodes=2, run_policy=RunPolicy(active_deadline_seconds=600)))[1])
    # What the provider changes on a live TrainJob: the lease label (the waiter's patch); Kueue flips suspend.
    renewed = copy.deepcopy(job)
    renewed["metadata"]["labels"].update(lease_labels(2_000_000_000))
    renewed["spec"]["suspend"] = True
    check_trainjob_rules(renewed, runtime, old=job)
    for key, field, value in (
        ("trainer", "numNodes", 3),
        ("trainer", "image", "other/image:2"),
        ("runtimeRef", "name", "other"),
    ):
        changed = copy.deepcopy(job)
        changed["spec"][key][field] = value
        with pytest.raises(TrainerRejection, match=f"spec.{key}: field is immutable"):
            check_trainjob_rules(changed, runtime, old=job)
    changed = copy.deepcopy(job)
    changed["spec"]["activeDeadlineSeconds"] = 5
    with pytest.raises(TrainerRejection, match="activeDeadlineSeconds: field is immutable"):
        check_trainjob_rules(changed, runtime, old=job)
    changed = copy.deepcopy(job)
    _patch(changed)["spec"]["volumes"].append({"name": "extra", "emptyDir": {}})
    with pytest.raises(TrainerRejection, match="volumes: field is immutable"):
        check_trainjob_rules(changed, runtime, old=job)


def _broken(edit: str) -> dict[str, Any]:
    job = _job()
    pod = _patch(job)
    if edit == "reserved-env":
        job["spec"]["trainer"]["env"].append({"name": "PET_NODE_RANK", "value": "0"})
    elif edit == "uppercase-name":
        job["metadata"]["name"] = "Train-abc"
    elif edit == "long-name":
        job["metadata"]["name"] = "t" * 64
    elif edit == "managed-by":
        job["spec"]["managedBy"] = "example.com/mine"
    elif edit == "node-env":
        pod["spec"]["containers"][0]["env"] = [{"name": "X", "value": "1"}]
    elif edit == "unknown-container":
        pod["spec"]["containers"].append({"name": "sidecar"})
    elif edit == "unknown-job":
        job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["name"] = "x"
    elif edit == "manager":
        job["spec"]["runtimePatches"][0]["manager"] = "provider"
    elif edit == "pod-names":
        job["metadata"]["name"] = "t" * 44
        job["spec"]["trainer"]["numNodes"] = 100_001
    return job


@pytest.mark.parametrize(
    "edit",
    [
        "reserved-env",
        "uppercase-name",
        "long-name",
        "managed-by",
        "node-env",
        "unknown-container",
        "unknown-job",
        "manager",
        "pod-names",
    ],
)
def test_the_webhook_mirror_refuses_what_the_trainer_refuses(edit: str) -> None:
    with pytest.raises(TrainerRejection):
        check_trainjob_rules(_broken(edit), load(TORCH_DISTRIBUTED))


def test_the_api_server_refuses_two_mounts_of_one_volume_in_a_patch() -> None:
    job = _job()
    mounts = _patch(job)["spec"]["containers"][0]["volumeMounts"]
    mounts.append({**mounts[0], "mountPath": "/elsewhere"})
    with pytest.raises(TrainerRejection, match="duplicate"):
        validate_trainjob(job)


@pytest.mark.parametrize("config", [Elastic(nnodes="2:4"), Elastic(nnodes=1), Elastic(nnodes=2, max_restarts=1)])
def test_the_renderer_refuses_what_a_trainjob_cannot_run(config: Elastic) -> None:
    with pytest.raises(ValueError, match="a TrainJob cannot take"):
        render(config)
