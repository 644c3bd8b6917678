"""Issue 23 on Kubernetes, without a cluster: result storage defaults to artifact storage (a value whose artifact
references outgrow the termination message still arrives), and a dry run of a task whose arguments are over the
payload's limit writes nothing and says where a run would spill them."""

from __future__ import annotations

import base64
import datetime
import json
import warnings
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.core.naming import PLACEHOLDER_RUN_ID
from airflow_provider_torchelastic.core.payload import ARGUMENTS_REF_KEY, read_header
from airflow_provider_torchelastic.operators.spill import MAX_PAYLOAD_BYTES
from airflow_provider_torchelastic.settings import Settings

ENV = "AIRFLOW__TORCH_ELASTIC__"


@pytest.fixture(autouse=True)
def no_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in ("RESULT_STORAGE", "RESULT_STORAGE_CONN_ID", "ARTIFACT_STORAGE", "ARTIFACT_STORAGE_CONN_ID"):
        monkeypatch.delenv(ENV + option, raising=False)


def read() -> Settings:
    return Settings.read(execution="local", deferrable=False)


# --- result storage defaults to artifact storage ---------------------------------------------------------------------


def test_result_storage_defaults_to_artifact_storage_and_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE", "s3://ml/artifacts")
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE_CONN_ID", "artifacts_s3")
    results = read().result_storage
    assert results is not None
    assert (results.url, results.conn_id, results.keep) == ("s3://ml/artifacts", "artifacts_s3", False)


def test_the_default_connection_is_the_artifact_storages_own_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # artifact_storage_conn_id unset: artifact storage uses result_storage_conn_id, and so do results.
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE", "s3://ml/artifacts")
    monkeypatch.setenv(ENV + "RESULT_STORAGE_CONN_ID", "shared")
    settings = read()
    assert settings.artifact_storage is not None and settings.artifact_storage.conn_id == "shared"
    assert settings.result_storage is not None and settings.result_storage.conn_id == "shared"


def test_result_storage_set_keeps_its_own_url_and_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE", "s3://ml/artifacts")
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE_CONN_ID", "artifacts_s3")
    monkeypatch.setenv(ENV + "RESULT_STORAGE", "s3://ml/results")
    results = read().result_storage
    assert results is not None and (results.url, results.conn_id) == ("s3://ml/results", None)


def test_neither_storage_means_none() -> None:
    settings = read()
    assert settings.result_storage is None and settings.artifact_storage is None


def make_operator(*op_args: Any) -> TorchElasticOperator:
    with DAG("storage_dag", schedule=None, start_date=datetime.datetime(2026, 1, 1)):
        return TorchElasticOperator(
            task_id="train",
            python_callable=len,
            op_args=list(op_args),
            task_config=Elastic(nproc_per_node=1),
            image="registry.example.com/train:1",
        )


def runner_command(manifests: list[dict[str, Any]]) -> list[str]:
    return list(manifests[1]["spec"]["containers"][0]["command"])


def test_with_artifact_storage_alone_rank_0_gets_a_result_location(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pod's runner writes a value too large for its termination message there instead of failing.
    assert "--result-url" not in runner_command(make_operator(1).render_manifests())
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE", "s3://ml/artifacts")
    command = runner_command(make_operator(1).render_manifests())
    url = command[command.index("--result-url") + 1]
    assert url == f"s3://ml/artifacts/storage_dag/{PLACEHOLDER_RUN_ID}/train/-1/1/result.json"


# --- a dry run with arguments over the payload's limit ----------------------------------------------------------------


def payload_body(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    payload = base64.b64decode(manifests[0]["data"]["payload"])
    _, pickled = read_header(payload)
    return dict(cloudpickle.loads(pickled))


def test_a_dry_run_spills_into_nothing_and_names_what_a_run_would_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE", f"file://{store}")
    big = b"x" * (MAX_PAYLOAD_BYTES + 1)
    array = np.arange(300_000, dtype=np.float64)  # 2.4 MB: a safetensors file of its own
    with pytest.warns(UserWarning, match="spills them under") as caught:
        manifests = make_operator(big, array).render_manifests()
    location = f"file://{store}/storage_dag/{PLACEHOLDER_RUN_ID}/train/-1/1/artifacts/arguments"
    message = str(caught[0].message)
    assert f"{location}/" in message and "wrote nothing" in message
    assert f"{location}/0000-args.1.safetensors" in message and f"{location}/arguments.pkl" in message
    assert caught[0].filename == __file__, "the warning points at the caller of render_manifests"
    assert not store.exists(), "a dry run writes no storage"
    # What is rendered is what a run would submit: a payload that fits, referring to the spilled pickle.
    assert len(base64.b64decode(manifests[0]["data"]["payload"])) < 100_000
    body = payload_body(manifests)
    assert body["args"] == () and body["kwargs"] == {}
    ref = json.loads(json.dumps(body[ARGUMENTS_REF_KEY]))
    assert ref["url"] == f"{location}/arguments.pkl" and ref["kind"] == "arguments" and len(ref["sha256"]) == 64


def test_a_dry_run_over_the_limit_without_artifact_storage_names_the_option() -> None:
    with pytest.raises(ValueError, match=r"set \[torch_elastic\] artifact_storage .*AIRFLOW__TORCH_ELASTIC__ARTIFACT"):
        make_operator(b"x" * (MAX_PAYLOAD_BYTES + 1)).render_manifests()


def test_a_dry_run_under_the_limit_spills_nothing_and_says_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV + "ARTIFACT_STORAGE", f"file://{tmp_path}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manifests = make_operator(b"x" * 1000).render_manifests()
    assert payload_body(manifests)["args"] == (b"x" * 1000,)
    assert list(tmp_path.iterdir()) == []
