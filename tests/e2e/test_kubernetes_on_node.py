"""The provider's everyday Kubernetes path end to end on the real node (tests/e2e/real_node_support.py: kubelet,
kube-scheduler, kube-controller-manager and containerd; pods run the runner image built from docker/Dockerfile): a
single Pod, an elastic PyTorchJob of two pods with two workers each, Master/Worker, the quickstart example DAG, a
recoverable failure retried with a new job, a permanent one failing at once, a killed worker deleting its job, a
sensitive env value masked everywhere but in the pod, and a late kill that leaves a kept job.

The DAGs are tests/dags/k8s_e2e.py's, run through ``dag.test()`` with the helpers of tests/e2e/test_kubernetes.py,
whose own tests stay on the simulated kubelet: their faults are injected (annotations, the fault proxy, a replaced
inline trigger) and their clocks sped up, which a real node cannot do on demand.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import (
    EXAMPLE_DAGS,
    Cluster,
    rendered_fields,
    run_dag,
    start_dag_subprocess,
    stop_process,
    training_container_status,
    wait_for,
)
from tests.e2e.test_local_execution import use_example_dags

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them.
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, real_node_image = on_node.real_node_env, on_node.node_dag_env, on_node.real_node_image


def test_one_node_runs_as_a_single_pod_and_is_deleted(cluster: Cluster) -> None:
    from airflow_provider_torchelastic.core.naming import job_name
    from airflow_provider_torchelastic.kubernetes.render import payload_secret_name

    result = run_dag("k8s_single_pod")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1)}
    assert result.xcom() == {"rank": 0, "world_size": 2, "sum": 3.0}  # ranks 0, 1 plus 1 each
    assert result.xcom(key="job_kind") == "Pod"
    name = result.xcom(key="job_name")
    assert name == job_name(result.identity())
    assert [m["kind"] for m in result.xcom(key="manifests")] == ["Secret", "Pod"]
    # on_finish_action="delete_succeeded": the pod and the payload Secret are gone.
    wait_for(lambda: cluster.get_pod(name) is None, 30, f"pod {name} to be deleted")
    assert cluster.get_payload(payload_secret_name(name)) is None
    assert cluster.workloads("k8s_single_pod") == ([], [])


def test_elastic_two_nodes_returns_rank_0_result_from_whichever_pod_held_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_torchelastic.core.outcome import decode_outcome

    monkeypatch.setenv(
        "AIRFLOW__TORCH_ELASTIC__DASHBOARD_URL_TEMPLATE", "https://dash.example/{namespace}/{kind}/{name}"
    )
    result = run_dag("k8s_elastic_job")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1)}
    assert result.xcom() == {"rank": 0, "world_size": 4, "sum": 10.0}  # ranks 0..3 plus 1 each
    assert result.xcom(key="job_kind") == "PyTorchJob"
    name = result.xcom(key="job_name")
    job = cluster.get_job(name)  # on_finish_action="keep"
    assert job is not None
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in job["status"]["conditions"])
    pods = cluster.pods(f"training.kubeflow.org/job-name={name}")
    assert sorted(p.metadata.name for p in pods) == [f"{name}-worker-0", f"{name}-worker-1"]
    outcomes = {}
    for pod in pods:
        terminated = training_container_status(pod).state.terminated
        assert terminated is not None and terminated.exit_code == 0, pod.status
        outcomes[pod.metadata.name] = decode_outcome(terminated.message)
    holders = [pod for pod, outcome in outcomes.items() if outcome.holds_rank0]
    assert len(holders) == 1, outcomes
    assert outcomes[holders[0]].result == result.xcom()
    # The UI: the extra link was built from XComs pushed before deferring (this task deferred), and the
    # rendered-template view shows the job that was submitted, not the parse-time placeholder.
    assert result.xcom(key="_link_TorchElasticJobLink") == f"https://dash.example/{cluster.namespace}/PyTorchJob/{name}"
    rendered = rendered_fields("k8s_elastic_job", result.run_id)
    assert f"name: {name}" in rendered["rendered_job"] and "full manifest: XCom 'manifests'" in rendered["rendered_job"]


def test_master_and_worker_use_the_injected_static_rendezvous(cluster: Cluster) -> None:
    result = run_dag("k8s_master_worker")
    assert result.state == "success", result
    assert result.xcom() == {"rank": 0, "world_size": 2, "sum": 3.0}
    name = result.xcom(key="job_name")
    assert result.xcom(key="job_kind") == "PyTorchJob"
    manifest = result.xcom(key="manifests")[1]
    assert sorted(manifest["spec"]["pytorchReplicaSpecs"]) == ["Master", "Worker"]
    wait_for(
        lambda: cluster.get_job(name) is None and not cluster.pods(f"training.kubeflow.org/job-name={name}"),
        30,
        f"PyTorchJob {name} and its pods to be deleted",
    )


def test_quickstart_dag_on_kubernetes(monkeypatch: pytest.MonkeyPatch, cluster: Cluster) -> None:
    use_example_dags(monkeypatch)
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "kubernetes")
    # The quickstart names no image: [torch_elastic] image gives it, the runner image (real_node_env sets it).
    result = run_dag("torch_elastic_quickstart", EXAMPLE_DAGS)
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1), ("report", -1): ("success", 1)}
    assert result.xcom("train", "job_kind") == "Pod"
    metrics = result.xcom("train")
    assert metrics["world_size"] == 2 and metrics["epochs"] == 30
    assert metrics["accuracy"] > 0.8, metrics  # chance is 0.25
    assert math.isfinite(metrics["final_loss"]), metrics
    name = result.xcom("train", "job_name")
    wait_for(lambda: cluster.get_pod(name) is None, 30, f"pod {name} to be deleted")


def test_recoverable_failure_is_retried_with_a_new_job(cluster: Cluster, failure_dir: Path) -> None:
    from airflow_provider_torchelastic.core.naming import job_name

    result = run_dag("k8s_recoverable_retry")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    assert result.xcom() == {"try_number": 2, "rank": 0}
    first_try = (failure_dir / "k8s_recoverable_retry.train.try1.txt").read_text()
    assert first_try.startswith("airflow_provider_torchelastic.operators.UserCodeRecoverableError: "), first_try
    assert "rank 0" in first_try and "TransientStorageError: object store unavailable on try 1" in first_try
    # Each try has its own job: try 1's failed pod is kept, try 2's succeeded pod is deleted.
    first, second = job_name(result.identity(1)), job_name(result.identity(2))
    assert first != second
    assert result.xcom(key="job_name") == second
    kept = cluster.get_pod(first)
    assert kept is not None and kept.status.phase == "Failed"
    assert kept.metadata.labels["torchelastic.airflow.apache.org/try-number"] == "1"
    wait_for(lambda: cluster.get_pod(second) is None, 30, f"pod {second} to be deleted")


def test_permanent_failure_fails_at_once_and_keeps_the_failed_pod(
    cluster: Cluster, failure_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from airflow_provider_torchelastic.core.naming import job_name

    result = run_dag("k8s_permanent_failure")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "retries=2 must not be used for a permanent failure"
    assert [p.name for p in failure_dir.iterdir()] == ["k8s_permanent_failure.train.try1.txt"]
    error = (failure_dir / "k8s_permanent_failure.train.try1.txt").read_text()
    name = job_name(result.identity())
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    assert name in error, error  # the pod (a single Pod is named like the job)
    assert "rank 1" in error and "ValueError: shard 3 has a corrupt header" in error, error
    text = "".join(capfd.readouterr())
    assert "Root cause, rank 1" in text and "failed with ValueError: shard 3 has a corrupt header" in text
    assert "in fail_on_rank_1" in text  # the worker's traceback is in the task log
    pod = cluster.get_pod(name)  # on_finish_action="delete_succeeded" keeps a failed job
    assert pod is not None and pod.status.phase == "Failed"


def test_killed_worker_deletes_its_job(cluster: Cluster, tmp_path: Path) -> None:
    """SIGTERM to the worker: the task runner calls ``on_kill``, which deletes the PyTorchJob and so its pods."""
    log = tmp_path / "worker.log"
    proc = start_dag_subprocess("k8s_killed_worker", log)
    try:
        jobs = wait_for(lambda: cluster.workloads("k8s_killed_worker")[0], 180, "the PyTorchJob")
        name = jobs[0]["metadata"]["name"]
        selector = f"training.kubeflow.org/job-name={name}"
        wait_for(lambda: sum(p.status.phase == "Running" for p in cluster.pods(selector)) == 2, 90, "running pods")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: cluster.get_job(name) is None, 30, f"PyTorchJob {name} to be deleted")
        # The deletion cascades: the garbage collector marks the pods deleted at once. The node then stops them (the
        # runner's graceful stop, 10 s at most here) and removes them: 12 s when idle, over 60 s in one CI run on a
        # loaded machine; bounded only so that a pod left behind fails the test, which then says what holds it.
        marked = f"the pods of {name} to be marked deleted"
        wait_for(lambda: all(p.metadata.deletion_timestamp for p in cluster.pods(selector)), 30, marked)
        try:
            wait_for(lambda: not cluster.pods(selector), 180, f"the pods of {name} to be removed", interval=1)
        except AssertionError as e:
            raise AssertionError(f"{e}; still there: {_pod_states(cluster.pods(selector))}") from None
        wait_for(lambda: proc.poll() is not None, 60, "the killed worker to exit", interval=0.5)
    finally:
        stop_process(proc, timeout=0)
    assert f"Task killed: stopping PyTorchJob {cluster.namespace}/{name}" in log.read_text()


def _pod_states(pods: list[Any]) -> list[tuple[str, str, object, object]]:
    """Each pod's name, phase, deletion time and containers' states: what a timed-out wait for its removal says."""
    return [
        (
            pod.metadata.name,
            pod.status.phase,
            pod.metadata.deletion_timestamp,
            [(c.name, c.state.to_dict()) for c in pod.status.container_statuses or ()],
        )
        for pod in pods
    ]


def test_a_sensitive_env_value_reaches_the_pod_and_no_log_xcom_or_rendered_field(
    cluster: Cluster, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 20, item 2: ``PodOptions(env={"API_TOKEN": ...})`` is masked by Airflow's rules in the task log (the
    manifests and the pod's own log lines), the ``manifests`` XCom, the job summary and ``rendered_job``."""
    from tests.dags.k8s_e2e import SENSITIVE_VALUE

    capfd.readouterr()
    result = run_dag("k8s_sensitive_env")
    out = "".join(capfd.readouterr())
    assert result.state == "success", result
    assert result.xcom() == {"token_arrived": True, "rank": 0}
    assert "the token is ***" in out, "the pod's log line reaches the task log, masked"
    assert SENSITIVE_VALUE not in out
    for key, value in result.xcoms.items():
        assert SENSITIVE_VALUE not in json.dumps(value), key
    assert '"value": "***"' in json.dumps(result.xcom(key="manifests"))
    assert SENSITIVE_VALUE not in json.dumps(rendered_fields("k8s_sensitive_env", result.run_id))


def test_a_late_kill_leaves_a_finished_kept_job(cluster: Cluster) -> None:
    from airflow_provider_torchelastic.triggers import TorchElasticJobTrigger

    result = run_dag("k8s_kept")
    assert result.state == "success", result
    name = result.xcom(key="job_name")
    assert cluster.get_pod(name) is not None
    # A stale trigger of that try (left behind by `airflow dags test`), picked up and cancelled as a user action.
    stale = TorchElasticJobTrigger(
        kind="Pod", name=name, namespace=cluster.namespace, kubernetes_conn_id="kubernetes_default"
    )
    asyncio.run(stale.on_kill())
    pod = cluster.get_pod(name)
    assert pod is not None and pod.metadata.deletion_timestamp is None, "on_finish_action='keep' kept it"
