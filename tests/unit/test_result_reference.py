"""The result reference comes from the pod: only the location this try's result belongs at is ever read, and no more
than ``[torch_elastic] result_storage_max_bytes`` of it (issue 19, item 3)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.core.run_context import TaskContext, result_location
from airflow_provider_torchelastic.operators import results
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
from airflow_provider_torchelastic.settings import ResultStorage

LOG = logging.getLogger(__name__)
TRY_2 = TaskContext(dag_id="d", task_id="t", run_id="manual__1", try_number=2)


def storage(root: Path, **kwargs: Any) -> ResultStorage:
    return ResultStorage(url=str(root), conn_id=None, keep=False, **kwargs)


def write(path: str, value: Any) -> Path:
    file = Path(path.removeprefix("file://"))
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(value))
    return file


def result_of(ref: str, store: ResultStorage | None, task_context: TaskContext | None = TRY_2) -> Any:
    verdict = Verdict(succeeded=True, result_ref=ref)
    return results.result_or_raise(LOG, verdict, store, task_context=task_context)


def test_the_location_of_this_try_is_read_and_then_deleted(tmp_path: Path) -> None:
    store = storage(tmp_path / "results")
    file = write(result_location(store.url, TRY_2), {"loss": 0.5})
    assert result_of(result_location(store.url, TRY_2), store) == {"loss": 0.5}
    assert not file.exists()


@pytest.mark.parametrize(
    "ref",
    ["/etc/hostname", "file:///etc/hostname", "http://169.254.169.254/latest/meta-data/iam/", "s3://other/result.json"],
)
def test_a_reference_elsewhere_fails_naming_it_and_the_expected_location(tmp_path: Path, ref: str) -> None:
    store = storage(tmp_path / "results")
    with pytest.raises(ConfigurationError) as caught:
        result_of(ref, store)
    message = str(caught.value)
    assert ref in message and result_location(store.url, TRY_2) in message and "retry will not help" in message


def test_a_file_on_the_worker_is_never_opened_nor_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"key": "value"}')

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read_stored_result must not be called")

    monkeypatch.setattr(results, "read_stored_result", never)
    with pytest.raises(ConfigurationError):
        result_of(str(secret), storage(tmp_path / "results"))
    assert secret.read_text() == '{"key": "value"}'


def test_another_tries_result_is_refused_and_left_in_place(tmp_path: Path) -> None:
    store = storage(tmp_path / "results")
    other = result_location(store.url, TaskContext(dag_id="d", task_id="t", run_id="manual__1", try_number=1))
    file = write(other, {"loss": 9.0})
    with pytest.raises(ConfigurationError, match="not where this try's result belongs"):
        result_of(other, store)
    assert file.exists()


def test_without_result_storage_or_the_tries_context_no_reference_is_accepted(tmp_path: Path) -> None:
    store = storage(tmp_path / "results")
    ref = result_location(store.url, TRY_2)
    file = write(ref, 1)
    with pytest.raises(ConfigurationError, match="no \\[torch_elastic\\] result_storage"):
        result_of(ref, None)
    with pytest.raises(ConfigurationError):
        result_of(ref, store, task_context=None)
    assert file.exists()


def test_a_result_larger_than_the_bound_fails_saying_so(tmp_path: Path) -> None:
    store = storage(tmp_path / "results", max_bytes=10)
    ref = result_location(store.url, TRY_2)
    write(ref, "x" * 100)
    with pytest.raises(ConfigurationError, match=r"result_storage_max_bytes \(10 bytes\)"):
        result_of(ref, store)
    write(ref, "x" * 5)  # 7 bytes of JSON: within the bound
    assert result_of(ref, store) == "xxxxx"


def test_the_bound_is_an_option_with_a_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_torchelastic.settings import DEFAULT_RESULT_MAX_BYTES, Settings

    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE", str(tmp_path))
    read = Settings.read(execution="local", deferrable=False).result_storage
    assert read is not None and read.max_bytes == DEFAULT_RESULT_MAX_BYTES == 1 << 30
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE_MAX_BYTES", "2048")
    read = Settings.read(execution="local", deferrable=False).result_storage
    assert read is not None and read.max_bytes == 2048
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE_MAX_BYTES", "many")
    with pytest.raises(AirflowFailException, match="AIRFLOW__TORCH_ELASTIC__RESULT_STORAGE_MAX_BYTES"):
        Settings.read(execution="local", deferrable=False)
