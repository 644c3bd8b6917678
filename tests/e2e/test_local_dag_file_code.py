"""DAG-file code with ``from __future__ import annotations`` through ``dag.test()``, locally: dataclasses and an enum
of tests/dags/future_annotations_dag.py, declared beside and inside the training function, in real workers.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_local_execution import run_dag

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("airflow_db")]


def test_dataclasses_and_enums_of_a_future_annotations_dag_file() -> None:
    result = run_dag("te_future_annotations")
    assert result.state == "success", result
    assert result.tasks == {("train", -1): ("success", 1)}
    assert result.xcom() == {
        "gathered": [[0, "train", 0.5], [1, "eval", 1.0]],
        "same_classes": True,
        "config_fields": ["lr", "milestones"],
        "milestones": [10, 20],
        "metrics_hints": ["loss", "rank", "schema", "split"],
        "module": True,
    }
