"""Cluster realities through Airflow on the local cluster: capacity, Kueue queueing and preemption, partial capacity.

The tests play what the cluster would do: the simulated kubelet leaves a pod Unschedulable (a fault annotation), and
the test plays Kueue by patching ``spec.runPolicy.suspend`` (no Kueue controller runs here): created suspended and
admitted later, or suspended while running (preempted: the training operator deletes the pods) and resumed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_kubernetes import GROUP, PLURAL, VERSION, Cluster, run_dag, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "kubernetes_default_connection")]


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


def set_suspend(cluster: Cluster, name: str, suspend: bool) -> None:
    body = {"spec": {"runPolicy": {"suspend": suspend}}}
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL, name, body)


def condition(job: dict[str, Any] | None, kind: str) -> bool:
    conditions = ((job or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def in_background(play: Any) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            play()
        except BaseException as e:  # surfaced by the test after the DAG run
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def joined(thread: threading.Thread) -> None:
    thread.join(timeout=30)
    for error in thread.errors:  # type: ignore[attr-defined]
        raise error


def test_unschedulable_waits_for_capacity_past_the_grace_until_scheduling_timeout(
    failure_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    result = run_dag("k8s_unschedulable")
    elapsed = time.monotonic() - started
    assert result.state == "failed", result
    # The wait counts from the pod's creationTimestamp, in whole seconds: it may reach 6 s up to 1 s early.
    assert elapsed >= 5, "pending_grace_seconds=1 must not fail a pod that waits for capacity"
    error = (failure_dir / "k8s_unschedulable.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.CapacityTimeoutError: "), error
    assert "longer than scheduling_timeout=6" in error and "is Unschedulable" in error, error
    assert "waiting for capacity: pod " in "".join(capfd.readouterr()), "the task log says what it waits for"


def test_a_pytorchjob_that_cannot_be_scheduled_fails_as_recoverable_after_scheduling_timeout(
    cluster: Cluster, failure_dir: Path
) -> None:
    result = run_dag("k8s_job_unschedulable")
    assert result.state == "failed", result
    error = (failure_dir / "k8s_job_unschedulable.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.CapacityTimeoutError: "), error
    name = result.xcom(key="job_name")
    assert f"pod {name}-worker-" in error and "is Unschedulable" in error, error
    assert "longer than scheduling_timeout=4" in error, error


def test_an_elastic_job_whose_rendezvous_host_cannot_be_scheduled_waits_then_times_out(
    cluster: Cluster, failure_dir: Path
) -> None:
    result = run_dag("k8s_rdzv_host_unschedulable")
    assert result.state == "failed", result
    error = (failure_dir / "k8s_rdzv_host_unschedulable.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.CapacityTimeoutError: "), error
    name = result.xcom(key="job_name")
    assert f"pod {name}-worker-0 is Unschedulable" in error and "hosts the rendezvous" in error, error
    assert "longer than scheduling_timeout=6" in error, error


def test_a_queued_job_waits_until_admitted_then_runs(cluster: Cluster, capfd: pytest.CaptureFixture[str]) -> None:
    def admit_later() -> None:
        jobs = wait_for(lambda: cluster.workloads("k8s_queued")[0], 60, "the PyTorchJob")
        name = jobs[0]["metadata"]["name"]
        wait_for(lambda: condition(cluster.get_job(name), "Suspended"), 30, "the job to be suspended")
        time.sleep(3)  # queued for a while: more than pending_grace_seconds=1
        assert cluster.pods(f"training.kubeflow.org/job-name={name}") == [], "a suspended job has no pods"
        set_suspend(cluster, name, False)  # Kueue admits it

    player = in_background(admit_later)
    result = run_dag("k8s_queued")
    joined(player)
    assert result.state == "success", result
    assert result.xcom()["world_size"] == 2
    log = "".join(capfd.readouterr())
    assert "queued in Kueue LocalQueue gpu-queue" in log
    assert "sets neither scheduling_timeout nor execution_timeout" in log, "the submit warns: it may wait forever"


def test_a_job_never_admitted_fails_as_recoverable_after_scheduling_timeout(failure_dir: Path) -> None:
    result = run_dag("k8s_never_admitted")
    assert result.state == "failed", result
    error = (failure_dir / "k8s_never_admitted.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.CapacityTimeoutError: "), error
    assert "is suspended (queued in Kueue LocalQueue gpu-queue)" in error, error
    assert "scheduling_timeout=4" in error, error


def test_a_preempted_and_resumed_job_ends_with_the_resumed_runs_result(cluster: Cluster) -> None:
    seen: dict[str, float] = {}

    def preempt_then_resume() -> None:
        jobs = wait_for(lambda: cluster.workloads("k8s_preempted")[0], 60, "the PyTorchJob")
        name = jobs[0]["metadata"]["name"]
        selector = f"training.kubeflow.org/job-name={name}"
        wait_for(lambda: sum(p.status.phase == "Running" for p in cluster.pods(selector)) == 2, 90, "running pods")
        time.sleep(1)
        set_suspend(cluster, name, True)  # preempted: the training operator deletes the pods
        wait_for(lambda: not cluster.pods(selector), 60, "the pods to be deleted")
        time.sleep(2)
        seen["resumed"] = time.time()
        set_suspend(cluster, name, False)

    player = in_background(preempt_then_resume)
    result = run_dag("k8s_preempted")
    joined(player)
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1)}, "preemption is not a failure: no retry"
    assert result.xcom()["started"] > seen["resumed"], "the result is the resumed run's"


def test_an_elastic_job_runs_on_fewer_nodes_than_it_asked_for(cluster: Cluster, capfd: pytest.CaptureFixture) -> None:
    result = run_dag("k8s_partial_capacity")
    assert result.state == "success", result
    assert result.xcom()["world_size"] == 1, "it ran on the one node it got"
    log = "".join(capfd.readouterr())
    assert "pods running 1/2, 1 waiting for capacity" in log, "progress says how many pods wait for capacity"
