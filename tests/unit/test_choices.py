"""``execution``, ``job_kind`` and ``on_finish_action`` as str enums or strings (core/choices.py): either spelling is
the same argument, the operator keeps the plain string, and KubernetesPodOperator's finish actions mean ours."""

from __future__ import annotations

import pickle

import pytest

from airflow_provider_torchelastic import (
    Elastic,
    Execution,
    OnFinishAction,
    TorchElasticOperator,
    TrainingJobKind,
)
from airflow_provider_torchelastic.core import choices
from airflow_provider_torchelastic.kubernetes import kinds, status
from airflow_provider_torchelastic.settings import EXECUTIONS


def train() -> int:
    return 1


def operator(**kwargs: object) -> TorchElasticOperator:
    return TorchElasticOperator(task_id="train", python_callable=train, execution="local", **kwargs)  # type: ignore[arg-type]


def test_the_enums_are_the_tables_the_checks_use() -> None:
    assert EXECUTIONS == tuple(Execution) == ("kubernetes", "local")
    assert kinds.JOB_KIND_CHOICES == tuple(TrainingJobKind) == ("auto", "pytorchjob", "trainjob")
    assert status.FINISH_ACTIONS == tuple(OnFinishAction) == ("delete_succeeded", "delete", "keep")


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (OnFinishAction.KEEP, "keep"),
        ("delete", "delete"),
        ("delete_succeeded_pod", "delete_succeeded"),
        ("delete_pod", "delete"),
        ("keep_pod", "keep"),
    ],
)
def test_on_finish_action_takes_the_enum_and_kubernetes_pod_operators_spellings(given: str, kept: str) -> None:
    op = operator(on_finish_action=given)
    assert op.on_finish_action == kept
    assert type(op.on_finish_action) is str  # what a serialized DAG and the trigger's kwargs carry


def test_on_finish_action_takes_kubernetes_pod_operators_own_enum() -> None:
    from airflow.providers.cncf.kubernetes.utils.pod_manager import OnFinishAction as PodOperatorFinishAction

    assert operator(on_finish_action=PodOperatorFinishAction.DELETE_POD).on_finish_action == "delete"


def test_execution_and_job_kind_take_the_enums_and_keep_the_string() -> None:
    op = TorchElasticOperator(
        task_id="train",
        python_callable=train,
        execution=Execution.LOCAL,
        job_kind=TrainingJobKind.PYTORCHJOB,
        task_config=Elastic(nnodes=2),
    )
    assert (op.execution, op.job_kind) == ("local", "pytorchjob")
    assert type(op.execution) is str and type(op.job_kind) is str


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        (
            {"on_finish_action": "delete_always"},
            ValueError,
            r"on_finish_action: expected one of 'delete_succeeded', 'delete', 'keep' \(an OnFinishAction\), or "
            r"KubernetesPodOperator's 'delete_succeeded_pod', 'delete_pod', 'keep_pod', got 'delete_always'",
        ),
        ({"on_finish_action": True}, TypeError, r"on_finish_action: expected one of .*, got True"),
        ({"job_kind": "tfjob"}, ValueError, r"job_kind: expected one of 'auto', 'pytorchjob', 'trainjob'.*'tfjob'"),
        ({"execution": "cloud"}, ValueError, r"execution: expected 'kubernetes' or 'local'.*got 'cloud'"),
    ],
    ids=["finish-action", "finish-action-type", "job-kind", "execution"],
)
def test_a_bad_choice_names_the_field_the_value_and_the_choices(kwargs: dict, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        TorchElasticOperator(task_id="train", python_callable=train, **kwargs)


def test_the_enums_show_and_pickle_by_the_root() -> None:
    for enum in (Execution, TrainingJobKind, OnFinishAction):
        assert enum.__module__ == choices.PUBLIC_MODULE
    assert pickle.loads(pickle.dumps(OnFinishAction.KEEP)) is OnFinishAction.KEEP
    assert f"{Execution.LOCAL}" == "local"  # formats as its value, as a str does
