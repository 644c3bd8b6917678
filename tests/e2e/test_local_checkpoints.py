"""Retries and checkpoints with local execution, through ``dag.test()``: a try that saved checkpoints and then failed
recoverably resumes from its last complete checkpoint in the next try, and a 1 MB result arrives intact through
result storage; both through file:// and an S3-compatible server (moto) started by the tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.run_context import checkpoint_location
from tests.dags.retries_and_checkpoints import FAIL_AFTER, STEPS, one_megabyte
from tests.e2e.test_local_execution import run_dag
from tests.s3_server import S3Server, s3, s3_env  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]


@pytest.fixture(params=["file", "s3"])
def storage_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A root for checkpoints or results: a file:// folder, or a prefix on the S3 server (credentials in the env)."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    server: S3Server = request.getfixturevalue("s3_env")
    return server.url(tmp_path.name)


def assert_resumed_from_the_last_complete_checkpoint(
    value: dict[str, Any], dag_id: str, run_id: str, root: str
) -> None:
    """What the DAG's training function of tests/dags/retries_and_checkpoints.py returned in its second try: try 1
    saved steps 0..2, was cut off while saving step 3 and failed; try 2 found step 2, not the torn step 3, and its run
    context is the task instance's, not the Airflow worker's."""
    assert value["resumed_from"] == FAIL_AFTER and value["had_checkpoint"] is True, value
    assert value["total"] == sum(range(STEPS)), value
    assert (value["try_number"], value["max_tries"], value["rank"], value["world_size"]) == (2, 1, 0, 1), value
    assert value["identity"] == [dag_id, "train", run_id, -1]
    assert value["logical_date"] is not None
    assert value["checkpoint_uri"] == checkpoint_location(
        root, dag_id=dag_id, run_id=run_id, task_id="train", map_index=-1
    )
    assert value["airflow_ctx"] == [], "workers must not see the Airflow worker's AIRFLOW_CTX_*"


def test_a_retried_try_resumes_from_the_last_complete_checkpoint(
    storage_root: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", storage_root)
    monkeypatch.setenv("AIRFLOW_CTX_DAG_ID", "a_variable_of_the_worker_that_must_not_reach_the_training_function")
    monkeypatch.setenv("TORCHELASTIC_E2E_OUT", str(tmp_path))
    result = run_dag("te_checkpoint_resume")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    value = result.xcom()
    assert_resumed_from_the_last_complete_checkpoint(value, "te_checkpoint_resume", value["identity"][2], storage_root)
    assert value["node"] and value["restart_count"] == 0
    first_try = (tmp_path / "te_checkpoint_resume.train.try1.txt").read_text()
    assert "RecoverableError: preempted after step 2" in first_try, first_try


def test_a_one_megabyte_result_arrives_intact_through_result_storage(
    storage_root: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE", storage_root)
    if storage_root.startswith("s3://"):
        # The Airflow side reads through ObjectStoragePath with an aws connection to the server.
        server: S3Server = request.getfixturevalue("s3")
        monkeypatch.setenv("AIRFLOW_CONN_RESULTS_S3", server.connection_json())
        monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE_CONN_ID", "results_s3")
    result = run_dag("te_large_result")
    assert result.state == "success", result
    value = result.xcom()
    assert value["rank"] == 0 and len(value["text"]) == 1 << 20
    assert value["text"] == one_megabyte()
    # Read, so deleted ([torch_elastic] result_storage_keep is off).
    if storage_root.startswith("s3://"):
        prefix = storage_root.split("/", 3)[3]
        assert request.getfixturevalue("s3").keys(prefix) == []
    else:
        folder = Path(storage_root.removeprefix("file://"))
        assert not [p for p in folder.rglob("*") if p.is_file()]


def test_result_storage_keep_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE", str(tmp_path / "results"))
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE_KEEP", "True")
    result = run_dag("te_large_result")
    assert result.state == "success", result
    (kept,) = (tmp_path / "results").rglob("result.json")
    assert kept.parts[-2] == "1"  # the try number
    assert json.loads(kept.read_text()) == result.xcom()


def test_the_quickstart_resumes_after_its_last_checkpointed_epoch_when_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.e2e.test_local_execution import EXAMPLE_DAGS, LOCAL_BUNDLE, TEST_DAGS, load_dag

    # As test_quickstart_dag_trains_a_classifier: dag.test() reads the bundle list, not [core] dags_folder.
    bundles = [
        {"name": "dags-folder", "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(TEST_DAGS)}},
        {"name": "example-dags", "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(EXAMPLE_DAGS)}},
    ]
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", str(tmp_path / "checkpoints"))
    dag_run = load_dag("torch_elastic_quickstart", EXAMPLE_DAGS).test(run_conf={"interrupt_at_epoch": 10})
    assert str(dag_run.state) == "success"
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        (row,) = session.scalars(
            XComModel.get_many(
                run_id=dag_run.run_id, key="return_value", dag_ids="torch_elastic_quickstart", task_ids="train"
            )
        ).all()
        metrics = XComModel.deserialize_value(row)
    # The first try stopped after epoch 10; the retry loaded that epoch's model and optimizer and trained 11..29.
    assert metrics["try_number"] == 2 and metrics["resumed_after_epoch"] == 10, metrics
    assert metrics["epochs"] == 30 and metrics["accuracy"] > 0.8, metrics
    steps = sorted(p.name[:17] for p in (tmp_path / "checkpoints").rglob("step-*"))
    assert steps == [f"step-{epoch:012d}" for epoch in range(30)], steps
