"""Choosing the kind of a multi-node task: ``job_kind=`` and ``[torch_elastic] job_kind`` (``auto``, ``pytorchjob``,
``trainjob``). A kind known while the DAG file is parsed is checked then; ``auto`` asks the cluster at submit
(API discovery, cached per connection)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from airflow.sdk import DAG, task

from airflow_provider_torchelastic import Elastic, Master, PyTorch, TorchElasticOperator, Worker
from airflow_provider_torchelastic.core.pod_options import PodOptions
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.operators.backends import kubernetes as on_kubernetes

IMAGE = "registry.example.com/ml/train:1"
OPTION = "AIRFLOW__TORCH_ELASTIC__JOB_KIND"


@pytest.fixture(autouse=True)
def _no_job_kind_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPTION, raising=False)
    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", raising=False)


def scale(x: int) -> int:
    return x * 2


def make(**kwargs: Any) -> TorchElasticOperator:
    with DAG("job_kind_dag", schedule=None, start_date=datetime.datetime(2026, 1, 1)):
        return TorchElasticOperator(task_id="train", python_callable=scale, op_args=[3], image=IMAGE, **kwargs)


def kind_of(op: TorchElasticOperator) -> str:
    return str(op.render_manifests()[1]["kind"])


def test_the_argument_and_the_option_choose_the_kind_that_render_manifests_shows() -> None:
    assert kind_of(make(task_config=Elastic(nnodes=2), job_kind="trainjob")) == "TrainJob"
    assert kind_of(make(task_config=Elastic(nnodes=2), job_kind="pytorchjob")) == "PyTorchJob"
    # auto is the cluster's to decide at submit; without a cluster the manifests show a PyTorchJob.
    assert kind_of(make(task_config=Elastic(nnodes=2))) == "PyTorchJob"
    # One node is a Pod whatever job_kind says.
    assert kind_of(make(task_config=Elastic(nnodes=1), job_kind="trainjob")) == "Pod"


def test_the_option_chooses_when_the_task_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPTION, "trainjob")
    assert kind_of(make(task_config=PyTorch(master=Master(), worker=Worker(replicas=1)))) == "TrainJob"
    assert kind_of(make(task_config=Elastic(nnodes=2), job_kind="pytorchjob")) == "PyTorchJob", "the task's own wins"


def test_what_a_trainjob_cannot_run_fails_the_parse_naming_the_field_and_where_the_kind_came_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match=r"Elastic\.nnodes: a TrainJob cannot take '1:4'.*\(job_kind='trainjob'\)"):
        make(task_config=Elastic(nnodes="1:4"), job_kind="trainjob")
    with pytest.raises(ValueError, match=r"PodOptions.env_from.*TrainJob"):
        make(
            task_config=Elastic(nnodes=2),
            job_kind="trainjob",
            pod_options=PodOptions(env_from=[{"secretRef": {"name": "creds"}}]),
        )
    monkeypatch.setenv(OPTION, "trainjob")
    with pytest.raises(ValueError, match=r"max_restarts.*\(\[torch_elastic\] job_kind='trainjob'\)"):
        make(task_config=Elastic(nnodes=2, max_restarts=3))
    # auto sends an elastic range to a PyTorchJob: no error.
    monkeypatch.setenv(OPTION, "auto")
    assert kind_of(make(task_config=Elastic(nnodes="1:4"))) == "PyTorchJob"


def test_a_bad_job_kind_is_a_parse_error_naming_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"job_kind: expected one of 'auto', 'pytorchjob', 'trainjob'.*got 'tfjob'"):
        make(task_config=Elastic(nnodes=2), job_kind="tfjob")
    with pytest.raises(TypeError, match="job_kind"):
        make(task_config=Elastic(nnodes=2), job_kind=2)
    monkeypatch.setenv(OPTION, "jobset")
    with pytest.raises(ValueError, match=rf"\[torch_elastic\] job_kind: .*got 'jobset' \(env {OPTION}\)"):
        make(task_config=Elastic(nnodes=2))


def test_the_decorator_takes_job_kind_too() -> None:
    with DAG("job_kind_decorated", schedule=None, start_date=datetime.datetime(2026, 1, 1)):

        @task.torch_elastic(task_config=Elastic(nnodes=2), image=IMAGE, job_kind="trainjob")
        def train() -> int:
            return 1

        with pytest.raises(ValueError, match="a TrainJob cannot take"):

            @task.torch_elastic(task_config=Elastic(nnodes="2:3"), image=IMAGE, job_kind="trainjob")
            def elastic() -> int:
                return 1

            elastic()
        op = train().operator
    assert op.render_manifests()[1]["kind"] == "TrainJob"


class Discovery:
    def __init__(self, *served: str, fail: bool = False) -> None:
        self.served, self.fail, self.asked = served, fail, 0

    def served_resources(self, group: str, version: str) -> list[str] | None:
        self.asked += 1
        if self.fail:
            raise KubeError(503, "ServiceUnavailable", "the API is down")
        return [plural for plural in self.served if plural]


def test_auto_asks_discovery_once_per_connection_and_kind_and_does_not_keep_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(on_kubernetes, "_served_cache", {})
    kube = Discovery("trainjobs", "pytorchjobs")
    config = Elastic(nnodes=2)
    for _ in range(3):
        kind, why = kinds.choose(config, "auto", lambda k: on_kubernetes._served(kube, "k8s", k))  # type: ignore[arg-type]
        assert kind is kinds.TRAINJOB and "serves TrainJob" in why
    assert kube.asked == 1, "cached per connection"
    other = Discovery("pytorchjobs")
    assert kinds.choose(config, "auto", lambda k: on_kubernetes._served(other, "other", k))[0] is kinds.PYTORCHJOB  # type: ignore[arg-type]
    down = Discovery(fail=True)
    for _ in range(2):
        assert kinds.choose(config, "auto", lambda k: on_kubernetes._served(down, "down", k))[0] is kinds.PYTORCHJOB  # type: ignore[arg-type]
    assert down.asked == 4, "a failed discovery is not cached: two kinds asked, twice"


def test_a_failed_list_of_a_custom_kind_is_passed_over_only_when_unserved_or_denied() -> None:
    trainjob, pod = kinds.get("TrainJob"), kinds.get("Pod")
    assert trainjob.unlisted_because(KubeError(404, "NotFound", "no such resource")) == kinds.NOT_SERVED
    assert trainjob.unlisted_because(KubeError(403, "Forbidden", "cannot list")) == kinds.DENIED
    assert trainjob.unlisted_because(KubeError(500, "InternalError", "etcd")) is None
    assert pod.unlisted_because(KubeError(403, "Forbidden", "cannot list pods")) is None, "pods are never optional"
