"""Local execution end to end: DAG files under tests/dags run through ``dag.test()`` with real runner processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, TEST_DAGS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]

EXAMPLE_DAGS = REPO_ROOT / "example_dags"
LOCAL_BUNDLE = "airflow.dag_processing.bundles.local.LocalDagBundle"


@dataclass(frozen=True)
class DagRunResult:
    state: str
    #: (task_id, map_index) -> (state, try_number)
    tasks: dict[tuple[str, int], tuple[str, int]]
    #: (task_id, map_index, key) -> value
    xcoms: dict[tuple[str, int, str], Any]

    def xcom(self, task_id: str = "train", key: str = "return_value", map_index: int = -1) -> Any:
        return self.xcoms[(task_id, map_index, key)]


def load_dag(dag_id: str, folder: Path = TEST_DAGS):
    from airflow.dag_processing.dagbag import BundleDagBag

    # As Airflow's dag-processor and task runner read a bundle: its folder on sys.path, so that a DAG file imports the
    # modules beside it (example_dags/torch_elastic_frameworks.py does).
    bag = BundleDagBag(dag_folder=str(folder), bundle_path=folder, safe_mode=False)
    assert not bag.import_errors, bag.import_errors
    return bag.dags[dag_id]


def run_dag(dag_id: str, folder: Path = TEST_DAGS) -> DagRunResult:
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    dag_run = load_dag(dag_id, folder).test()
    with create_session() as session:
        tis = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == dag_run.run_id)
        ).all()
        rows = session.scalars(XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_id)).all()
        return DagRunResult(
            state=str(dag_run.state),
            tasks={(ti.task_id, ti.map_index): (str(ti.state), ti.try_number) for ti in tis},
            xcoms={(row.task_id, row.map_index, row.key): XComModel.deserialize_value(row) for row in rows},
        )


@pytest.fixture
def failure_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where the DAGs' failure callbacks write the task's exception."""
    out = tmp_path / "failures"
    out.mkdir()
    monkeypatch.setenv("TORCHELASTIC_E2E_OUT", str(out))
    yield out


def test_two_local_nodes_with_two_workers_each() -> None:
    result = run_dag("te_two_nodes")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1)}
    # ranks 0..3 plus an offset of 1 each: 1 + 2 + 3 + 4
    assert result.xcom() == {"rank": 0, "world_size": 4, "sum": 10.0}


def test_decorator_with_multiple_outputs_and_expand() -> None:
    result = run_dag("te_mapped_decorator")
    assert result.state == "success", result
    assert result.tasks == {("scaled_sum", 0): ("success", 1), ("scaled_sum", 1): ("success", 1)}
    for map_index, factor in enumerate([2, 5]):
        expected = {"factor": factor, "total": 3.0 * factor, "world_size": 2}
        assert result.xcom("scaled_sum", map_index=map_index) == expected
        for key, value in expected.items():
            assert result.xcom("scaled_sum", key, map_index) == value


def test_an_async_function_gets_the_context_values_its_parameters_name() -> None:
    result = run_dag("te_context_arguments")
    assert result.state == "success", result
    value = result.xcom("context_values", map_index=0)
    module, logical_date = value.pop("logical_date")
    assert module == "datetime", "a standard datetime: the runner image has no pendulum"
    assert value["ds"] == logical_date[:10] and value["run_id"].startswith("manual__"), value
    run = str(uuid.uuid5(uuid.NAMESPACE_URL, value["run_id"]))
    assert value.pop("converted") == {"duration": 120.0, "lr": 0.1, "run": run}
    assert {k: value[k] for k in ("epochs", "params", "try_number", "kwargs")} == {
        "epochs": 3,
        "params": {"lr": 0.1},
        "try_number": 1,
        "kwargs": {},  # **kwargs gets the call's own keyword arguments only
    }


def test_recoverable_failure_is_retried_and_succeeds(failure_dir: Path) -> None:
    result = run_dag("te_recoverable_retry")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    assert result.xcom() == {"try_number": 2, "rank": 0}
    first_try = (failure_dir / "te_recoverable_retry.train.try1.txt").read_text()
    assert first_try.startswith("airflow_provider_torchelastic.operators.UserCodeRecoverableError: ")
    assert "rank 0" in first_try and "TransientStorageError: object store unavailable on try 1" in first_try
    assert "(recoverable)" in first_try


def test_permanent_failure_fails_without_retrying(failure_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    result = run_dag("te_permanent_failure")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "retries=2 must not be used for a permanent failure"
    assert [p.name for p in failure_dir.iterdir()] == ["te_permanent_failure.train.try1.txt"]
    error = (failure_dir / "te_permanent_failure.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: ")
    assert "rank 1" in error and "ValueError: shard 3 has a corrupt header" in error
    assert "non-recoverable" in error
    # The task log names the root cause and has the worker's traceback.
    log = capfd.readouterr()
    text = log.out + log.err
    assert "Root cause, rank 1 on " in text and "failed with ValueError: shard 3 has a corrupt header" in text
    assert "torchelastic runner: non-recoverable failure: rank 1" in text
    assert "in fail_on_rank_1" in text


def test_a_result_over_the_kubernetes_limit_fails_locally_too(failure_dir: Path) -> None:
    # One limit wherever the task runs: what works locally must work on Kubernetes (4096-byte termination message).
    result = run_dag("te_result_over_the_limit")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "a result that is too large is not worth a retry"
    error = (failure_dir / "te_result_over_the_limit.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.ConfigurationError: "), error
    assert "more than the limit of 4096 bytes" in error, error


def test_execution_from_airflow_config_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")
    # An option only a deferred wait reads: a local try, which cannot defer, must not fail on it.
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EARLY_EVENT_HOLD", "soon")
    result = run_dag("te_execution_from_config")
    assert result.state == "success", result
    assert result.xcom() == 1


def test_execution_defaults_to_kubernetes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unset, [torch_elastic] execution is "kubernetes": with no image anywhere (this DAG names none, and no
    # [torch_elastic] image is configured) the DAG file fails to parse, naming the places an image can come from.
    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", raising=False)
    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__IMAGE", raising=False)
    with pytest.raises(AssertionError, match="AIRFLOW__TORCH_ELASTIC__IMAGE") as info:
        load_dag("te_execution_from_config")
    assert "torch_elastic_e2e.py" in str(info.value)


def use_example_dags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example folder as a second bundle, beside the tests' DAGs, for ``run_dag(..., EXAMPLE_DAGS)``."""
    # Airflow reads [core] dags_folder once, at import (airflow.settings.DAGS_FOLDER), so setting
    # AIRFLOW__CORE__DAGS_FOLDER now would not be seen; the bundle list is read each time dag.test() syncs bundles.
    bundles = [
        {"name": "dags-folder", "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(TEST_DAGS)}},
        {"name": "example-dags", "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(EXAMPLE_DAGS)}},
    ]
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))


def test_quickstart_dag_trains_a_classifier(monkeypatch: pytest.MonkeyPatch) -> None:
    use_example_dags(monkeypatch)
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")
    result = run_dag("torch_elastic_quickstart", EXAMPLE_DAGS)
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1), ("report", -1): ("success", 1)}
    metrics = result.xcom("train")
    assert metrics["world_size"] == 2 and metrics["epochs"] == 30
    assert metrics["accuracy"] > 0.8, metrics  # chance is 0.25
    assert math.isfinite(metrics["final_loss"]), metrics


def test_the_readmes_first_command_runs_the_quickstart_on_a_clean_environment(tmp_path: Path) -> None:
    """``make demo`` as a user runs it: scripts/quickstart.py in a process of its own, from the checkout, with none of
    the suite's environment (no PYTHONPATH, no Airflow settings). It parses the whole example folder as Airflow's
    dag-processor does, so an example DAG that imports wrongly fails here, as it once did only for users."""
    recipe = (REPO_ROOT / "Makefile").read_text().split("\ndemo: setup\n", 1)[1].splitlines()[0].strip()
    assert recipe == ".venv/bin/python scripts/quickstart.py", "the test runs what `make demo` runs"
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    env = {name: os.environ[name] for name in keep if name in os.environ}
    env.update(
        TORCHELASTIC_DEMO_HOME=str(tmp_path / "airflow-home"),
        AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT=str(tmp_path / "checkpoints"),
    )
    proc = subprocess.run(
        [sys.executable, "scripts/quickstart.py"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("(XCom return_value of 'train'):\n", 1)[1].split("\n\n", 1)[0])
    assert result["world_size"] == 2 and result["accuracy"] > 0.8, result
    assert "make ui" in proc.stdout
    assert "DAG import errors" not in proc.stderr


def test_whatever_rank_0_prints_the_task_ends_with_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hostile metrics lines, bytes that are not UTF-8 and a 3 MiB line: the output pump and the metrics tap survive
    # them (a dead pump once left the runner blocked on a full pipe until the task was killed).
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgresql://user:secret@db/warehouse")
    monkeypatch.setenv("AIRFLOW_VAR_API_TOKEN", "secret")
    result = run_dag("te_hostile_output")
    assert result.state == "success", result
    value = result.xcom()
    assert value["airflow_settings"] == [], "workers get none of Airflow's settings, connections or variables"
    assert value["stdin"] == "", "workers read nothing from the Airflow worker's stdin"
