"""retry_policy rules written against the provider's failure classes act as written (issue 31), in a real
``dag.test()`` with local execution: what Airflow's task runner does with each cause, read back from the task
instance's history (its tries, when each ended and began, the reason the rule gave)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_local_execution import failure_dir, run_dag  # noqa: F401  (failure_dir is a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]


def history(dag_id: str, task_id: str = "train") -> list[dict[str, Any]]:
    """Every try of a task of the DAG's (last) run, oldest first: the ended ones (TaskInstanceHistory), then the
    last."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = [
            *session.scalars(
                select(TaskInstanceHistory)
                .where(TaskInstanceHistory.dag_id == dag_id, TaskInstanceHistory.task_id == task_id)
                .order_by(TaskInstanceHistory.try_number)
            ),
            *session.scalars(
                select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id)
            ),
        ]
        return [
            {
                "try": row.try_number,
                "state": str(row.state),
                "start": row.start_date,
                "end": row.end_date,
                "retry_reason": getattr(row, "retry_reason", None),
            }
            for row in rows
        ]


def first_error(failure_dir: Path, dag_id: str) -> str:  # noqa: F811
    return (failure_dir / f"{dag_id}.train.try1.txt").read_text()


def test_a_rule_naming_the_users_value_error_retries_it_after_its_own_delay(failure_dir: Path) -> None:  # noqa: F811
    dag_id = "te_policy_user_value_error"
    result = run_dag(dag_id, folder=Path(__file__).parents[1] / "dags")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}
    assert result.xcom() == {"try_number": 2}
    error = first_error(failure_dir, dag_id)
    # The class Airflow's rule matched, and what it carries of the worker's exception.
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    assert "rank 1" in error and "ValueError: shard 7 is empty on try 1" in error
    tries = history(dag_id)
    assert [t["try"] for t in tries] == [1, 2], tries
    assert tries[0]["retry_reason"] == "an empty shard: retry it", tries
    # The rule's 2 s, not the task's 10 minutes.
    gap = (tries[1]["start"] - tries[0]["end"]).total_seconds()
    assert 2 <= gap < 120, tries


def test_a_rule_retries_a_permanent_cause(failure_dir: Path) -> None:  # noqa: F811
    dag_id = "te_policy_retries_a_permanent_cause"
    result = run_dag(dag_id, folder=Path(__file__).parents[1] / "dags")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 2)}, "a ConfigurationError reached the policy"
    assert result.xcom() == "small"
    error = first_error(failure_dir, dag_id)
    assert error.startswith("airflow_provider_torchelastic.operators.ConfigurationError: "), error
    assert "more than the limit of 4096 bytes" in error
    tries = history(dag_id)
    assert (tries[1]["start"] - tries[0]["end"]).total_seconds() < 120, tries


def test_a_rule_fails_a_recoverable_user_error_at_the_first_try(failure_dir: Path) -> None:  # noqa: F811
    dag_id = "te_policy_fails_a_recoverable_cause"
    result = run_dag(dag_id, folder=Path(__file__).parents[1] / "dags")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "retries=3, but the rule said FAIL"
    error = first_error(failure_dir, dag_id)
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeRecoverableError: "), error
    assert "FlakyFeedError: the feed is down" in error
