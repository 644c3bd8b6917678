"""A job kind that another package plugs in, inside a real Airflow: the test-only ``FakeJob`` (tests/fake_kind.py),
whose entry point every process of the deployment sees (tests/airflow_services/deployment.py). The task renders and
submits one, defers, the triggerer waits for it through its shared watch, the UI plugin on the api-server lists it,
and once it succeeded it is deleted with its payload Secret: nothing of the provider's names the kind.

The cluster serves FakeJobs while this module runs (their CRD, installed here and removed afterwards, so the other
tests sharing the cluster see none). Nothing runs them, so the test plays their controller: it creates the job's pod
on a node no kubelet serves (the simulated one runs only its own node's pods), writes the pod's status (running, then
ended with rank 0's report in its termination message) and the job's ``status.state``, and, as the garbage collector
would (the cluster's only collects PyTorchJobs' dependents), deletes the pod once its job is gone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.naming import LABEL_DAG_ID, LABEL_MANAGED_BY, MANAGED_BY, TRAINING_CONTAINER
from airflow_provider_torchelastic.core.outcome import encode_success
from airflow_provider_torchelastic.kubernetes.pod_template import payload_secret_name
from airflow_provider_torchelastic.kubernetes.sweep import NOT_AFTER_LABEL
from tests import fake_kind
from tests.airflow_services.deployment import SIM_RUNNER_IMAGE as RUNNER_IMAGE
from tests.airflow_services.services import AirflowServices
from tests.deployment.test_airflow_deployment import wait_for

pytestmark = pytest.mark.cluster

DAG_ID = "deploy_plugged_kind"  # tests/deployment_dags/deployment_plugged_kind.py
TASK_ID = "train"
UI_API = "/torch-elastic/api/jobs"
GROUP, VERSION, PLURAL = fake_kind.GROUP, fake_kind.VERSION, fake_kind.PLURAL
SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_DAG_ID}={DAG_ID}"
#: A node that no kubelet serves: the pods the test creates there are left to the test.
NODE = "fakejob-controller-node"
#: What the test reports as rank 0's return value.
RESULT = {"rank": 0, "kind": "FakeJob", "value": 3}
MERGE_PATCH = "application/merge-patch+json"


def rfc3339_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FakeJobCluster:
    """The cluster through the admin kubeconfig (the Kubernetes client, nothing of ours): what the test reads, and
    what it does as the FakeJobs' controller and garbage collector."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config

        api_client = config.new_client_from_config(str(kubeconfig))
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.extensions = client.ApiextensionsV1Api(api_client)
        self.namespace = namespace

    # -- the CRD ------------------------------------------------------------------------------------------------

    def install_crd(self) -> None:
        self.extensions.create_custom_resource_definition(fake_kind.CRD, _preload_content=False)

    def serves_fakejobs(self) -> bool:
        """Whether FakeJobs can be listed in the namespace (the CRD is Established and its API is served)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise
            return False
        return True

    def remove_crd(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.extensions.delete_custom_resource_definition(fake_kind.CRD["metadata"]["name"])
        except ApiException as e:
            if e.status != 404:
                raise

    def crd_gone(self) -> bool:
        """Whether the CRD (and with it every FakeJob) is deleted and its group version no longer discovered."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.extensions.read_custom_resource_definition(fake_kind.CRD["metadata"]["name"], _preload_content=False)
            return False
        except ApiException as e:
            if e.status != 404:
                raise
        try:
            self.custom.get_api_resources(GROUP, VERSION, _preload_content=False)
            return False
        except ApiException as e:
            if e.status != 404:
                raise
        return True

    # -- reads --------------------------------------------------------------------------------------------------

    def jobs(self) -> list[dict[str, Any]]:
        found = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, label_selector=SELECTOR, _preload_content=False
        )
        return list(json.loads(found.data)["items"])

    def pods(self) -> list[dict[str, Any]]:
        found = self.core.list_namespaced_pod(self.namespace, label_selector=SELECTOR, _preload_content=False)
        return list(json.loads(found.data)["items"])

    def payloads(self) -> list[dict[str, Any]]:
        found = self.core.list_namespaced_secret(self.namespace, label_selector=SELECTOR, _preload_content=False)
        return list(json.loads(found.data)["items"])

    # -- the controller -----------------------------------------------------------------------------------------

    def set_job_state(self, name: str, state: str) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, name, {"status": {"state": state}}, _content_type=MERGE_PATCH
        )

    def create_pod(self, job: dict[str, Any]) -> str:
        """The job's one pod, as its controller would make it: the job's labels (not its deadline: that is the job
        object's alone), the kind's pod label, and a controller ownerReference to the job; returns its name."""
        meta = job["metadata"]
        labels = {k: v for k, v in meta["labels"].items() if k != NOT_AFTER_LABEL}
        name = f"{meta['name']}-0"
        owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": meta["name"], "uid": meta["uid"]}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {**labels, fake_kind.POD_LABEL: meta["name"]},
                "ownerReferences": [{**owner, "controller": True}],
            },
            "spec": {
                "nodeName": NODE,
                "restartPolicy": "Never",
                "containers": [{"name": TRAINING_CONTAINER, "image": RUNNER_IMAGE, "command": ["true"]}],
            },
        }
        self.core.create_namespaced_pod(self.namespace, pod, _preload_content=False)
        return name

    def set_pod_status(self, name: str, status: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod_status(
            name, self.namespace, {"status": status}, _content_type=MERGE_PATCH, _preload_content=False
        )

    def run_pod(self, name: str, started: str) -> None:
        container = {"name": TRAINING_CONTAINER, "image": RUNNER_IMAGE, "imageID": "", "restartCount": 0}
        running = {**container, "ready": True, "started": True, "state": {"running": {"startedAt": started}}}
        self.set_pod_status(name, {"phase": "Running", "startTime": started, "containerStatuses": [running]})

    def end_pod(self, name: str, started: str, report: str) -> None:
        """The pod ended, its runner's report (rank 0's value) in its termination message, as the runner leaves it."""
        container = {"name": TRAINING_CONTAINER, "image": RUNNER_IMAGE, "imageID": "", "restartCount": 0}
        terminated = {
            "exitCode": 0,
            "reason": "Completed",
            "message": report,
            "startedAt": started,
            "finishedAt": rfc3339_now(),
        }
        ended = {**container, "ready": False, "started": False, "state": {"terminated": terminated}}
        self.set_pod_status(name, {"phase": "Succeeded", "containerStatuses": [ended]})

    def delete_leftovers(self) -> None:
        for job in self.jobs():
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, job["metadata"]["name"])
        self.collect_garbage()
        for secret in self.payloads():
            self.core.delete_namespaced_secret(secret["metadata"]["name"], self.namespace)

    def collect_garbage(self) -> None:
        """What the garbage collector does once a FakeJob is deleted: delete the pods it owned."""
        from kubernetes.client.exceptions import ApiException

        live = {job["metadata"]["uid"] for job in self.jobs()}
        for pod in self.pods():
            owners = {ref.get("uid") for ref in pod["metadata"].get("ownerReferences") or []}
            if owners & live:
                continue
            try:
                self.core.delete_namespaced_pod(pod["metadata"]["name"], self.namespace, grace_period_seconds=0)
            except ApiException as e:
                if e.status != 404:
                    raise


@pytest.fixture(scope="module")
def cluster(airflow_services: AirflowServices) -> FakeJobCluster:
    return FakeJobCluster(airflow_services.info.kubeconfig, airflow_services.info.namespace)


@pytest.fixture(scope="module")
def fakejob_crd(cluster: FakeJobCluster) -> Iterator[None]:
    """FakeJobs served for the module; afterwards the CRD, its objects and its API are gone again."""
    cluster.install_crd()
    try:
        wait_for(cluster.serves_fakejobs, 30, "the FakeJob CRD to be served")
        yield
    finally:
        cluster.remove_crd()
        wait_for(cluster.crd_gone, 60, "the FakeJob CRD and its API to be gone")


@pytest.fixture
def services(
    airflow_services: AirflowServices, cluster: FakeJobCluster, fakejob_crd: None
) -> Iterator[AirflowServices]:
    """The session's deployment; whatever a failed run leaves of the DAG's (its FakeJob, pod, payload) is deleted."""
    yield airflow_services
    cluster.delete_leftovers()


def ui_rows(services: AirflowServices, name: str, source: str) -> list[dict[str, Any]]:
    """The plugin's rows of the job ``name`` that come from ``source`` (``kubernetes`` or ``summary``)."""
    answer = services.api.get(f"{services.base_url}{UI_API}", params={"dag_id": DAG_ID})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["kubernetes_error"] is None, body
    return [row for row in body["jobs"] if row["name"] == name and row["source"] == source]


def triggerer_of(ti: dict[str, Any]) -> int | None:
    return (ti.get("trigger") or {}).get("triggerer_id")


def test_a_plugged_in_kind_is_submitted_waited_for_listed_and_deleted(
    services: AirflowServices, cluster: FakeJobCluster
) -> None:
    namespace = cluster.namespace
    run_id = services.trigger_dag(DAG_ID)

    # Rendered by the kind's descriptor and submitted: the FakeJob, and the payload Secret it owns.
    jobs = wait_for(cluster.jobs, 120, "the task to create its FakeJob")
    assert len(jobs) == 1, jobs
    job = jobs[0]
    name = job["metadata"]["name"]
    assert (job["apiVersion"], job["kind"]) == (f"{GROUP}/{VERSION}", "FakeJob")
    owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FakeJob", "name": name, "uid": job["metadata"]["uid"]}
    payloads = wait_for(
        lambda: [p for p in cluster.payloads() if p["metadata"].get("ownerReferences") == [owner]],
        30,
        "the payload Secret to be owned by the FakeJob",
    )
    assert [p["metadata"]["name"] for p in payloads] == [payload_secret_name(name)]

    # Its controller starts it: one pod, running.
    started = rfc3339_now()
    pod = cluster.create_pod(job)
    cluster.run_pod(pod, started)
    cluster.set_job_state(name, "Running")

    # Waited for by the triggerer (the worker has let go), which sees the job's pod through its shared watch.
    services.wait_for_task(
        DAG_ID,
        run_id,
        TASK_ID,
        lambda ti: ti["state"] == "deferred" and triggerer_of(ti) is not None,
        timeout=90,
        what="a triggerer to run the task's trigger",
    )
    wait_for(
        lambda: f"FakeJob {name}: Running; pods running 1/1" in services.trigger_log(DAG_ID, run_id, TASK_ID),
        60,
        "the trigger to see the FakeJob's pod run",
    )

    # Listed by the UI plugin on the api-server, from Kubernetes, as the kind decides it; its pod found by label.
    (live,) = wait_for(
        lambda: [row for row in ui_rows(services, name, "kubernetes") if row["pods_running"] == 1],
        30,
        "the UI to list the FakeJob with its pod running",
    )
    assert (live["kind"], live["namespace"], live["phase"], live["pods_total"]) == ("FakeJob", namespace, "running", 1)
    assert (live["run_id"], live["task_id"], live["try_number"]) == (run_id, TASK_ID, 1), live
    detail = services.api.get(f"{services.base_url}{UI_API}/{namespace}/{name}")
    assert detail.status_code == 200, detail.text
    assert [p["name"] for p in detail.json()["pods"]] == [pod], detail.json()

    # It ends: rank 0's report in the pod's termination message, then the job's state.
    cluster.end_pod(pod, started, encode_success(json.dumps(RESULT)))
    cluster.set_job_state(name, "Done")
    assert services.wait_for_run(DAG_ID, run_id, timeout=90) == "success", services.describe()
    ti = services.task_instance(DAG_ID, run_id, TASK_ID)
    assert (ti["state"], ti["try_number"]) == ("success", 1), ti
    assert services.xcom(DAG_ID, run_id, TASK_ID) == RESULT
    assert services.xcom(DAG_ID, run_id, TASK_ID, "job_kind") == "FakeJob"

    # on_finish_action="delete_succeeded": the trigger deleted the job and its payload, and the garbage collector
    # (the test) the job's pod.
    wait_for(lambda: cluster.jobs() == [] and cluster.payloads() == [], 30, "the FakeJob and its payload to go")
    trigger_log = services.trigger_log(DAG_ID, run_id, TASK_ID)
    deleted = f"Deleted FakeJob {namespace}/{name} (it ended (on_finish_action=delete_succeeded); existed: True)"
    assert deleted in trigger_log, trigger_log[-3000:]
    cluster.collect_garbage()
    assert (cluster.jobs(), cluster.pods(), cluster.payloads()) == ([], [], [])

    # Listed from the summary the task saved: the job is gone from Kubernetes.
    (done,) = wait_for(lambda: ui_rows(services, name, "summary"), 30, "the UI to list the FakeJob's summary")
    assert (done["kind"], done["phase"], done["pods_total"], done["root_cause"]) == ("FakeJob", "succeeded", 1, None)
    assert ui_rows(services, name, "kubernetes") == []
