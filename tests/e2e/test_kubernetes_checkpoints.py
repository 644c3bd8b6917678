"""Retries and checkpoints on the real node (tests/e2e/real_node_support.py; the pods run the runner image built with
STORAGE=1, which has s3fs): the run context rendered into the pods, a retried try, in a new pod, that resumes from
its checkpoint, and a 1 MB result through result storage, via file:// on a folder the pods mount by hostPath and an
S3-compatible server (moto) on the node's address, whose credentials reach the pods through their env, never the
payload."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cluster.pytest_plugin import RealNodeCluster
from tests.dags.retries_and_checkpoints import one_megabyte
from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import run_dag
from tests.e2e.test_local_checkpoints import assert_resumed_from_the_last_complete_checkpoint
from tests.s3_server import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them; s3 is the server on the node's address, and the
# pods run the STORAGE=1 image (s3fs).
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, s3 = on_node.real_node_env, on_node.node_dag_env, on_node.s3
real_node_image = on_node.storage_image


def give_pods_the_s3_server(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the DAG file when it is parsed (PodOptions env): how pods get a Secret's credentials in production.
    monkeypatch.setenv("TORCHELASTIC_TEST_POD_ENV", json.dumps(server.env))


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_retried_try_resumes_from_its_checkpoint_on_kubernetes(
    store: str,
    tmp_path: Path,
    real_node_cluster: RealNodeCluster,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    if store == "file":
        # In the folder the pods mount by hostPath: try 2's pod sees what try 1's wrote (a pod's own file system
        # would not: tests/e2e/test_real_node_e2e.py checks that too).
        root = f"file://{real_node_cluster.shared_dir / tmp_path.name / 'ckpt'}"
    else:
        server: S3Server = request.getfixturevalue("s3")
        give_pods_the_s3_server(server, monkeypatch)
        root = server.url(f"ckpt/{tmp_path.name}")
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", root)
    result = run_dag("k8s_checkpoint_resume")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    value = result.xcom()
    assert_resumed_from_the_last_complete_checkpoint(value, "k8s_checkpoint_resume", result.run_id, root)
    # The node is the pod: Kubernetes sets HOSTNAME to the pod's name.
    assert value["node"].startswith(result.xcom(key="job_name")), value
    # failure_dir (autouse) points the DAG's failure callbacks here.
    first_try = (Path(os.environ["TORCHELASTIC_E2E_OUT"]) / "k8s_checkpoint_resume.train.try1.txt").read_text()
    assert "RecoverableError: preempted after step 2" in first_try, first_try


def test_a_one_megabyte_result_arrives_intact_through_s3_on_kubernetes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    server: S3Server = request.getfixturevalue("s3")
    give_pods_the_s3_server(server, monkeypatch)
    prefix = f"results/{tmp_path.name}"
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE", server.url(prefix))
    monkeypatch.setenv("AIRFLOW_CONN_RESULTS_S3", server.connection_json())
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE_CONN_ID", "results_s3")
    result = run_dag("k8s_large_result")
    assert result.state == "success", result
    value = result.xcom()
    assert value["rank"] == 0 and value["text"] == one_megabyte()
    assert server.keys(prefix) == [], "read, so deleted"
    # The credentials reached the pod through its env, not through the payload or the command line; the manifests
    # XCom shows the env entry, its value masked (a sensitive name: issue 20, item 2).
    manifest = result.xcom(key="manifests")[1]
    container = manifest["spec"]["containers"][0]
    assert "testing" not in " ".join(container["command"])
    assert {"name": "AWS_SECRET_ACCESS_KEY", "value": "***"} in container["env"]
