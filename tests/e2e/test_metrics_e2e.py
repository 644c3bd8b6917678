"""Training metrics end to end: ``report()`` in real workers, progress lines and the last values in the task log,
and the job summary (XCom ``torch_elastic_job``) saved when the job ends, locally and on the real node."""

from __future__ import annotations

import re

import pytest

from airflow_provider_torchelastic.core.summary import XCOM_KEY, JobSummary
from tests.e2e import real_node_support as on_node

# The real node's fixtures, bound here so that pytest finds them; not its autouse one: the local test needs no node.
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
node_dag_env, real_node_image = on_node.node_dag_env, on_node.real_node_image

PROGRESS = re.compile(r"metrics: step (\d+) loss=\S+ accuracy=\S+")


def progress_steps(text: str) -> list[int]:
    return [int(match.group(1)) for match in PROGRESS.finditer(text)]


@pytest.mark.slow
@pytest.mark.usefixtures("airflow_db")
def test_local_run_logs_progress_and_saves_the_job_summary(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from tests.e2e.test_local_execution import run_dag

    # 40 steps over about 2 s: a few lines at 0.5 s, never one per step.
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__REPORT_INTERVAL", "0.5")
    result = run_dag("te_metrics_local")
    text = "".join(capfd.readouterr())
    assert result.tasks == {("train", -1): ("success", 1), ("train_fails", -1): ("failed", 1)}, result

    assert "TORCHELASTIC_METRICS" not in text, "metrics lines are shown as progress lines, not raw JSON"
    steps = progress_steps(text)
    assert 2 <= len(steps) < 40 and 39 in steps, text
    # The final line of the task: its result, then the last values.
    assert "Training succeeded; rank 0's result: {'rank': 0, 'steps': 40}; last metrics: step 39 loss=0.025 " in text

    summary = JobSummary.from_json(result.xcom("train", XCOM_KEY))
    assert (summary.kind, summary.namespace, summary.phase, summary.root_cause) == ("local", None, "succeeded", None)
    assert summary.name == result.xcom("train", XCOM_KEY)["name"] and summary.elapsed_seconds > 1
    assert summary.last_metrics == {"loss": 0.025, "accuracy": 0.975}
    loss = summary.metrics["loss"]
    assert loss[0] == (0.0, 1.0) and loss[-1] == (39.0, 0.025) and len(loss) >= 2
    assert [(p.name, p.replica_type, p.phase, p.exit_code) for p in summary.pods] == [
        ("node-0", "node", "Succeeded", 0),
        ("node-1", "node", "Succeeded", 0),
    ]
    holder = next(p for p in summary.pods if p.ranks)
    assert holder.ranks == (0,) and "[rank0]:rank 0 trained 40 steps" in holder.log_tail

    # A failed run saves its summary too, before the task raises: the root cause and the pod that had it.
    failed = JobSummary.from_json(result.xcom("train_fails", XCOM_KEY))
    assert failed.phase == "failed" and failed.root_cause is not None
    assert "ValueError: rank 1 diverged after 5 steps" in failed.root_cause
    (culprit,) = failed.pods
    assert (culprit.name, culprit.phase, culprit.ranks, culprit.exit_code) == ("node-0", "Failed", (0, 1), 1)
    assert "rank 1 diverged" in culprit.message and "ValueError: rank 1 diverged" in culprit.log_tail
    assert failed.last_metrics == {"loss": 0.2, "accuracy": 0.8}
    assert "Training failed; last metrics: step 4 loss=0.2 accuracy=0.8" in text


@pytest.mark.cluster
@pytest.mark.usefixtures("airflow_db", "clean_namespace", "node_dag_env")
@pytest.mark.parametrize("dag_id", ["k8s_metrics_sync", "k8s_metrics_deferred"])
def test_kubernetes_wait_logs_progress_and_saves_the_pods(
    dag_id: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from tests.e2e.test_kubernetes import run_dag

    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__REPORT_INTERVAL", "1")
    result = run_dag(dag_id)
    text = "".join(capfd.readouterr())
    assert result.state == "success", result
    name = result.xcom(key="job_name")
    # Rendered into the pods: the interval the Airflow option set.
    env = result.xcom(key="manifests")[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "TORCHELASTIC_REPORT_INTERVAL", "value": "1"} in env["containers"][0]["env"]

    assert "TORCHELASTIC_METRICS" not in text
    if dag_id == "k8s_metrics_sync":
        # Deferred, the progress lines are in the trigger's log, which dag.test() does not print; the last values and
        # the summary below still come through the trigger event.
        steps = progress_steps(text)
        assert steps and steps[-1] == 29, text
    assert "last metrics: step 29 loss=0.03333 accuracy=0.9667" in text

    summary = JobSummary.from_json(result.xcom(key=XCOM_KEY))
    assert (summary.kind, summary.namespace, summary.name, summary.phase) == (
        "PyTorchJob",
        result.xcom(key="job_namespace"),
        name,
        "succeeded",
    )
    assert summary.created <= summary.finished and summary.elapsed_seconds > 0
    pods = [(p.name, p.replica_type, p.replica_index, p.ranks, p.phase, p.exit_code) for p in summary.pods]
    assert pods[0] == (f"{name}-master-0", "master", 0, (0,), "Succeeded", 0), pods
    # With a Master, only the Master decides the job's success (kubeflow/trainer v1.9 pytorchjob_controller.go:400),
    # and the task ends with it: its worker may have ended by then or be a moment from it (the summary is a snapshot).
    assert pods[1][:4] == (f"{name}-worker-0", "worker", 0, (1,)) and pods[1][4:] in {
        ("Succeeded", 0),
        ("Running", None),
    }
    assert len(pods) == 2, pods
    assert summary.last_metrics == pytest.approx({"loss": 1 / 30, "accuracy": 29 / 30}, abs=1e-6)
    loss = summary.metrics["loss"]
    assert loss[0][0] == 0 and loss[-1][0] == 29
    # The wait streamed rank 0's pod (the Master's): its tail is in the summary.
    assert "[rank0]:rank 0 trained 30 steps" in summary.pods[0].log_tail
