"""The example DAG ``torch_elastic_models`` (init_model -> train(config, model) -> evaluate(model)) through
``dag.test()``, locally and on the local cluster (issue 23, item 5): a Module and a dataclass pass between the tasks,
the trained model is evaluated downstream, and the fixed outlet asset's event carries the try's model URL and sha256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_kubernetes import IMAGE, Cluster, clean_namespace, cluster  # noqa: F401 - fixtures
from tests.e2e.test_local_execution import EXAMPLE_DAGS, use_example_dags

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]

DAG_ID = "torch_elastic_models"
ASSET = "torchelastic-models/classifier"


@pytest.fixture
def example_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The example folder as a bundle, and artifact storage in a folder (the local cluster's pods share this
    machine's filesystem). Returns the storage's URL."""
    use_example_dags(monkeypatch)
    root = f"file://{tmp_path / 'artifacts'}"
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE", root)
    return root


def run_and_check(root: str) -> dict[str, Any]:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from tests.e2e.test_kubernetes import run_dag

    result = run_dag(DAG_ID, EXAMPLE_DAGS)
    assert result.state == "success", result
    first, trained, evaluated = result.xcom("init_model"), result.xcom("train"), result.xcom("evaluate")
    # The dataclass became a JSON object of its fields; the Modules became references under each try's location.
    assert first["config"] == {"epochs": 20, "lr": 0.05, "hidden": 32}
    assert first["model"]["kind"] == "module" and first["model"]["url"].startswith(f"{root}/{DAG_ID}/")
    assert trained["model"]["kind"] == "module" and "/train/" in trained["model"]["url"]
    assert "0.weight" in trained["model"]["tensors"], "the DDP wrapper is unwrapped"
    assert evaluated["accuracy"] > 0.8, evaluated  # chance is 0.25: the trained model reached evaluate
    assert evaluated["model_url"] == trained["model"]["url"]
    with create_session() as session:
        events = session.scalars(
            select(AssetEvent)
            .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.name == ASSET, AssetEvent.source_run_id == result.run_id)
        ).all()
        extras = [dict(event.extra) for event in events]
    assert extras == [{"model_url": trained["model"]["url"], "sha256": trained["model"]["sha256"]}], extras
    return result.xcoms


def test_the_models_example_runs_locally(example_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")
    run_and_check(example_bundle)


@pytest.mark.cluster
@pytest.mark.usefixtures("clean_namespace", "kubernetes_default_connection")
def test_the_models_example_runs_on_the_local_cluster(example_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "kubernetes")
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__IMAGE", IMAGE)  # the example names no image: the option gives it
    xcoms = run_and_check(example_bundle)
    assert xcoms[("train", -1, "job_kind")] == "Pod" and xcoms[("init_model", -1, "job_kind")] == "Pod"
