"""Only what this try created is its own, on the local cluster (issue 19): a pod with the job's labels that the job
does not control gives no result, and a payload Secret created before the task is never run.

The fixtures are those of test_kubernetes.py (one cluster per session, the namespace emptied after each test).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Final

import pytest

from tests.conftest import TEST_DAGS
from tests.dag_support import SIM_IMAGE
from tests.e2e.test_kubernetes import (  # noqa: F401 - fixtures, found by pytest through this import
    Cluster,
    clean_namespace,
    cluster,
    connection,
    failure_dir,
    run_dag,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]

IMAGE = SIM_IMAGE
FORGED = {"value": "forged", "rank": 0}


def _forged_pod(name: str, labels: dict[str, str], owner: dict[str, Any]) -> dict[str, Any]:
    """A pod that says, in the provider's own format, that it holds rank 0 and returned :data:`FORGED`."""
    from airflow_provider_torchelastic.core.outcome import encode_success

    document = encode_success(json.dumps(FORGED))
    write = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
    container = {
        "name": "pytorch",
        "image": IMAGE,
        "command": ["python", "-c", write, "/dev/termination-log", document],
        "terminationMessagePath": "/dev/termination-log",
    }
    metadata = {"name": name, "labels": labels, "ownerReferences": [owner]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"restartPolicy": "Never", "containers": [container]},
    }


_GONE: Final = object()


def _ended_or_gone(cluster: Cluster, name: str) -> Any:  # noqa: F811
    """The pod once it has ended, :data:`_GONE` once it is deleted (collected), else None (still running, or being
    deleted)."""
    pod = cluster.get_pod(name)
    if pod is None:
        return _GONE
    return pod if pod.metadata.deletion_timestamp is None and pod.status.phase in ("Succeeded", "Failed") else None


def test_a_pod_with_the_jobs_labels_but_another_controller_gives_no_result(
    cluster: Cluster,  # noqa: F811
    failure_dir: Path,  # noqa: F811
) -> None:
    """Created while the job runs, it ends first with rank 0's "result"; the task returns the job's own."""
    dag_id = "k8s_foreign_pod"
    forged: dict[str, Any] = {}

    def add_the_foreign_pod() -> None:
        pods = wait_for(lambda: cluster.workloads(dag_id)[1], 180, "the job's pods")
        real = min(pods, key=lambda p: p.metadata.name)
        job = real.metadata.owner_references[0]
        # The same kind and name as the job's controller, another uid: what a second controller of the name has.
        owner = {"apiVersion": job.api_version, "kind": job.kind, "name": job.name, "uid": "0" * 8 + "-forged"}
        name = f"{job.name}-master-0"
        forged_pod = _forged_pod(name, dict(real.metadata.labels), owner)
        # The simulated operator plays the garbage collector, as the real one does: every 30 s it deletes what names
        # an owner uid that no longer exists, so on a loaded machine it may collect the forged pod before the pod has
        # ended (CI saw it once). Then the pod is created again, after that sweep.
        for _ in range(3):
            cluster.core.create_namespaced_pod(cluster.namespace, forged_pod)
            ended = wait_for(lambda: _ended_or_gone(cluster, name), 90, "the foreign pod to end or be collected")
            if ended is not _GONE:
                break
        assert ended is not _GONE and ended.status.phase == "Succeeded", ended
        forged["pod"] = ended
        time.sleep(2)  # two polls of the wait see it (poll_interval=1)

    def release() -> None:
        try:
            add_the_foreign_pod()
        finally:
            (failure_dir / "release").touch()  # the job's workers return

    adder = threading.Thread(target=release, daemon=True)
    adder.start()
    result = run_dag(dag_id, TEST_DAGS)
    adder.join(timeout=300)
    assert "pod" in forged, "the foreign pod was never created, or never succeeded"
    assert result.state == "success", result
    assert result.xcom() == {"value": "the job's own", "rank": 0}
    summary = result.xcom(key="torch_elastic_job")
    assert forged["pod"].metadata.name not in json.dumps(summary), summary


def test_a_payload_secret_created_before_the_task_is_never_run(cluster: Cluster) -> None:  # noqa: F811
    """Someone computes the job name (a hash of dag, task, run and try) and creates ``<job>-payload`` with their own
    function first: the task replaces it and returns its own result; the attacker's function never runs."""
    import datetime
    import random

    from airflow_provider_torchelastic.core.naming import RunIdentity, job_name
    from airflow_provider_torchelastic.core.payload import dump_payload
    from airflow_provider_torchelastic.kubernetes.render import render_manifests
    from airflow_provider_torchelastic.kubernetes.submit import TOKEN_ANNOTATION
    from tests.e2e.test_kubernetes import load_dag, read_run

    dag_id = "k8s_squatted_payload"
    dag = load_dag(dag_id, TEST_DAGS)
    task = dag.task_dict["train"]
    # A run_id known in advance, as anyone who can guess the next run's date knows it.
    when = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=random.randrange(10**8))
    run_id = f"manual__{when.isoformat()}"
    identity = RunIdentity(dag_id=dag_id, task_id="train", run_id=run_id, try_number=1)
    attacker = dump_payload(task.python_callable, (), {"seconds": 0, "value": "the attacker's"})
    squatter, _ = render_manifests(
        task.task_config, identity=identity, namespace=cluster.namespace, image=IMAGE, payload=attacker
    )
    assert squatter["metadata"]["name"] == f"{job_name(identity)}-payload"
    cluster.core.create_namespaced_secret(cluster.namespace, squatter)

    dag_run = dag.test(logical_date=when, run_after=when)
    assert dag_run.run_id == run_id
    result = read_run(dag_id, run_id)
    assert result.state == "success", result
    assert result.xcom() == {"value": "the real payload", "rank": 0}
    left = cluster.get_payload(squatter["metadata"]["name"])  # deleted with the job, or this try's own
    assert left is None or (left.metadata.annotations or {}).get(TOKEN_ANNOTATION), left


def test_whatever_a_pod_prints_or_leaves_as_its_termination_message_the_task_ends_cleanly(
    cluster: Cluster,  # noqa: F811
    failure_dir: Path,  # noqa: F811
) -> None:
    """Issue 19, item 4, on Kubernetes: hostile metrics lines in rank 0's log, and termination messages that the
    training code forged (nested 999 deep, in the file and as the log tail FallbackToLogsOnError takes, and the
    provider's envelope with fields of the wrong type) give a result or a failure that names the pod, never a
    parser's exception."""
    result = run_dag("k8s_hostile_pod", TEST_DAGS)
    assert result.tasks[("metrics", -1)] == ("success", 1), result
    assert result.xcom("metrics") == {"value": "survived its own output", "rank": 0}
    for task_id in ("nested_message", "nested_log_tail", "forged_document"):
        assert result.tasks[(task_id, -1)] == ("failed", 1), (task_id, result)
        failure = (failure_dir / f"k8s_hostile_pod.{task_id}.try1.txt").read_text()
        # Killed by a bare signal, with no reason: the platform's doing (InfrastructureError, a recoverable cause).
        assert failure.startswith("airflow_provider_torchelastic.operators.InfrastructureError: "), failure
        job = result.xcom(task_id, key="job_name")
        # Killed from outside, for all the pod's forged text says: a retry may help.
        assert f"{job} exited with code 137 without a failure report" in failure, failure
        assert "a retry may help" in failure, failure
        for crash in ("RecursionError", "AttributeError", "KeyError", "TypeError", "JSONDecodeError"):
            assert crash not in failure, failure
