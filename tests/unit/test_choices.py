"""``execution``, ``job_kind`` and ``on_finish_action`` as str enums or strings (core/choices.py): either spelling is
the same argument, the operator keeps the plain string, and KubernetesPodOperator's finish actions mean ours."""

from __future__ import annotations

import json
import pickle
from typing import Any

import cloudpickle
import pytest

from airflow_provider_torchelastic import (
    Elastic,
    Execution,
    OnFinishAction,
    TorchElasticOperator,
    TrainingJobKind,
)
from airflow_provider_torchelastic.core import public
from airflow_provider_torchelastic.kubernetes import kinds, wait_types
from airflow_provider_torchelastic.settings import EXECUTIONS


def train() -> int:
    return 1


def operator(**kwargs: object) -> TorchElasticOperator:
    return TorchElasticOperator(task_id="train", python_callable=train, execution="local", **kwargs)  # type: ignore[arg-type]


def test_the_enums_are_the_tables_the_checks_use() -> None:
    assert EXECUTIONS == tuple(Execution) == ("kubernetes", "local")
    assert kinds.JOB_KIND_CHOICES == tuple(TrainingJobKind) == ("auto", "pytorchjob", "trainjob")
    assert wait_types.FINISH_ACTIONS == tuple(OnFinishAction) == ("delete_succeeded", "delete", "keep")


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


def test_the_decorator_takes_the_enums_and_keeps_the_strings() -> None:
    from airflow.sdk import DAG, task

    with DAG("choices_decorated", schedule=None) as dag:

        @task.torch_elastic(execution=Execution.LOCAL, job_kind=TrainingJobKind.TRAINJOB, on_finish_action="keep_pod")
        def fit() -> int:
            return 1

        fit()
    op = dag.task_dict["fit"]
    assert isinstance(op, TorchElasticOperator)
    chosen = (op.execution, op.job_kind, op.on_finish_action)
    assert chosen == ("local", "trainjob", "keep")
    assert {type(value) for value in chosen} == {str}


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
        assert enum.__module__ == public.PUBLIC_MODULE
    assert pickle.loads(pickle.dumps(OnFinishAction.KEEP)) is OnFinishAction.KEEP
    assert f"{Execution.LOCAL}" == "local"  # formats as its value, as a str does
    # A payload pickles the enums by reference (cloudpickle), by the root's path, which the runner imports.
    assert pickle.loads(cloudpickle.dumps(TrainingJobKind.TRAINJOB)) is TrainingJobKind.TRAINJOB
    assert b"airflow_provider_torchelastic.core" not in cloudpickle.dumps(Execution)


# --- what Airflow stores: a serialized DAG is the same whichever spelling the DAG file used --------------------------


def _serialized(execution: str, job_kind: str, on_finish_action: str) -> str:
    """The DAG as the dag-processor writes it (JSON), with the three choices given to a task, to a mapped task's
    ``partial`` and in ``default_args``."""
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    choices = {"execution": execution, "job_kind": job_kind, "on_finish_action": on_finish_action}
    with DAG("choices", schedule=None, default_args=dict(choices)) as dag:
        TorchElasticOperator(
            task_id="train",
            python_callable=train,
            task_config=Elastic(nnodes=2),
            execution=execution,
            job_kind=job_kind,
            on_finish_action=on_finish_action,
        )
        TorchElasticOperator.partial(
            task_id="mapped", python_callable=train, task_config=Elastic(nnodes=2), **choices
        ).expand(op_args=[[1], [2]])
        TorchElasticOperator(task_id="defaults", python_callable=train, task_config=Elastic(nnodes=2))
    serialized = DagSerialization.to_dict(dag)
    rebuilt = DagSerialization.from_dict(serialized)
    assert set(rebuilt.task_dict) == {"train", "mapped", "defaults"}
    return json.dumps(serialized, sort_keys=True)


def test_a_dag_serializes_the_enums_exactly_as_their_strings() -> None:
    as_enums = _serialized(Execution.LOCAL, TrainingJobKind.PYTORCHJOB, OnFinishAction.KEEP)
    assert as_enums == _serialized("local", "pytorchjob", "keep")
    stored: dict[str, Any] = json.loads(as_enums)["dag"]
    mapped = next(task["__var"] for task in stored["tasks"] if task["__var"]["task_id"] == "mapped")
    assert {k: mapped["partial_kwargs"][k] for k in ("execution", "job_kind", "on_finish_action")} == {
        "execution": "local",
        "job_kind": "pytorchjob",
        "on_finish_action": "keep",
    }
    assert stored["default_args"]["__var"]["execution"] == "local"
