"""The framework integrations on the real node (tests/e2e/real_node_support.py), in the runner image built with
``STORAGE=1 FRAMEWORKS=1`` (tests/cluster/image.py builds that variant only for this module): the Hugging Face
``Trainer`` whose retry, in a new Pod, resumes from the checkpoint its first try left in a ``file://`` folder the Pods
mount by hostPath, and ``accelerate`` checkpointing to ``s3://`` on the S3 server at the node's address. Their metrics
reach the job summary through the Pods' logs. The DAGs are tests/dags/k8s_frameworks.py; what the frameworks do
beyond this (losses against an uninterrupted run, Lightning, stops) is tests/e2e/test_local_frameworks.py's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from airflow_provider_torchelastic.core.run_context import checkpoint_location
from airflow_provider_torchelastic.core.summary import XCOM_KEY, JobSummary
from tests.cluster import image, real_node, registry
from tests.cluster.pytest_plugin import RealNodeCluster
from tests.conftest import TEST_DAGS
from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import DagRunResult
from tests.e2e.test_kubernetes import run_dag as run_dag_in
from tests.s3_server import S3Server, use_server_env

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them; s3 is the server on the node's address.
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, s3 = on_node.real_node_env, on_node.node_dag_env, on_node.s3

#: The one DAG file these tests parse.
DAG_FILE = TEST_DAGS / "k8s_frameworks.py"


def say(message: str) -> None:
    """Timings, outside pytest's capture: what the module costs is part of what it reports."""
    print(f"\n[frameworks on node] {message}", file=sys.__stderr__, flush=True)


@pytest.fixture(scope="module")
def frameworks_image(real_node_cluster: RealNodeCluster) -> str:
    """The ``STORAGE=1 FRAMEWORKS=1`` image in the node's registry; what its Pods name."""
    started = time.monotonic()
    try:  # about a second when current; cold, its pip install takes minutes
        image.ensure_images(frameworks=True, log=lambda line: say(line) if line.startswith("[runner-image") else None)
    except image.ImageBuildError as e:
        pytest.fail(f"the frameworks image could not be built: {e}", pytrace=False)
    layout = real_node_cluster.layout
    tag = image.RUNNER_FRAMEWORKS_REF.rpartition(":")[2]
    # The node pushed the variants built when it started; this one may have been built since, or rebuilt.
    registry.push_runner_images(layout, {image.RUNNER_FRAMEWORKS_REF: tag}, say)
    ref = registry.image_ref(layout, tag)
    # An earlier build may be in containerd under this name (IfNotPresent would run it): the first Pod pulls this one.
    # Only its package layers travel (0.7 s): the others are there, from the archives the node imported at up.
    real_node.ctr(layout, "images", "rm", ref, check=False)
    say(f"{ref} ready in {time.monotonic() - started:.1f}s")
    return ref


@pytest.fixture
def real_node_image(frameworks_image: str) -> str:
    return frameworks_image


def run_dag(dag_id: str) -> DagRunResult:
    started = time.monotonic()
    result = run_dag_in(dag_id, DAG_FILE)
    say(f"{dag_id}: {result.state} in {time.monotonic() - started:.1f}s")
    return result


def summary_of(result: DagRunResult) -> JobSummary:
    summary = JobSummary.from_json(result.xcom(key=XCOM_KEY))
    assert summary.phase == "succeeded", summary
    return summary


def test_the_trainer_resumes_in_a_new_pod_from_a_checkpoint_on_the_shared_folder(
    tmp_path: Path, real_node_cluster: RealNodeCluster, failure_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_torchelastic.worker import checkpoint

    # In the folder the Pods mount by hostPath: try 2's Pod sees what try 1's wrote.
    root = f"file://{real_node_cluster.shared_dir / tmp_path.name / 'ckpt'}"
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", root)
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__REPORT_INTERVAL", "0.5")
    dag_id = "k8s_frameworks_transformers"
    result = run_dag(dag_id)
    assert result.tasks == {("train", -1): ("success", 2)}, result
    error = (failure_dir / f"{dag_id}.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeRecoverableError: "), error
    assert "RecoverableError: interrupted after the checkpoint of step 2" in error, error
    # The Trainer's state when try 2 began: the step of try 1's checkpoint.
    value = result.xcom()
    assert (value["first_step"], value["steps"]) == (2, 4), value
    summary = summary_of(result)
    assert {"loss", "learning_rate", "grad_norm", "epoch"} <= set(summary.last_metrics), summary.last_metrics
    # The logs of try 2's Pod: steps 3 and 4, none before them.
    assert [step for step, _ in summary.metrics["loss"]] == [3, 4], summary.metrics
    location = checkpoint_location(root, dag_id=dag_id, run_id=result.run_id, task_id="train", map_index=-1)
    committed = checkpoint.complete(f"{location}/transformers", kind="transformers.Trainer")
    assert [c.step for c in committed] == [2, 4], committed  # try 1's, then try 2's
    newest = Path(committed[-1].uri.removeprefix("file://")) / "checkpoint-4"
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "model.safetensors"} <= {
        p.name for p in newest.iterdir()
    }
    assert json.loads((newest / "trainer_state.json").read_text())["global_step"] == 4


def test_accelerate_checkpoints_to_s3(tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic.worker import checkpoint

    # Read by the DAG file when it is parsed (PodOptions env), as a Secret's would be; this side reads the store too.
    monkeypatch.setenv("TORCHELASTIC_TEST_POD_ENV", json.dumps(s3.env))
    use_server_env(s3, monkeypatch)
    root = s3.url(f"frameworks/{tmp_path.name}")
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", root)
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__REPORT_INTERVAL", "0.5")
    dag_id = "k8s_frameworks_accelerate"
    result = run_dag(dag_id)
    assert result.tasks == {("train", -1): ("success", 1)}, result
    value = result.xcom()
    assert (value["first_step"], value["steps"]) == (0, 4), value
    summary = summary_of(result)
    assert [step for step, _ in summary.metrics["loss"]] == [0, 1, 2, 3], summary.metrics
    location = checkpoint_location(root, dag_id=dag_id, run_id=result.run_id, task_id="train", map_index=-1)
    committed = checkpoint.complete(f"{location}/accelerate", kind="accelerate")
    assert [c.step for c in committed] == [1, 3], committed
    assert all(c.uri.startswith("s3://") for c in committed), committed
    newest = checkpoint.open_store(committed[-1].uri)
    files = newest.files(newest.path("step-3"))
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(files), files
