"""The provider inside a real Airflow: DAGs of tests/deployment_dags triggered and read through the REST API of a
deployment whose api-server, scheduler (LocalExecutor), dag-processor and triggerer are separate processes on
PostgreSQL (tests/airflow_services), against the local test cluster.

What ``dag.test()`` (tests/e2e) cannot show: the task defers in one process and resumes in another, the trigger runs
in the triggerer from its serialized (encrypted) form, a user's "mark failed" reaches the trigger's ``on_kill``, a
trigger survives its triggerer being killed, and the scheduler's next try of a task whose process was killed deletes
what that try left running.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.kubernetes.pod_template import payload_secret_name
from tests.airflow_services.services import AirflowServices

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
MANAGED = "app.kubernetes.io/managed-by=airflow-provider-torchelastic"
DAG_ID_LABEL = "torchelastic.airflow.apache.org/dag-id"
TRY_LABEL = "torchelastic.airflow.apache.org/try-number"


class Kube:
    """Reads and clean-up through the admin kubeconfig (the Kubernetes client, nothing of ours)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config

        api_client = config.new_client_from_config(str(kubeconfig))
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.namespace = namespace

    def workloads(self, dag_id: str) -> tuple[list[dict[str, Any]], list[Any]]:
        """The PyTorchJobs and pods a DAG created (a PyTorchJob's pods carry its template's labels)."""
        selector = f"{MANAGED},{DAG_ID_LABEL}={dag_id}"
        jobs = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, label_selector=selector
        )["items"]
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return list(jobs), list(pods)

    def delete_everything(self) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"propagationPolicy": "Background"}
        jobs = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"]
        for job in jobs:
            try:
                self.custom.delete_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, job["metadata"]["name"], body=body
                )
            except ApiException as e:
                if e.status != 404:
                    raise
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            try:
                self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, body=body)
            except ApiException as e:
                if e.status != 404:
                    raise
        for payload in self.core.list_namespaced_secret(self.namespace, label_selector=MANAGED).items:
            try:
                self.core.delete_namespaced_secret(payload.metadata.name, self.namespace)
            except ApiException as e:
                if e.status != 404:
                    raise


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def started(kube: Kube, dag_id: str, *, jobs: int, pods: int) -> tuple[list[Any], list[Any]] | None:
    """The DAG's PyTorchJobs and pods once there are that many and every pod runs."""
    found_jobs, found_pods = kube.workloads(dag_id)
    if len(found_jobs) != jobs or len(found_pods) != pods or any(p.status.phase != "Running" for p in found_pods):
        return None
    return found_jobs, found_pods


def triggerer_of(ti: dict[str, Any]) -> int | None:
    """The triggerer job running the task instance's trigger, if one has taken it."""
    return (ti.get("trigger") or {}).get("triggerer_id")


@pytest.fixture(scope="module")
def kube(airflow_services: AirflowServices) -> Kube:
    return Kube(airflow_services.info.kubeconfig, airflow_services.info.namespace)


@pytest.fixture
def services(airflow_services: AirflowServices, kube: Kube) -> Iterator[AirflowServices]:
    """The session's deployment; whatever a test leaves on the cluster (kept jobs, a failed run's) is deleted."""
    yield airflow_services
    kube.delete_everything()


def test_deferred_elastic_job_succeeds_with_rank0_result_in_xcom(services: AirflowServices, kube: Kube) -> None:
    dag_id = "deploy_elastic"
    run_id = services.trigger_dag(dag_id)
    seen: list[str] = []

    def ended(ti: dict[str, Any]) -> bool:
        if not seen or seen[-1] != ti["state"]:
            seen.append(ti["state"])
        return ti["state"] in ("success", "failed")

    ti = services.wait_for_task(dag_id, run_id, "train", ended, timeout=180, what="the task to end")
    assert services.wait_for_run(dag_id, run_id, timeout=30) == "success", (seen, services.describe())
    assert ti["state"] == "success" and ti["try_number"] == 1, ti
    assert "deferred" in seen, f"the task never deferred: {seen}"
    assert services.xcom(dag_id, run_id, "train") == {"rank": 0, "world_size": 2, "sum": 3.0}  # ranks 0, 1 plus 1
    assert services.xcom(dag_id, run_id, "train", "job_kind") == "PyTorchJob"
    # on_finish_action="delete_succeeded": the trigger deleted the job (and so its pods) once it had succeeded.
    wait_for(lambda: kube.workloads(dag_id) == ([], []), 30, "the succeeded PyTorchJob to be deleted")


def test_marking_a_deferred_task_failed_deletes_its_job(services: AirflowServices, kube: Kube) -> None:
    dag_id = "deploy_mark_failed"
    run_id = services.trigger_dag(dag_id)
    jobs, _ = wait_for(lambda: started(kube, dag_id, jobs=1, pods=2), 90, "the PyTorchJob's 2 pods to run")
    name = jobs[0]["metadata"]["name"]
    # Only a trigger that a triggerer runs can be told: a task marked failed before any triggerer took its trigger
    # has its trigger row deleted unseen, and nothing stops the job (Airflow 3.3). A person is not that quick.
    wait_for(
        lambda: "pods running 2/2" in services.trigger_log(dag_id, run_id, "train"), 60, "the trigger to see the job"
    )

    changed = services.set_task_state(dag_id, run_id, "train", "failed")
    assert [(ti["task_id"], ti["state"]) for ti in changed] == [("train", "failed")], changed

    # Nothing but the trigger's on_kill can delete it: no worker runs while the task is deferred. The triggerer notices
    # the cancellation at its next loop, then the pods get their grace period (30 s): 60 s was too short under load.
    wait_for(lambda: kube.workloads(dag_id) == ([], []), 120, f"PyTorchJob {name} and its pods to be deleted")
    assert services.wait_for_run(dag_id, run_id, timeout=30) == "failed"
    assert services.task_instance(dag_id, run_id, "train")["state"] == "failed"
    trigger_log = services.trigger_log(dag_id, run_id, "train")
    assert "Trigger cancelled by user action, invoking on_kill" in trigger_log, trigger_log[-3000:]
    assert f"Deleted PyTorchJob {kube.namespace}/{name} (the task was killed" in trigger_log, trigger_log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_a_restarted_triggerer_is_replaced_and_the_task_finishes_with_one_job(
    services: AirflowServices, kube: Kube, sig: signal.Signals
) -> None:
    """SIGKILL: a crash, nothing of the trigger runs. SIGTERM: a rolling restart, the triggerer cancels its triggers
    and runs their ``cleanup()``, which must leave the job running (only a user's action calls ``on_kill``)."""
    dag_id = "deploy_triggerer_restart"
    run_id = services.trigger_dag(dag_id)
    deferred = services.wait_for_task(
        dag_id, run_id, "train", lambda ti: ti["state"] == "deferred" and triggerer_of(ti) is not None, timeout=90,
        what="a triggerer to run the task's trigger",
    )  # fmt: skip
    first_triggerer = triggerer_of(deferred)
    _, pods = wait_for(lambda: started(kube, dag_id, jobs=0, pods=1), 90, "the pod to run")
    pod = pods[0]

    services.restart("triggerer", sig)

    # The new triggerer takes the trigger over once the old one's heartbeat is older than
    # [triggerer] triggerer_health_check_threshold, rebuilds it from the database and finds the same job.
    def taken_over_or_ended(ti: dict[str, Any]) -> bool:
        return ti["state"] != "deferred" or triggerer_of(ti) not in (None, first_triggerer)

    taken_over = services.wait_for_task(
        dag_id, run_id, "train", taken_over_or_ended, timeout=60, what="another triggerer to take the trigger over"
    )
    assert taken_over["state"] == "deferred", f"the job ended before the new triggerer took over: {taken_over}"
    assert services.wait_for_run(dag_id, run_id, timeout=90) == "success", services.describe()
    ti = services.task_instance(dag_id, run_id, "train")
    assert ti["state"] == "success" and ti["try_number"] == 1, ti
    assert services.xcom(dag_id, run_id, "train") == {"value": "survived a triggerer restart", "rank": 0}
    # Exactly one job for the try, the one created before the restart (on_finish_action="keep").
    jobs, pods = kube.workloads(dag_id)
    assert jobs == []
    assert [(p.metadata.uid, p.metadata.labels[TRY_LABEL]) for p in pods] == [(pod.metadata.uid, "1")]
    assert pods[0].status.phase == "Succeeded"
    assert "invoking on_kill" not in services.trigger_log(dag_id, run_id, "train")


def test_the_next_try_deletes_the_pod_its_killed_predecessor_left_running(
    services: AirflowServices, kube: Kube
) -> None:
    """The scheduler's next try, not a hand-edited task instance row (tests/e2e/test_kubernetes.py plays that with
    ``dag.test()``): try 1's task process is SIGKILLed while it waits, so nothing of try 1 deletes its pod; try 2
    finds try 1's record in the task state store and deletes that pod before it creates its own."""
    dag_id = "deploy_next_try_cleanup"
    run_id = services.trigger_dag(dag_id)
    _, pods = wait_for(lambda: started(kube, dag_id, jobs=0, pods=1), 90, "try 1's pod to run")
    first = pods[0]
    assert first.metadata.labels[TRY_LABEL] == "1", first.metadata.labels
    ti = services.task_instance(dag_id, run_id, "train")
    assert (ti["state"], ti["try_number"]) == ("running", 1), ti

    services.kill_task(ti)

    def second_try_created() -> dict[str, Any] | None:
        _, found = kube.workloads(dag_id)
        by_try = {p.metadata.labels[TRY_LABEL]: p for p in found}
        return by_try if "2" in by_try else None

    # Polled until try 2's pod exists: by then try 1's pod must be deleted already (gone, or terminating through its
    # grace period), which is the order of the two calls, not only their outcome.
    seen = wait_for(second_try_created, 120, "try 2's pod", interval=0.2)
    left = seen.get("1")
    assert left is None or left.metadata.deletion_timestamp is not None, (
        f"try 1's pod still runs beside try 2's: {left}"
    )
    assert services.wait_for_run(dag_id, run_id, timeout=120) == "success", services.describe()
    ti = services.task_instance(dag_id, run_id, "train")
    assert (ti["state"], ti["try_number"]) == ("success", 2), ti
    assert services.xcom(dag_id, run_id, "train") == {"value": "try 2", "rank": 0}
    # What is left on the cluster is try 2's pod alone (on_finish_action="keep"): try 1's was deleted, not finished.
    # Its object goes once the kubelet has stopped it (10 s grace) and cleaned up after it (its Secret volume): up
    # to a minute on this 2-core node under the rest of the suite (a cold CI run once took over 30 s).
    wait_for(lambda: len(kube.workloads(dag_id)[1]) == 1, 90, "try 1's pod to be gone")
    jobs, pods = kube.workloads(dag_id)
    assert jobs == []
    assert [(p.metadata.labels[TRY_LABEL], p.status.phase) for p in pods] == [("2", "Succeeded")]
    assert pods[0].metadata.uid == seen["2"].metadata.uid
    payloads = {s.metadata.name for s in kube.core.list_namespaced_secret(kube.namespace, label_selector=MANAGED).items}
    assert payload_secret_name(first.metadata.name) not in payloads, "try 1's payload Secret is left"
    said = f"Pod {kube.namespace}/{first.metadata.name} of try 1 is still running, but its try is over: deleting it"
    log = services.task_log(dag_id, run_id, "train", try_number=2)
    assert said in log, log[-3000:]
