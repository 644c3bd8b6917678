"""PyTorchJob failures through Airflow, on the local test cluster: what the task's error says, and whether it retried.

The DAGs (``tests/dags/k8s_failures.py``) run through ``dag.test()`` as multi-pod PyTorchJobs. The faults are real
where the cluster allows (a worker's exception, a missing Secret, the training operator's deadline and backoff
limit) and injected by the simulated kubelet otherwise (OOM kill, eviction), aimed at one worker with
``sim.torchelastic.dev/fail-indexes``. Each test checks the error the task failed with: the pod and rank it names,
that it blames no peer, whether it is recoverable, and how many tries were used.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from airflow_provider_torchelastic.errors import EXIT_RECOVERABLE
from tests.e2e import test_kubernetes as k8s
from tests.e2e.test_kubernetes import Cluster, DagRunResult, run_dag, training_container_status, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]

# The Kubernetes end-to-end tests' fixtures: the session's cluster, an emptied namespace after each test, the
# ``kubernetes_default`` connection, and where ``record_failure`` writes (the last two autouse).
cluster = k8s.cluster
clean_namespace = k8s.clean_namespace
connection = k8s.connection
failure_dir = k8s.failure_dir

USER_FAILED = "airflow_provider_torchelastic.operators.UserCodeFailedError: "
OUT_OF_MEMORY = "airflow_provider_torchelastic.operators.OutOfMemoryError: "
PREEMPTED = "airflow_provider_torchelastic.operators.PreemptedError: "
CONFIGURATION = "airflow_provider_torchelastic.operators.ConfigurationError: "
DEADLINE = "airflow_provider_torchelastic.operators.DeadlineExceededError: "


def errors(failure_dir: Path, dag_id: str) -> dict[int, str]:
    """The exception of every failed try (``record_failure`` writes one file per try), by try number."""
    found = {}
    for path in failure_dir.iterdir():
        prefix = f"{dag_id}.train.try"
        assert path.name.startswith(prefix), path.name
        found[int(path.name[len(prefix) : -len(".txt")])] = path.read_text()
    return found


def job_of(result: DagRunResult, try_number: int = 1) -> str:
    from airflow_provider_torchelastic.core.naming import job_name

    return job_name(result.identity(try_number))


def timed_run(dag_id: str) -> tuple[DagRunResult, float]:
    started = time.monotonic()
    result = run_dag(dag_id)
    elapsed = time.monotonic() - started
    print(f"{dag_id}: {elapsed:.1f} s")
    return result, elapsed


def test_worker_exception_names_that_worker_and_rank_not_its_peers(cluster: Cluster, failure_dir: Path) -> None:
    from airflow_provider_torchelastic.core.outcome import decode_outcome

    result, _ = timed_run("k8s_fail_worker_exception")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "retries=2 must not be used for a ValueError"
    tries = errors(failure_dir, "k8s_fail_worker_exception")
    assert list(tries) == [1], tries
    error, name = tries[1], job_of(result)
    assert error.startswith(USER_FAILED), error
    # Master is node 0 (rank 0), worker-0 node 1: the ValueError was raised by rank 1 on worker-0.
    assert f"{name}-worker-0" in error and "rank 1" in error, error
    assert "ValueError: shard 1 has a corrupt header" in error, error
    assert f"{name}-master-0" not in error and "rank 0" not in error, "the peer that failed later is blamed"
    # The peer really did fail or was stopped (it never reaches the barrier's end); if it reported a failure, that
    # failure came after the root cause.
    master = wait_for(
        lambda: (
            (pod := cluster.get_pod(f"{name}-master-0")) is not None
            and pod.status.phase in ("Succeeded", "Failed")
            and pod
        ),
        60,
        "the master's pod to end",
    )
    assert master.status.phase == "Failed", master.status
    outcome = decode_outcome(training_container_status(master).state.terminated.message)
    if outcome is not None and outcome.failure is not None:
        assert outcome.failure.rank == 0 and "ValueError" not in outcome.failure.exception, outcome


def test_oom_killed_worker_is_named_and_retried(cluster: Cluster, failure_dir: Path) -> None:
    result, _ = timed_run("k8s_fail_oom_worker")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}, "an OOM kill is worth a retry"
    assert result.xcom()["rank"] == 0
    tries = errors(failure_dir, "k8s_fail_oom_worker")
    assert list(tries) == [1], tries
    error, first = tries[1], job_of(result, 1)
    assert error.startswith(OUT_OF_MEMORY), error
    assert f"{first}-worker-1" in error and "OOMKilled" in error, error
    assert f"{first}-worker-0" not in error, error
    # The kill took the training worker, as cgroup v1's kernel does: the runner reported its rank's SIGKILL.
    assert "SIGKILL" in error and "its container ended OOMKilled (out of memory" in error, error
    # Try 1's job was kept (it failed); its worker-1 is the one the kubelet killed, and only that one.
    killed = cluster.get_pod(f"{first}-worker-1")
    assert killed is not None and killed.status.phase == "Failed", killed
    terminated = training_container_status(killed).state.terminated
    assert (terminated.exit_code, terminated.reason) == (EXIT_RECOVERABLE, "OOMKilled")  # the runner's own code
    spared = cluster.get_pod(f"{first}-worker-0")
    assert spared is not None and (spared.status.phase != "Failed"), spared.status


def test_evicted_worker_is_named_and_retried(cluster: Cluster, failure_dir: Path) -> None:
    result, _ = timed_run("k8s_fail_evicted_worker")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}, "an eviction is worth a retry"
    tries = errors(failure_dir, "k8s_fail_evicted_worker")
    assert list(tries) == [1], tries
    error, first = tries[1], job_of(result, 1)
    assert error.startswith(PREEMPTED), error
    assert f"{first}-worker-1" in error and "Evicted" in error, error
    assert f"{first}-worker-0" not in error, error
    evicted = cluster.get_pod(f"{first}-worker-1")
    assert evicted is not None and (evicted.status.phase, evicted.status.reason) == ("Failed", "Evicted")


def test_missing_secret_fails_after_the_grace_without_retries(failure_dir: Path) -> None:
    result, elapsed = timed_run("k8s_fail_missing_secret")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "a missing Secret is not worth a retry"
    assert elapsed < 60, f"took {elapsed:.0f} s"
    tries = errors(failure_dir, "k8s_fail_missing_secret")
    assert list(tries) == [1], tries
    error, name = tries[1], job_of(result)
    assert error.startswith(CONFIGURATION), error
    assert f"{name}-worker-0" in error and "CreateContainerConfigError" in error, error
    assert 'secret "no-such-secret" not found' in error, error
    assert f"{name}-master-0" not in error, error


@pytest.mark.parametrize("dag_id", ["k8s_fail_deadline", "k8s_fail_deadline_sync"])
def test_active_deadline_of_a_quiet_job_is_enforced_by_the_wait(
    dag_id: str, cluster: Cluster, failure_dir: Path
) -> None:
    # The pods sleep 120 s and change nothing, so the simulated operator, like the real one, never reconciles the
    # job after its deadline (its timed re-check goes to a no-op queue): only the provider's wait can stop it.
    result, elapsed = timed_run(dag_id)
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "the deadline would stop a retry as well"
    assert elapsed < 60, f"took {elapsed:.0f} s; the function sleeps 120 s"
    tries = errors(failure_dir, dag_id)
    assert list(tries) == [1], tries
    error, name = tries[1], job_of(result)
    assert error.startswith(DEADLINE), error
    assert "active_deadline_seconds=5" in error and name in error and "stopped by the provider" in error, error
    # Not kept although it failed (on_finish_action="delete_succeeded"): a kept job would go on holding its pods.
    wait_for(lambda: cluster.get_job(name) is None, timeout=30, what=f"{name} deleted")
    wait_for(lambda: not cluster.pods(f"training.kubeflow.org/job-name={name}"), timeout=60, what=f"{name}'s pods gone")


def test_backoff_limit_fails_the_job_after_restarts(cluster: Cluster, failure_dir: Path) -> None:
    result, _ = timed_run("k8s_fail_backoff_limit")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "a function that always fails is not worth a retry"
    tries = errors(failure_dir, "k8s_fail_backoff_limit")
    assert list(tries) == [1], tries
    error, name = tries[1], job_of(result)
    assert error.startswith(USER_FAILED), error
    job = cluster.get_job(name)  # kept: it failed
    assert job is not None
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert "backoff limit" in failed["message"], failed
    restarts = [
        training_container_status(p).restart_count for p in cluster.pods(f"training.kubeflow.org/job-name={name}")
    ]
    assert sum(restarts) >= 1, restarts  # the pods were restarted in place before the job failed
    # The task says why the job ended, and what the restarted function raised.
    assert "backoff limit" in error and name in error, error
    assert "ValueError" in error and "cannot open its checkpoint" in error, error
