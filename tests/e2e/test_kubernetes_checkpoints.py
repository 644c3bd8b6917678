"""Retries and checkpoints on the local cluster (real kube-apiserver; the simulated kubelet runs the pods' runners in
the runner env, which has s3fs as the image built with STORAGE=1 has): the run context rendered into the pods, a
retried try that resumes from its checkpoint, and a 1 MB result through result storage, via file:// and an
S3-compatible server (moto) whose credentials reach the pods through their env, never the payload."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.dags.retries_and_checkpoints import one_megabyte
from tests.e2e.test_kubernetes import (  # noqa: F401 - fixtures
    Cluster,
    clean_namespace,
    cluster,
    connection,
    failure_dir,
    run_dag,
)
from tests.e2e.test_local_checkpoints import assert_resumed_from_the_last_complete_checkpoint
from tests.s3_server import S3Server, s3  # noqa: F401 - a fixture

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]


def give_pods_the_s3_server(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the DAG file when it is parsed (PodOptions env): how pods get a Secret's credentials in production.
    monkeypatch.setenv("TORCHELASTIC_TEST_POD_ENV", json.dumps(server.env))


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_retried_try_resumes_from_its_checkpoint_on_kubernetes(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if store == "file":
        # The simulated kubelet's containers are processes of this machine: a folder here is a volume they share.
        root = f"file://{tmp_path / 'ckpt'}"
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
