"""DAGs for tests/e2e/test_exits.py: ``exit()`` in a training function, through ``dag.test()`` (issue 32)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from tests.dag_support import record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def exit_on_every_rank() -> dict:
    print("done early: nothing to train", flush=True)
    exit()
    return {"unreachable": True}  # pragma: no cover


def usage_error_on_rank_1() -> None:
    import os
    import sys

    if os.environ["RANK"] == "1":
        sys.exit(2)


with DAG(
    "te_exits",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={"retries": 2, "on_failure_callback": record_failure},
):
    # exit() is a return of None: the task succeeds with rank 0's None.
    TorchElasticOperator(
        task_id="exit_everywhere",
        python_callable=exit_on_every_rank,
        task_config=Elastic(nproc_per_node=2, start_method="fork", monitor_interval=0.1),
        execution="local",
    )
    # sys.exit(2) is the user's code failing: permanent, named SystemExit with its code and traceback.
    TorchElasticOperator(
        task_id="exit_2",
        python_callable=usage_error_on_rank_1,
        task_config=Elastic(nproc_per_node=2, start_method="spawn", monitor_interval=0.1),
        execution="local",
    )
