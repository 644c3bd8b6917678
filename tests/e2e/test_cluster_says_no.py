"""When the cluster says no, through Airflow on the local cluster: more memory after an OOM (``retry_resources``) and
the Kueue limits (``max_preemptions``; an admitted Workload whose job stays suspended).

The simulated kubelet OOM-kills the workers of try 1 (a fault annotation); the tests play Kueue: they suspend a
running job (a preemption) and resume it, or create the job's Workload admitted while the job stays suspended (the
Kueue/training-operator version skew of kueue#11931). The Workload CRD is a stand-in with Kueue's group, version and
names, whose schema keeps whatever it is given.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.kubernetes.workloads import (
    JOB_UID_LABEL,
    WORKLOAD_GROUP,
    WORKLOAD_PLURAL,
    WORKLOAD_VERSION,
)
from tests.e2e.test_cluster_realities import condition, in_background, joined, set_suspend
from tests.e2e.test_kubernetes import Cluster, run_dag, wait_for
from tests.e2e.test_pytorchjob_failures import CONFIGURATION, PREEMPTED, errors

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "kubernetes_default_connection")]

DAGS = "k8s_cluster_says_no"


@pytest.fixture
def cluster(kube_cluster) -> Iterator[Cluster]:
    cluster = Cluster(kube_cluster.kubeconfig, kube_cluster.namespace)
    yield cluster
    cluster.delete_everything()


@pytest.fixture(autouse=True)
def failure_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    out = tmp_path / "failures"
    out.mkdir()
    monkeypatch.setenv("TORCHELASTIC_E2E_OUT", str(out))
    return out


def memory_of(manifests: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The training container's memory requests and limits by replica, in the manifests a try submitted."""
    workload = manifests[-1]
    found = {}
    for replica, spec in workload["spec"]["pytorchReplicaSpecs"].items():
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        found[replica] = {part: values["memory"] for part, values in container["resources"].items()}
    return found


def test_a_job_oom_killed_at_its_first_limit_succeeds_with_twice_the_memory(
    cluster: Cluster, failure_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    result = run_dag("k8s_retry_memory")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    tries = errors(failure_dir, "k8s_retry_memory")
    assert list(tries) == [1] and "OutOfMemoryError" in tries[1], tries
    # XComs are try 2's: the manifests it submitted carry twice try 1's memory on every replica.
    assert memory_of(result.xcom(key="manifests")) == {"Worker": {"requests": "512Mi", "limits": "512Mi"}}
    summary = result.xcom(key="torch_elastic_job")
    note = summary["retry_resources"]["note"]
    assert note.startswith("retry_resources: try 1 ran out of memory; try 2: Worker memory requests 256Mi -> 512Mi")
    log = "".join(capfd.readouterr())
    assert "limits 256Mi -> 512Mi" in log, "the escalation is logged"


def test_a_job_preempted_max_preemptions_times_fails_as_preempted(cluster: Cluster, failure_dir: Path) -> None:
    def preempt_twice() -> None:
        jobs = wait_for(lambda: cluster.workloads("k8s_max_preemptions")[0], 60, "the PyTorchJob")
        name = jobs[0]["metadata"]["name"]
        selector = f"training.kubeflow.org/job-name={name}"
        for preemption in (1, 2):
            wait_for(lambda: sum(p.status.phase == "Running" for p in cluster.pods(selector)) == 2, 90, "running pods")
            time.sleep(2)
            set_suspend(cluster, name, True)  # preempted: the training operator deletes the pods
            if preemption == 2:
                # The task may see spec.suspend and delete the job before the controller's Suspended condition.
                wait_for(
                    lambda: (job := cluster.get_job(name)) is None or condition(job, "Suspended"),
                    30,
                    "the job to be suspended or deleted",
                )
            else:
                wait_for(lambda: condition(cluster.get_job(name), "Suspended"), 30, "the job to be suspended")
                wait_for(lambda: not cluster.pods(selector), 60, "the pods to be deleted")
                time.sleep(2)
                set_suspend(cluster, name, False)  # admitted again

    player = in_background(preempt_twice)
    started = time.monotonic()
    result = run_dag("k8s_max_preemptions")
    joined(player)
    assert result.state == "failed", result
    assert time.monotonic() - started < 100, "failed at the second preemption, not after the training's 120 s"
    error = errors(failure_dir, "k8s_max_preemptions")[1]
    assert error.startswith(PREEMPTED), error
    assert "preemption 2 of this task instance reaches max_preemptions=2" in error, error
    assert cluster.workloads("k8s_max_preemptions")[0] == [], "the suspended job was deleted"


def _install_workload_crd(cluster: Cluster) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api = client.ApiextensionsV1Api(cluster.custom.api_client)
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{WORKLOAD_PLURAL}.{WORKLOAD_GROUP}"},
        "spec": {
            "group": WORKLOAD_GROUP,
            "scope": "Namespaced",
            "names": {"plural": WORKLOAD_PLURAL, "singular": "workload", "kind": "Workload"},
            "versions": [
                {
                    "name": WORKLOAD_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }
    try:
        api.create_custom_resource_definition(crd)
    except ApiException as e:
        if e.status != 409:
            raise
    wait_for(lambda: _served(cluster), 30, "the Workload CRD to be served")


def _served(cluster: Cluster) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        cluster.custom.list_namespaced_custom_object(WORKLOAD_GROUP, WORKLOAD_VERSION, cluster.namespace, "workloads")
    except ApiException:
        return False
    return True


def test_an_admitted_workload_whose_job_stays_suspended_fails_naming_the_workload(
    cluster: Cluster, failure_dir: Path
) -> None:
    _install_workload_crd(cluster)
    workload_name = "pytorchjob-skewed-1a2b3"

    def admit_without_resuming() -> None:
        jobs = wait_for(lambda: cluster.workloads("k8s_admitted_but_suspended")[0], 60, "the PyTorchJob")
        job = jobs[0]
        body = {
            "apiVersion": f"{WORKLOAD_GROUP}/{WORKLOAD_VERSION}",
            "kind": "Workload",
            "metadata": {
                "name": workload_name,
                "labels": {JOB_UID_LABEL: job["metadata"]["uid"]},
                "ownerReferences": [
                    {
                        "apiVersion": job["apiVersion"],
                        "kind": job["kind"],
                        "name": job["metadata"]["name"],
                        "uid": job["metadata"]["uid"],
                    }
                ],
            },
            "spec": {"queueName": "gpu-queue"},
        }
        args = (WORKLOAD_GROUP, WORKLOAD_VERSION, cluster.namespace, WORKLOAD_PLURAL)
        cluster.custom.create_namespaced_custom_object(*args, body)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        admitted = {
            "type": "Admitted",
            "status": "True",
            "reason": "Admitted",
            "message": "",
            "lastTransitionTime": now,
        }
        status = {"status": {"conditions": [admitted], "admission": {"clusterQueue": "cluster-queue"}}}
        cluster.custom.patch_namespaced_custom_object_status(*args, workload_name, status)

    player = in_background(admit_without_resuming)
    started = time.monotonic()
    result = run_dag("k8s_admitted_but_suspended")
    joined(player)
    assert result.state == "failed", result
    assert time.monotonic() - started < 90, "failed after pending_grace_seconds, not at scheduling_timeout=120"
    error = errors(failure_dir, "k8s_admitted_but_suspended")[1]
    assert error.startswith(CONFIGURATION), error
    assert f"Kueue Workload {cluster.namespace}/{workload_name} was admitted to ClusterQueue cluster-queue" in error
    assert "version skew" in error and "kueue#11931" in error, error
    assert cluster.workloads("k8s_admitted_but_suspended")[0] == [], "the job that would never start was deleted"
