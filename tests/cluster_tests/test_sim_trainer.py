"""The simulated Trainer v2 / JobSet / Indexed Job controllers: their pure decisions, then TrainJobs on the local
cluster (a real kube-apiserver, this controller as a subprocess, the simulated kubelet running the pods).

The cluster does not install the Trainer CRDs or start this controller on ``up`` (yet): the module fixture does both
(:func:`tests.cluster.sim_trainer.install` with the RBAC for the ``sim-operator`` identity, then ``python -m
tests.cluster.sim_trainer`` under that identity), unless the cluster already runs one (its state dir has
``logs/sim-trainer.log`` or ``sim-trainer.pid``).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.cluster import sim_kubelet as sk
from tests.cluster import sim_trainer as st
from tests.cluster.sim_operator import to_rfc3339

T = TypeVar("T")
IMAGE = "registry.example/torchelastic-test:1"
NOW = 1_700_000_000.0
REPO_ROOT = Path(__file__).resolve().parents[2]
RUNTIME = yaml.safe_load((REPO_ROOT / "tests" / "crds" / st.RUNTIME_FILE).read_text())

# ----------------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------------


def trainjob(name: str = "tj", *, patches: list[dict[str, Any]] | None = None, **trainer: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "runtimeRef": {"name": "torch-distributed"},
        "trainer": {"image": IMAGE, "command": ["python", "-c", "pass"], **trainer},
    }
    if patches:
        spec["runtimePatches"] = patches
    return {
        "apiVersion": st.TRAINER_API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": "ns", "uid": "tj-uid", "creationTimestamp": to_rfc3339(NOW)},
        "spec": spec,
    }


def node_patch(
    manager: str = "example.com/test", *, pod_meta: dict[str, Any] | None = None, **pod_spec: Any
) -> dict[str, Any]:
    template: dict[str, Any] = {"spec": pod_spec}
    if pod_meta:
        template["metadata"] = pod_meta
    return {
        "manager": manager,
        "trainingRuntimeSpec": {
            "template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": template}}}]}}
        },
    }


def jobset_of(tj: dict[str, Any], runtime: dict[str, Any] = RUNTIME) -> dict[str, Any]:
    js = st.jobset_defaults(st.build_jobset(tj, runtime))
    js["metadata"]["uid"] = "js-uid"
    return js


def job_of(js: dict[str, Any], index: int = 0) -> dict[str, Any]:
    rjob, i, g, gi, gr = st.job_indexes(js)[index]
    job = st.render_job(js, rjob, i, g, gi, gr)
    job["metadata"]["uid"] = "job-uid"
    job["spec"].setdefault("backoffLimit", 6)
    return job


def pod_of(job: dict[str, Any], index: int, phase: str = "Running", restarts: int = 0, ready: bool = True) -> Any:
    pod = st.render_indexed_pod(job, index)
    pod["metadata"]["name"] = f"{pod['metadata']['generateName']}{index:05d}"
    pod["metadata"]["uid"] = f"pod-{index}-{phase}"
    pod["status"] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready and phase == "Running" else "False"}],
        "containerStatuses": [{"name": "node", "restartCount": restarts}],
    }
    return pod


def has(d: dict[str, Any], expected: dict[str, Any]) -> bool:
    """``d`` has every key of ``expected`` with its value."""
    return {k: d.get(k) for k in expected} == expected


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions") or []}


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def node_container(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]
    if "replicatedJobs" in spec:
        spec = spec["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    elif "template" in spec:
        spec = spec["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "node")


def env_map(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


# ----------------------------------------------------------------------------------------------------------------
# Pure: names, the TrainJob -> JobSet merge, the torch env
# ----------------------------------------------------------------------------------------------------------------


def test_names() -> None:
    assert st.job_name("tj", "node", 0) == "tj-node-0"
    assert st.pod_hostname("tj-node-0", 1) == "tj-node-0-1"
    assert st.master_addr("my-job") == "my-job-node-0-0.my-job"
    assert st.pod_hostname("a" * 62 + "-x", 0) == "a" * 62  # cut to 63, no trailing "-"
    assert st.runtime_registry_key({"name": "x"}) == "ClusterTrainingRuntime.trainer.kubeflow.org"
    assert st.runtime_registry_key({"name": "x", "kind": "TrainingRuntime"}) in st.SUPPORTED_RUNTIMES
    assert st.runtime_registry_key({"name": "x", "kind": "Foo", "apiGroup": "a.io"}) == "Foo.a.io"


def test_the_runtime_yaml_has_no_restart_policy_or_backoff_limit() -> None:
    """What the pods run under comes from defaults: the JobSet webhook's OnFailure and the API server's 6."""
    rjob = RUNTIME["spec"]["template"]["spec"]["replicatedJobs"][0]
    assert "restartPolicy" not in rjob["template"]["spec"]["template"]["spec"]
    assert "backoffLimit" not in rjob["template"]["spec"]
    js = jobset_of(trainjob())
    pod_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod_spec["restartPolicy"] == "OnFailure"
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["completionMode"] == "Indexed"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}


def test_trainer_block_and_torch_env_on_the_node_container() -> None:
    tj = trainjob(
        numNodes=3,
        args=["--x"],
        env=[{"name": "A", "value": "1"}],
        resourcesPerNode={"limits": {"cpu": "1500m", "memory": "1Gi"}},
    )
    js = jobset_of(tj)
    assert js["metadata"]["name"] == "tj" and js["metadata"]["namespace"] == "ns"
    assert js["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "name": "tj",
            "uid": "tj-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    job_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job_spec["parallelism"], job_spec["completions"]) == (3, 3)
    c = node_container(js)
    assert (c["image"], c["command"], c["args"]) == (IMAGE, ["python", "-c", "pass"], ["--x"])
    assert c["resources"] == {"limits": {"cpu": "1500m", "memory": "1Gi"}}
    assert env_map(c) == {
        "A": "1",
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "2",  # auto without a GPU: the CPU limit, rounded up
        "PET_NODE_RANK": {
            "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
        },
        "PET_MASTER_ADDR": "tj-node-0-0.tj",
        "PET_MASTER_PORT": "29500",
    }
    assert c["ports"] == [{"containerPort": 29500, "protocol": "TCP"}]


def cpu(quantity: str, where: str = "requests") -> dict[str, Any]:
    return {"resourcesPerNode": {where: {"cpu": quantity}}}


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        # The cases of kubeflow/trainer v2.3.0 pkg/runtime/framework/plugins/torch/torch_test.go (their names),
        # whose TrainJob container resources are requests:
        pytest.param(cpu("4"), "4", id="nproc_per_node=auto with CPU limit"),
        pytest.param({}, "1", id="nproc_per_node=auto with no CPU resources"),
        pytest.param(cpu("2"), "2", id="nproc_per_node=auto with low CPU limit"),
        pytest.param(cpu("3"), "3", id="nproc_per_node=auto with CPU request but no limit"),
        pytest.param(cpu("2.5"), "3", id="nproc_per_node=auto with millicore CPU limit"),
        pytest.param(cpu("0.7"), "1", id="nproc_per_node=auto with fractional CPU limit"),
        pytest.param(cpu("2500m"), "3", id="nproc_per_node=auto with millicore CPU limit in m format"),
        pytest.param(cpu("3.7"), "4", id="nproc_per_node=cpu with fractional CPU"),
        pytest.param(
            {"resourcesPerNode": {"requests": {"cpu": "6", "nvidia.com/gpu": "2"}}},
            "auto",
            id="nproc_per_node=auto resolves to GPU count when GPU resources present",
        ),
        # getNumCPUPerNode: requests before limits (v2.0.0 read the limits first); a zero request reads the limit.
        pytest.param({"resourcesPerNode": {"limits": {"cpu": "2"}, "requests": {"cpu": "1"}}}, "1", id="request-wins"),
        pytest.param(cpu("4", "limits"), "4", id="limit-only"),
        pytest.param({"resourcesPerNode": {"limits": {"cpu": "2"}, "requests": {"cpu": "0"}}}, "2", id="zero-request"),
        pytest.param({"resourcesPerNode": {"limits": {"memory": "1Gi"}}}, "1", id="no-cpu"),
        # GetNumGPUPerNode: a GPU in the limits only counts too; a zero GPU count is no GPU.
        pytest.param({"resourcesPerNode": {"limits": {"nvidia.com/gpu": "1"}}}, "auto", id="gpu-limit"),
        pytest.param({"resourcesPerNode": {"requests": {"cpu": "2", "nvidia.com/gpu": "0"}}}, "2", id="zero-gpu"),
        # An integer is never changed.
        pytest.param({"numProcPerNode": 4}, "4", id="int"),
        pytest.param({"numProcPerNode": 4, **cpu("2")}, "4", id="int-with-cpu"),
    ],
)
def test_nproc_per_node_is_v2_3_0s(trainer: dict[str, Any], expected: str) -> None:
    assert st.nproc_per_node(trainer) == expected


def test_nproc_per_node_reads_the_runtimes_resources_when_the_trainjob_has_none() -> None:
    """``ExtractResourcePerNodeFromRuntime``: the runtime's ``node`` container resources stand in; the TrainJob's
    ``resourcesPerNode`` replaces them whole."""
    runtime = copy.deepcopy(RUNTIME)
    node_job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    node_job["template"]["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "3"}}
    assert env_map(node_container(jobset_of(trainjob(), runtime)))["PET_NPROC_PER_NODE"] == "3"
    assert env_map(node_container(jobset_of(trainjob(**cpu("2")), runtime)))["PET_NPROC_PER_NODE"] == "2"
    assert env_map(node_container(jobset_of(trainjob())))["PET_NPROC_PER_NODE"] == "1"  # the default runtime


def test_num_nodes_defaults_to_the_runtime_ml_policy() -> None:
    assert st.num_nodes_of(trainjob(), RUNTIME) == 1
    assert st.num_nodes_of(trainjob(numNodes=2), RUNTIME) == 2


def test_runtime_env_is_merged_by_name() -> None:
    runtime = copy.deepcopy(RUNTIME)
    node_container(runtime["spec"]["template"])["env"] = [{"name": "A", "value": "rt"}, {"name": "B", "value": "rt"}]
    js = jobset_of(trainjob(env=[{"name": "B", "value": "tj"}, {"name": "C", "value": "tj"}]), runtime)
    env = env_map(node_container(js))
    assert (env["A"], env["B"], env["C"]) == ("rt", "tj", "tj")


def test_runtime_patches_reach_the_pod_template() -> None:
    patch = node_patch(
        pod_meta={"labels": {"team": "a"}, "annotations": {"note": "x"}},
        serviceAccountName="sa",
        nodeSelector={"pool": "gpu"},
        tolerations=[{"key": "k", "operator": "Exists"}],
        volumes=[{"name": "payload", "configMap": {"name": "cm"}}],
        containers=[
            {
                "name": "node",
                "volumeMounts": [{"name": "payload", "mountPath": "/payload"}],
                "securityContext": {"runAsNonRoot": True},
            }
        ],
    )
    patch["trainingRuntimeSpec"]["template"]["metadata"] = {"labels": {"on-jobset": "1"}}
    js = jobset_of(trainjob(patches=[patch]))
    assert js["metadata"]["labels"] == {"on-jobset": "1"}
    template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"] == {"labels": {"team": "a"}, "annotations": {"note": "x"}}
    spec = template["spec"]
    assert (spec["serviceAccountName"], spec["nodeSelector"]) == ("sa", {"pool": "gpu"})
    assert spec["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert spec["volumes"] == [{"name": "payload", "configMap": {"name": "cm"}}]
    c = node_container(js)
    assert c["volumeMounts"] == [{"name": "payload", "mountPath": "/payload"}]
    assert c["securityContext"] == {"runAsNonRoot": True}
    # Later patches win where they overlap.
    later = node_patch("example.com/later", volumes=[{"name": "payload", "emptyDir": {}}])
    js = jobset_of(trainjob(patches=[patch, later]))
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"] == [
        {"name": "payload", "emptyDir": {}}
    ]


# ----------------------------------------------------------------------------------------------------------------
# Pure: JobSet -> Job -> pods
# ----------------------------------------------------------------------------------------------------------------


def test_job_labels_annotations_subdomain_and_service() -> None:
    js = jobset_of(trainjob(numNodes=2))
    job = job_of(js)
    meta = job["metadata"]
    assert meta["name"] == "tj-node-0"
    assert meta["ownerReferences"][0] == {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "name": "tj",
        "uid": "js-uid",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    expected = {
        "jobset.sigs.k8s.io/jobset-name": "tj",
        "jobset.sigs.k8s.io/jobset-uid": "js-uid",
        "jobset.sigs.k8s.io/replicatedjob-name": "node",
        "jobset.sigs.k8s.io/replicatedjob-replicas": "1",
        "jobset.sigs.k8s.io/global-replicas": "1",
        "jobset.sigs.k8s.io/job-index": "0",
        "jobset.sigs.k8s.io/job-global-index": "0",
        "jobset.sigs.k8s.io/job-key": st.job_key("ns", "tj-node-0"),
        "jobset.sigs.k8s.io/group-name": "default",
        "jobset.sigs.k8s.io/group-replicas": "1",
        "jobset.sigs.k8s.io/job-group-index": "0",
        "jobset.sigs.k8s.io/restart-attempt": "0",
    }
    assert meta["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer", **expected}
    assert {k: v for k, v in meta["annotations"].items() if k.startswith("jobset.")} == expected
    assert meta["annotations"][st.ANN_COMPLETION_MODE] == "Indexed"
    pod_template = job["spec"]["template"]
    assert pod_template["metadata"]["labels"] == expected
    assert pod_template["spec"]["subdomain"] == "tj"
    svc = st.render_headless_service(js)
    assert svc["metadata"]["name"] == "tj"
    assert svc["spec"] == {
        "clusterIP": "None",
        "selector": {"jobset.sigs.k8s.io/jobset-name": "tj"},
        "publishNotReadyAddresses": True,
    }


def test_indexed_pod() -> None:
    job = job_of(jobset_of(trainjob(numNodes=2)))
    pod = st.render_indexed_pod(job, 1)
    meta = pod["metadata"]
    assert meta["generateName"] == "tj-node-0-1-"
    assert meta["annotations"]["batch.kubernetes.io/job-completion-index"] == "1"
    assert meta["labels"]["batch.kubernetes.io/job-completion-index"] == "1"
    assert meta["labels"]["job-name"] == meta["labels"]["batch.kubernetes.io/job-name"] == "tj-node-0"
    assert meta["ownerReferences"][0]["kind"] == "Job" and meta["ownerReferences"][0]["controller"]
    assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == ("tj-node-0-1", "tj")
    env = env_map(pod["spec"]["containers"][0])
    assert env["JOB_COMPLETION_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    # The kubelet's downward API reads the index from the annotation.
    pod["metadata"]["name"] = "tj-node-0-1-abcde"
    assert sk.field_ref_value(pod, "metadata.annotations['batch.kubernetes.io/job-completion-index']") == "1"


def test_job_creates_one_pod_per_index_up_to_parallelism() -> None:
    js = jobset_of(trainjob(numNodes=3))
    job = job_of(js)
    plan = st.decide_job(job, [], NOW)
    assert plan.create == [0, 1, 2] and plan.status["active"] == 3
    job["spec"]["parallelism"] = 2
    assert st.decide_job(job, [], NOW).create == [0, 1]
    job["spec"]["parallelism"] = 3
    plan = st.decide_job(job, [pod_of(job, 0), pod_of(job, 2, "Succeeded")], NOW)
    assert plan.create == [1]


def test_job_completes_when_every_index_succeeded() -> None:
    job = job_of(jobset_of(trainjob(numNodes=2)))
    plan = st.decide_job(job, [pod_of(job, 0, "Succeeded"), pod_of(job, 1, "Succeeded")], NOW)
    # No pod terminating: the interim condition and the terminal one in one pass, with the same reason.
    assert conditions(plan.status) == {"SuccessCriteriaMet": "True", "Complete": "True"}
    assert condition(plan.status, "Complete")["reason"] == "CompletionsReached"
    assert plan.status["succeeded"] == 2 and plan.status["completedIndexes"] == "0-1"


def test_job_never_policy_backoff_limit_and_recreate() -> None:
    job = job_of(jobset_of(trainjob(numNodes=2)))
    job["spec"]["template"]["spec"]["restartPolicy"] = "Never"
    job["spec"]["backoffLimit"] = 1
    failed = pod_of(job, 1, "Failed")
    plan = st.decide_job(job, [pod_of(job, 0), failed], NOW)
    assert plan.create == [1] and "Failed" not in conditions(plan.status)  # a new pod for index 1
    second = pod_of(job, 1, "Failed")
    second["metadata"]["name"] += "b"
    plan = st.decide_job(job, [pod_of(job, 0), failed, second], NOW)
    cond = condition(plan.status, "FailureTarget")
    assert (cond["reason"], cond["message"]) == ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
    assert "Failed" not in conditions(plan.status)  # the active pod is terminating
    assert plan.delete == ["tj-node-0-0-00000"]  # the active pod goes; the failed ones stay


def test_job_on_failure_counts_restarts_of_active_pods() -> None:
    job = job_of(jobset_of(trainjob(numNodes=2)))
    assert "Failed" not in conditions(st.decide_job(job, [pod_of(job, 0), pod_of(job, 1, restarts=5)], NOW).status)
    plan = st.decide_job(job, [pod_of(job, 0), pod_of(job, 1, restarts=6)], NOW)
    assert condition(plan.status, "FailureTarget")["reason"] == "BackoffLimitExceeded"
    assert sorted(plan.delete) == ["tj-node-0-0-00000", "tj-node-0-1-00001"]


def test_job_suspend_resume_and_deadline() -> None:
    job = job_of(jobset_of(trainjob(numNodes=1)))
    job["metadata"]["annotations"][st.ANN_SUSPEND] = "true"
    job["spec"].pop("suspend")  # as a 1.20 API server stores it
    plan = st.decide_job(job, [pod_of(job, 0)], NOW)
    assert plan.delete == ["tj-node-0-0-00000"] and plan.create == []
    assert condition(plan.status, "Suspended")["reason"] == "JobSuspended"
    job["status"] = plan.status
    job["metadata"]["annotations"][st.ANN_SUSPEND] = "false"
    job["spec"]["activeDeadlineSeconds"] = 10
    plan = st.decide_job(job, [], NOW + 100)
    assert has(condition(plan.status, "Suspended"), {"status": "False", "reason": "JobResumed"})
    assert plan.create == [0] and plan.status["startTime"] == to_rfc3339(NOW + 100)
    assert plan.requeue_after == 10
    job["status"] = plan.status
    plan = st.decide_job(job, [pod_of(job, 0)], NOW + 111)
    assert condition(plan.status, "FailureTarget")["reason"] == "DeadlineExceeded"
    assert plan.delete == ["tj-node-0-0-00000"]


def terminating(pod: dict[str, Any]) -> dict[str, Any]:
    pod["metadata"]["deletionTimestamp"] = to_rfc3339(NOW)
    return pod


def test_job_failed_waits_for_its_deleted_pods_to_terminate() -> None:
    """Kubernetes 1.31+ (``delayTerminalCondition``): ``FailureTarget`` at once and the active pods deleted;
    ``Failed``, with its reason and message, and the event only once no pod is terminating. JobSet reads
    ``Complete``/``Failed`` only, so the JobSet (and the TrainJob) do not fail before the pods are gone."""
    job = job_of(jobset_of(trainjob(numNodes=2)))
    plan = st.decide_job(job, [pod_of(job, 0), pod_of(job, 1, restarts=6)], NOW)
    assert conditions(plan.status) == {"FailureTarget": "True"} and plan.events == []
    assert sorted(plan.delete) == ["tj-node-0-0-00000", "tj-node-0-1-00001"]
    job["status"] = plan.status
    assert st.job_finished(job) is None
    # Still terminating (deleted, Running): no new pod, no Failed, nothing deleted again.
    gone = [terminating(pod_of(job, 0)), terminating(pod_of(job, 1, restarts=6))]
    plan = st.decide_job(job, gone, NOW + 5)
    assert conditions(plan.status) == {"FailureTarget": "True"} and plan.create == [] and plan.delete == []
    # One stopped (Failed phase), one gone from the API: Failed, copied from FailureTarget.
    plan = st.decide_job(job, [terminating(pod_of(job, 0, "Failed"))], NOW + 30)
    cond = condition(plan.status, "Failed")
    assert (cond["reason"], cond["message"]) == ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
    assert cond["lastTransitionTime"] == to_rfc3339(NOW + 30)
    assert plan.events == [("Warning", "BackoffLimitExceeded", "Job has reached the specified backoff limit")]
    job["status"] = plan.status
    assert st.job_finished(job) == "Failed"


def test_job_complete_waits_for_terminating_pods_too() -> None:
    job = job_of(jobset_of(trainjob(numNodes=1)))
    stale = terminating(pod_of(job, 0))
    stale["metadata"]["name"] += "x"
    plan = st.decide_job(job, [pod_of(job, 0, "Succeeded"), stale], NOW)
    assert conditions(plan.status) == {"SuccessCriteriaMet": "True"}
    job["status"] = plan.status
    plan = st.decide_job(job, [pod_of(job, 0, "Succeeded")], NOW + 1)
    assert conditions(plan.status) == {"SuccessCriteriaMet": "True", "Complete": "True"}
    assert plan.status["completionTime"] == to_rfc3339(NOW + 1)


def _jobset_pass(js: dict[str, Any], jobs: list[dict[str, Any]], pods: list[dict[str, Any]] | None = None) -> Any:
    return st.decide_jobset(js, jobs, lambda _job: pods or [], NOW)


def test_jobset_creates_jobs_and_completes() -> None:
    js = jobset_of(trainjob(numNodes=2))
    plan = _jobset_pass(js, [])
    assert [j["metadata"]["name"] for j in plan.create] == ["tj-node-0"]
    job = job_of(js)
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    plan = _jobset_pass(js, [job])
    cond = condition(plan.status, "Completed")
    assert (cond["reason"], cond["message"]) == ("AllJobsCompleted", "jobset completed successfully")
    assert plan.status["terminalState"] == "Completed"
    assert plan.status["replicatedJobsStatus"] == [
        {"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0, "suspended": 0}
    ]


def test_jobset_ready_counts_jobs_whose_pods_are_ready() -> None:
    js = jobset_of(trainjob(numNodes=2))
    job = job_of(js)
    plan = _jobset_pass(js, [job], [pod_of(job, 0), pod_of(job, 1)])
    assert has(plan.status["replicatedJobsStatus"][0], {"ready": 1, "active": 1})
    plan = _jobset_pass(js, [job], [pod_of(job, 0), pod_of(job, 1, ready=False)])
    assert plan.status["replicatedJobsStatus"][0]["ready"] == 0


def test_jobset_fails_with_the_first_failed_job() -> None:
    js = jobset_of(trainjob(numNodes=2))
    job = job_of(js)
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    plan = _jobset_pass(js, [job])
    cond = condition(plan.status, "Failed")
    assert cond["reason"] == "FailedJobs"
    assert cond["message"] == "jobset failed due to one or more job failures (first failed job: tj-node-0)"
    assert plan.status["terminalState"] == "Failed"


def test_jobset_max_restarts_recreates_then_fails() -> None:
    js = jobset_of(trainjob(numNodes=1))
    js["spec"]["failurePolicy"] = {"maxRestarts": 1}
    job = job_of(js)
    job["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    plan = _jobset_pass(js, [job])
    assert plan.delete == ["tj-node-0"] and plan.status["restarts"] == 1 and "Failed" not in conditions(plan.status)
    js["status"] = plan.status
    plan = _jobset_pass(js, [job])  # the old attempt's Job is stale: deleted, the new one created
    assert plan.delete == ["tj-node-0"]
    assert plan.create[0]["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1"
    new = plan.create[0]
    new["metadata"]["uid"] = "job2"
    new["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    plan = _jobset_pass(js, [new])
    assert condition(plan.status, "Failed")["reason"] == "ReachedMaxRestarts"


def test_jobset_suspend_propagates_to_jobs() -> None:
    js = jobset_of(trainjob(numNodes=1))
    job = job_of(js)
    js["spec"]["suspend"] = True
    plan = _jobset_pass(js, [job])
    assert plan.suspend == {"tj-node-0": True}
    assert condition(plan.status, "Suspended")["reason"] == "SuspendedJobs"
    js["status"], js["spec"]["suspend"] = plan.status, False
    job["metadata"]["annotations"][st.ANN_SUSPEND] = "true"
    job["spec"]["suspend"] = True
    plan = _jobset_pass(js, [job])
    assert plan.suspend == {"tj-node-0": False}
    cond = condition(plan.status, "Suspended")
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "ResumeJobs", "jobset is resumed")


KUEUE = "kueue.x-k8s.io/manager"


def test_a_flavor_set_while_suspended_reaches_the_pods_on_resume() -> None:
    """Kueue admits a suspended TrainJob by adding its runtime patch (the flavor's nodeSelector and tolerations, a
    label) and unsuspending it. Upstream the Trainer builds and applies the JobSet again (jobset plugin ``Build``:
    it does so while the TrainJob or its JobSet is suspended), and JobSet's ``resumeJob`` merges the template's
    labels, annotations, nodeSelector, tolerations and schedulingGates into each suspended Job before resuming it."""
    tj = trainjob(numNodes=1, patches=[node_patch(nodeSelector={"zone": "a"}, tolerations=[{"key": "own"}])])
    tj["spec"]["suspend"] = True
    js = jobset_of(tj)
    job = job_of(js)
    assert st.job_suspended(job)
    # Admission: Kueue's patch added, suspend false; the Trainer's re-apply carries both to the JobSet.
    tolerations = [{"key": "own"}, {"key": "flavor", "operator": "Exists", "effect": "NoSchedule"}]
    admitted = copy.deepcopy(tj)
    admitted["spec"]["suspend"] = False
    admitted["spec"]["runtimePatches"].append(
        node_patch(
            KUEUE,
            pod_meta={"labels": {"kueue.x-k8s.io/podset": "node"}},
            nodeSelector={"pool": "big"},
            tolerations=tolerations[1:],
        )
    )
    patch = st.reapplied_jobset(st.jobset_defaults(st.build_jobset(admitted, RUNTIME)))
    assert patch["spec"]["suspend"] is False
    js["spec"].update(patch["spec"])
    plan = _jobset_pass(js, [job])
    assert plan.suspend == {"tj-node-0": False}
    merged = plan.resume["tj-node-0"]
    assert merged["spec"]["nodeSelector"] == {"zone": "a", "pool": "big"}
    assert merged["spec"]["tolerations"] == tolerations  # a union: the Job's own kept once
    assert merged["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "node"
    assert merged["metadata"]["labels"][st.L_JOBSET_NAME] == "tj"  # the Job's template labels stay
    # The Job keeps the merge in an annotation (1.20 refuses a template update); its pods are made from it.
    job["metadata"]["annotations"][st.ANN_POD_TEMPLATE] = json.dumps(merged)
    pod = st.render_indexed_pod(job, 0)
    assert pod["spec"]["nodeSelector"] == {"zone": "a", "pool": "big"} and pod["spec"]["tolerations"] == tolerations
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "node"
    assert pod["metadata"]["labels"][st.L_COMPLETION_INDEX] == "0"


def test_a_running_jobset_is_not_resumed_twice() -> None:
    """A Job already running gets no resume merge: only suspended Jobs are resumed (``resumeJobsIfNecessary``)."""
    js = jobset_of(trainjob(numNodes=1))
    assert _jobset_pass(js, [job_of(js)]).resume == {}


# ----------------------------------------------------------------------------------------------------------------
# Pure: TrainJob status
# ----------------------------------------------------------------------------------------------------------------


def test_trainjob_copies_the_jobset_conditions_and_jobs_status() -> None:
    tj = trainjob()
    js = jobset_of(tj)
    message = "jobset failed due to one or more job failures (first failed job: tj-node-0)"
    js["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs", "message": message}],
        "replicatedJobsStatus": [
            {"name": "node", "ready": 0, "succeeded": 0, "failed": 1, "active": 0, "suspended": 0}
        ],
    }
    status, requeue, delete = st.trainjob_status(tj, js, NOW)
    cond = condition(status, "Failed")
    assert (cond["reason"], cond["message"]) == ("FailedJobs", message)
    assert status["jobsStatus"] == [
        {"name": "node", "ready": 0, "succeeded": 0, "failed": 1, "active": 0, "suspended": 0}
    ]
    assert (requeue, delete) == (None, False)
    js["status"]["conditions"] = [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted", "message": "m"}]
    status, _, _ = st.trainjob_status(tj, js, NOW)
    assert condition(status, "Complete")["reason"] == "AllJobsCompleted"


def test_trainjob_suspended_resumed_and_deadline() -> None:
    tj = trainjob()
    tj["spec"]["suspend"] = True
    status, _, _ = st.trainjob_status(tj, None, NOW)
    assert has(condition(status, "Suspended"), {"status": "True", "reason": "Suspended"})
    tj["status"], tj["spec"]["suspend"] = status, False
    tj["spec"]["activeDeadlineSeconds"] = 30
    status, requeue, delete = st.trainjob_status(tj, None, NOW + 100)
    assert has(condition(status, "Suspended"), {"status": "False", "reason": "Resumed"})
    assert requeue == 30 and not delete  # counted from the resume, not the creation
    tj["status"] = status
    status, requeue, delete = st.trainjob_status(tj, None, NOW + 131)
    assert condition(status, "Failed")["reason"] == "DeadlineExceeded" and delete


def test_managed_by() -> None:
    tj = trainjob()
    assert st.managed_here(tj)
    tj["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    assert not st.managed_here(tj)


# ----------------------------------------------------------------------------------------------------------------
# Pure: the kubelet's pod hostname DNS
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("tj-node-0-0.tj", ("ns", "tj-node-0-0", "tj")),
        ("tj-node-0-0.tj.other", ("other", "tj-node-0-0", "tj")),
        ("tj-node-0-0.tj.other.svc", ("other", "tj-node-0-0", "tj")),
        ("tj-node-0-0.tj.other.svc.cluster.local", ("other", "tj-node-0-0", "tj")),
        ("single", None),
        ("a.b.svc", None),
        ("Not_A_Host", None),
    ],
)
def test_split_pod_hostname(host: str, expected: tuple[str, str, str] | None) -> None:
    assert sk.split_pod_hostname(host, "ns") == expected


def test_pod_dns_hostname() -> None:
    assert sk.pod_dns_hostname({"metadata": {"name": "p"}, "spec": {"hostname": "h"}}) == "h"
    assert sk.pod_dns_hostname({"metadata": {"name": "p"}, "spec": {}}) == "p"


def test_kubelet_resolves_the_master_addr_to_node_0s_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PET_MASTER_ADDR=<tj>-node-0-0.<tj>`` names node 0's pod through its hostname and subdomain (the headless
    Service selects it): every node gets 127.0.0.1 and node 0's mapped port; HOSTNAME is the pod's hostname."""
    from kubernetes import client

    kubelet = sk.Kubelet(client.ApiClient(client.Configuration(host="https://127.0.0.1:6443")), tmp_path, Path("/py"))
    job = job_of(jobset_of(trainjob(numNodes=2)))
    pods = []
    for index in (0, 1):
        pod = st.render_indexed_pod(job, index)
        pod["metadata"] |= {"name": f"tj-node-0-{index}-abcde", "uid": f"u{index}"}
        pod["metadata"]["namespace"] = "ns"
        pods.append(pod)
        kubelet._pods[("ns", pod["metadata"]["name"])] = pod
    monkeypatch.setattr(
        kubelet, "_headless_selector", lambda ns, name: {st.L_JOBSET_NAME: "tj"} if (ns, name) == ("ns", "tj") else None
    )
    assert kubelet.resolve_cluster_host("tj-node-0-0.tj", "ns") == ("ns", "tj-node-0-0-abcde")
    assert kubelet.resolve_cluster_host("tj-node-0-9.tj", "ns") is None
    port = kubelet.ports.get("ns", "tj-node-0-0-abcde", 29500)
    for index, pod in enumerate(pods):
        spec = pod["spec"]["containers"][0]
        config = kubelet.container_process_config(pod, spec, tmp_path / "ns" / pod["metadata"]["name"])
        assert config.env["HOSTNAME"] == f"tj-node-0-{index}"
        assert (config.env["PET_MASTER_ADDR"], config.env["PET_MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert config.env["PET_NODE_RANK"] == config.env["JOB_COMPLETION_INDEX"] == str(index)


def test_install_files_are_the_derived_crds_then_the_runtime() -> None:
    names = [p.name for p in st.install_files()]
    assert names[-1] == st.RUNTIME_FILE
    assert "jobset.x-k8s.io_jobsets.derived.yaml" in names
    assert "trainer.kubeflow.org_trainjobs.derived.yaml" in names


def test_crds_are_made_acceptable_to_a_1_20_api_server() -> None:
    for path in st.install_files():
        obj = yaml.safe_load(path.read_text())
        fixed = st.for_api_server_1_20(obj)
        text = json.dumps(fixed)
        assert '"default": ""' not in text
        if obj["kind"] != "CustomResourceDefinition":
            assert fixed == obj
            continue

        def list_maps(node: Any) -> Iterator[dict[str, Any]]:
            if isinstance(node, dict):
                if node.get("x-kubernetes-list-type") == "map":
                    yield node
                for value in node.values():
                    yield from list_maps(value)
            elif isinstance(node, list):
                for item in node:
                    yield from list_maps(item)

        for node in list_maps(fixed):
            items = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in (items.get("required") or []) or "default" in items["properties"][key]
        assert fixed["spec"]["names"] == obj["spec"]["names"]


# ----------------------------------------------------------------------------------------------------------------
# Cluster
# ----------------------------------------------------------------------------------------------------------------

DDP_SCRIPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank={rank} world={world} allreduce={t.item()} host={os.environ['HOSTNAME']}", flush=True)
dist.destroy_process_group()
"""


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.3) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class Cluster:
    """Thin helpers over the sync client for one test; deletes what it created at the end."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.trainjobs: list[str] = []
        self.runtimes: list[str] = []

    def create_trainjob(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"] = {"name": body["metadata"]["name"], "namespace": self.namespace}
        created = self.custom.create_namespaced_custom_object(
            st.TRAINER_GROUP, st.TRAINER_VERSION, self.namespace, st.TRAINJOBS, body
        )
        self.trainjobs.append(body["metadata"]["name"])
        return dict(created)

    def create_runtime(self, body: dict[str, Any]) -> None:
        self.custom.create_cluster_custom_object(st.TRAINER_GROUP, st.TRAINER_VERSION, st.CLUSTER_RUNTIMES, body)
        self.runtimes.append(body["metadata"]["name"])

    def get(self, what: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.rest import ApiException

        try:
            if what == "trainjob":
                return dict(
                    self.custom.get_namespaced_custom_object(
                        st.TRAINER_GROUP, st.TRAINER_VERSION, self.namespace, st.TRAINJOBS, name
                    )
                )
            if what == "jobset":
                return dict(
                    self.custom.get_namespaced_custom_object(
                        st.JOBSET_GROUP, st.JOBSET_VERSION, self.namespace, st.JOBSETS, name
                    )
                )
            reader = {"job": self.batch.read_namespaced_job, "service": self.core.read_namespaced_service}[what]
            return dict(json.loads(reader(name, self.namespace, _preload_content=False).data))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def patch_trainjob(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            st.TRAINER_GROUP, st.TRAINER_VERSION, self.namespace, st.TRAINJOBS, name, patch
        )

    def delete_trainjob(self, name: str, propagation: str | None = None) -> None:
        from kubernetes.client.rest import ApiException

        body = {"propagationPolicy": propagation} if propagation else None
        try:
            self.custom.delete_namespaced_custom_object(
                st.TRAINER_GROUP, st.TRAINER_VERSION, self.namespace, st.TRAINJOBS, name, body=body
            )
        except ApiException as err:
            if err.status != 404:
                raise

    def wait_condition(self, what: str, name: str, ctype: str, timeout: float = 90) -> dict[str, Any]:
        """Wait until condition ``ctype`` of ``what``/``name`` is True; fails early on the other terminal one."""
        terminal = {"Complete", "Completed", "Failed"} - {ctype}

        def check() -> dict[str, Any] | None:
            obj = self.get(what, name)
            status = (obj or {}).get("status") or {}
            true = {c["type"] for c in status.get("conditions") or [] if c["status"] == "True"}
            if true & terminal:
                raise AssertionError(f"{what} {name} ended {true & terminal}, not {ctype}: {json.dumps(status)}")
            return status if ctype in true else None

        return wait_for(check, timeout, f"{what} {name} {ctype}")

    def pods(self, trainjob_name: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{st.L_JOBSET_NAME}={trainjob_name}", _preload_content=False
        )
        return sorted(json.loads(resp.data)["items"], key=lambda p: p["metadata"]["name"])

    def log(self, pod_name: str) -> str:
        resp = self.core.read_namespaced_pod_log(pod_name, self.namespace, container="node", _preload_content=False)
        return str(resp.data.decode())

    def events(self, name: str, kind: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}", _preload_content=False
        )
        return [e for e in json.loads(resp.data)["items"] if e["involvedObject"]["kind"] == kind]

    def cleanup(self) -> None:
        for name in self.trainjobs:
            self.delete_trainjob(name)
        for name in self.runtimes:
            self.custom.delete_cluster_custom_object(st.TRAINER_GROUP, st.TRAINER_VERSION, st.CLUSTER_RUNTIMES, name)


@pytest.fixture(scope="module")
def trainer_controller(kube_cluster: Any) -> Iterator[None]:
    """The CRDs and runtime installed, and this controller running, for the module."""
    state = Path(kube_cluster.state_dir)
    if (state / "logs" / "sim-trainer.log").exists() or (state / "sim-trainer.pid").exists():
        yield  # the cluster started one (and installed the CRDs) already
        return
    # As the cluster would run it: the operator's identity, with only the rules sim_trainer.RBAC_RULES grants.
    operator = "sim-operator"
    st.install(kube_cluster.kubeconfig, rbac_user=operator)
    log_path = state / "sim-trainer.test.log"
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            st.command(kube_cluster.info.operator_kubeconfig, python=sys.executable, log_level="DEBUG"),
            cwd=REPO_ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_for(lambda: "caches synced" in log_path.read_text() or proc.poll() is not None, 60, "sim-trainer start")
        assert proc.poll() is None, log_path.read_text()[-3000:]
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Iterator[Any]:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kube_cluster.kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def cluster(api: Any, kube_cluster: Any, trainer_controller: None) -> Iterator[Cluster]:
    helper = Cluster(api, kube_cluster.namespace)
    yield helper
    helper.cleanup()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


HOLD = {"annotations": {"sim.torchelastic.dev/hold": "true"}}


@pytest.mark.cluster
def test_two_node_trainjob_runs_ddp_to_complete(cluster: Cluster) -> None:
    name = unique("ddp")
    cm = f"{name}-script"
    cluster.core.create_namespaced_config_map(
        cluster.namespace, {"metadata": {"name": cm}, "data": {"ddp.py": DDP_SCRIPT}}
    )
    try:
        patch = node_patch(
            volumes=[{"name": "script", "configMap": {"name": cm}}],
            containers=[{"name": "node", "volumeMounts": [{"name": "script", "mountPath": "/etc/ddp"}]}],
        )
        body = trainjob(name, patches=[patch], numNodes=2, numProcPerNode=1, command=["torchrun", "/etc/ddp/ddp.py"])
        start = time.monotonic()
        cluster.create_trainjob(body)
        status = cluster.wait_condition("trainjob", name, "Complete", timeout=150)
        elapsed = time.monotonic() - start
        assert condition(status, "Complete")["reason"] == "AllJobsCompleted"
        assert has(status["jobsStatus"][0], {"name": "node", "succeeded": 1, "failed": 0})
        assert st.is_true(cluster.get("jobset", name)["status"], "Completed")  # type: ignore[index]
        job = cluster.get("job", f"{name}-node-0")
        assert job is not None and st.is_true(job["status"], "Complete") and job["status"]["succeeded"] == 2
        pods = cluster.pods(name)
        assert [p["metadata"]["name"][: -len("xxxxx")] for p in pods] == [f"{name}-node-0-0-", f"{name}-node-0-1-"]
        for index, pod in enumerate(pods):
            assert pod["status"]["phase"] == "Succeeded"
            assert pod["metadata"]["annotations"][st.L_COMPLETION_INDEX] == str(index)
            assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (f"{name}-node-0-{index}", name)
            env = env_map(node_container(pod))
            assert env["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}" and env["PET_NNODES"] == "2"
            assert env["PET_NPROC_PER_NODE"] == "1" and env["PET_MASTER_PORT"] == "29500"
            lines = [line for line in cluster.log(pod["metadata"]["name"]).splitlines() if line.startswith("rank=")]
            assert lines[-1] == f"rank={index} world=2 allreduce=3.0 host={name}-node-0-{index}"
        svc = cluster.get("service", name)
        assert svc is not None and svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {st.L_JOBSET_NAME: name}
        print(f"2-node TrainJob to Complete in {elapsed:.1f}s")
    finally:
        cluster.core.delete_namespaced_config_map(cm, cluster.namespace)


@pytest.mark.cluster
def test_a_failing_node_fails_job_jobset_and_trainjob(cluster: Cluster) -> None:
    """With a runtime of restartPolicy Never and backoffLimit 0 (what the provider may ship), rank 1's exit fails
    everything at once, and its pod stays Failed with its exit code."""
    runtime = copy.deepcopy(RUNTIME)
    runtime["metadata"] = {"name": unique("torch-never"), "labels": RUNTIME["metadata"]["labels"]}
    job_spec = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    job_spec["backoffLimit"] = 0
    job_spec["template"]["spec"]["restartPolicy"] = "Never"
    cluster.create_runtime(runtime)
    name = unique("fail")
    script = "import os, sys, time\nif os.environ['PET_NODE_RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    body = trainjob(name, numNodes=2, command=["python", "-c", script])
    body["spec"]["runtimeRef"]["name"] = runtime["metadata"]["name"]
    cluster.create_trainjob(body)
    status = cluster.wait_condition("trainjob", name, "Failed", timeout=90)
    cond = condition(status, "Failed")
    assert cond["reason"] == "FailedJobs"
    assert cond["message"] == f"jobset failed due to one or more job failures (first failed job: {name}-node-0)"
    js = cluster.get("jobset", name)
    assert js is not None and condition(js["status"], "Failed")["message"] == cond["message"]
    job = cluster.get("job", f"{name}-node-0")
    assert job is not None and condition(job["status"], "Failed")["reason"] == "BackoffLimitExceeded"

    def settled() -> list[dict[str, Any]] | None:
        ps = cluster.pods(name)
        return ps if ps and all(p["metadata"].get("deletionTimestamp") is None for p in ps) else None

    pods = wait_for(settled, 30, "the active pod deleted")
    failed = [p for p in pods if p["status"].get("phase") == "Failed"]
    assert len(failed) == 1 and failed[0]["metadata"]["name"].startswith(f"{name}-node-0-1-")
    assert failed[0]["metadata"]["annotations"][st.L_COMPLETION_INDEX] == "1"
    assert failed[0]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


@pytest.mark.cluster
def test_suspend_and_resume(cluster: Cluster) -> None:
    name = unique("susp")
    body = trainjob(name, patches=[node_patch(pod_meta=HOLD)], numNodes=2)
    body["spec"]["suspend"] = True
    cluster.create_trainjob(body)
    status = cluster.wait_condition("trainjob", name, "Suspended")
    assert condition(status, "Suspended")["reason"] == "Suspended"
    wait_for(lambda: st.is_true((cluster.get("jobset", name) or {}).get("status") or {}, "Suspended"), 30, "js")
    job = wait_for(lambda: cluster.get("job", f"{name}-node-0"), 30, "the suspended Job")
    wait_for(
        lambda: st.is_true((cluster.get("job", job["metadata"]["name"]) or {}).get("status") or {}, "Suspended"),
        30,
        "job",
    )
    time.sleep(1.0)
    assert cluster.pods(name) == []
    # Admitted as Kueue admits: its runtime patch added and suspend false in one update; what it places reaches the
    # pods (the Trainer re-applies the JobSet, JobSet merges its template into the Jobs as it resumes them).
    toleration = {"key": "flavor", "operator": "Exists", "effect": "NoSchedule"}
    kueue = node_patch("kueue.x-k8s.io/manager", pod_meta={"labels": {"flavor": "big"}}, tolerations=[toleration])
    cluster.patch_trainjob(
        name, {"spec": {"suspend": False, "runtimePatches": [*body["spec"]["runtimePatches"], kueue]}}
    )

    def running() -> list[dict[str, Any]] | None:
        ps = [p for p in cluster.pods(name) if p["status"].get("phase") == "Running"]
        return ps if len(ps) == 2 else None

    for pod in wait_for(running, 60, "2 running pods after resume"):
        assert pod["metadata"]["labels"]["flavor"] == "big" and toleration in pod["spec"]["tolerations"]
    status = cluster.get("trainjob", name)["status"]  # type: ignore[index]
    assert has(condition(status, "Suspended"), {"status": "False", "reason": "Resumed"})
    wait_for(lambda: not st.is_true((cluster.get("jobset", name) or {}).get("status") or {}, "Suspended"), 30, "js")
    # Suspended again (as Kueue preempts): the pods go.
    cluster.patch_trainjob(name, {"spec": {"suspend": True}})
    wait_for(lambda: cluster.pods(name) == [], 60, "pods deleted on suspend")
    assert st.is_true(cluster.get("trainjob", name)["status"], "Suspended")  # type: ignore[index]


@pytest.mark.cluster
@pytest.mark.parametrize("propagation", [None, "Foreground"])
def test_deleting_a_trainjob_cascades(cluster: Cluster, propagation: str | None) -> None:
    name = unique("del")
    cluster.create_trainjob(trainjob(name, patches=[node_patch(pod_meta=HOLD)], numNodes=2))
    wait_for(lambda: len([p for p in cluster.pods(name) if p["status"].get("phase") == "Running"]) == 2, 60, "pods")
    assert cluster.get("service", name) is not None
    cluster.delete_trainjob(name, propagation)

    def gone() -> bool:
        return (
            cluster.get("trainjob", name) is None
            and cluster.get("jobset", name) is None
            and cluster.get("job", f"{name}-node-0") is None
            and cluster.get("service", name) is None
            and cluster.pods(name) == []
        )

    wait_for(gone, 60, "TrainJob, JobSet, Job, Service and pods gone")


@pytest.mark.cluster
def test_active_deadline_fails_the_trainjob_and_deletes_the_jobset(cluster: Cluster) -> None:
    name = unique("ads")
    body = trainjob(name, patches=[node_patch(pod_meta=HOLD)], numNodes=1)
    body["spec"]["activeDeadlineSeconds"] = 3
    cluster.create_trainjob(body)
    status = cluster.wait_condition("trainjob", name, "Failed", timeout=30)
    assert condition(status, "Failed")["reason"] == "DeadlineExceeded"
    wait_for(lambda: cluster.get("jobset", name) is None and cluster.pods(name) == [], 30, "JobSet and pods gone")


@pytest.mark.cluster
def test_runtime_problems_are_refused_at_create(cluster: Cluster) -> None:
    """The webhook reads the runtime (v2.3.0 ``trainjob_webhook.go`` ``ValidateCreate``): a runtimeRef kind outside
    the registry and a runtime that does not exist are both 403s at create, in upstream's words; nothing is made.
    (The controller's own ``TrainingRuntimeNotSupported`` condition and ``TrainJobResourcesCreationFailed`` event,
    for TrainJobs the webhook never saw, are in its reconcile and not reachable through this API server.)"""
    from kubernetes.client.rest import ApiException

    for ref, message in (
        ({"name": "x", "apiGroup": "example.com", "kind": "Runtime"}, "unsupported runtime: Runtime.example.com"),
        (
            {"name": "no-such-runtime"},
            'spec.RuntimeRef: Invalid value: {"name":"no-such-runtime","apiGroup":"trainer.kubeflow.org",'
            '"kind":"ClusterTrainingRuntime"}: clustertrainingruntimes.trainer.kubeflow.org "no-such-runtime" not '
            "found: specified clusterTrainingRuntime must be created before the TrainJob is created",
        ),
    ):
        name = unique("rt")
        body = trainjob(name)
        body["spec"]["runtimeRef"] = ref
        with pytest.raises(ApiException) as refused:
            cluster.create_trainjob(body)
        status = json.loads(refused.value.body)
        assert (refused.value.status, status["reason"]) == (403, "Forbidden")
        assert status["message"] == (
            f'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: {message}'
        )
        assert cluster.get("trainjob", name) is None
    # A runtime made a moment ago is read at once (no cache to wait for).
    runtime = copy.deepcopy(RUNTIME)
    runtime["metadata"] = {"name": unique("rt-new")}
    cluster.create_runtime(runtime)
    body = trainjob(unique("rt"), patches=[node_patch(pod_meta=HOLD)])
    body["spec"]["runtimeRef"] = {"name": runtime["metadata"]["name"]}
    cluster.create_trainjob(body)


@pytest.mark.cluster
def test_under_torch_distributed_a_failing_node_restarts_in_place_until_the_backoff_limit(cluster: Cluster) -> None:
    """The default runtime: OnFailure pods (the JobSet webhook's default) and the Job's default backoffLimit 6. The
    failing node's container restarts in place (the kubelet's crash-loop backoff, scaled by 0.1 here) until its
    restartCount reaches 6; then the Job fails and its pods are deleted."""
    name = unique("crash")
    script = "import os, sys, time\nif os.environ['PET_NODE_RANK'] == '1': sys.exit(5)\ntime.sleep(300)"
    cluster.create_trainjob(trainjob(name, numNodes=2, command=["python", "-c", script]))
    seen_restarts = 0

    def failed() -> dict[str, Any] | None:
        nonlocal seen_restarts
        for pod in cluster.pods(name):
            if pod["metadata"]["name"].startswith(f"{name}-node-0-1-"):
                for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                    seen_restarts = max(seen_restarts, int(cs.get("restartCount") or 0))
        status = (cluster.get("trainjob", name) or {}).get("status") or {}
        return status if st.is_true(status, "Failed") else None

    status = wait_for(failed, 120, "the TrainJob Failed after the restarts")
    assert condition(status, "Failed")["reason"] == "FailedJobs"
    job = cluster.get("job", f"{name}-node-0")
    assert job is not None and condition(job["status"], "Failed")["reason"] == "BackoffLimitExceeded"
    assert job["spec"]["backoffLimit"] == 6 and job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert seen_restarts >= 4  # it restarted in place (the last restarts may fall between two polls)
    wait_for(lambda: cluster.pods(name) == [], 30, "the Job's pods deleted")
