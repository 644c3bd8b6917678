"""DAGs for tests/e2e/test_programs.py: torchrun-style programs (tests/programs) as tasks, run locally by
``dag.test()`` (issue 32). The test puts tests/programs on PYTHONPATH, as an image would install the team's code."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from tests.dag_support import record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")
SCRIPT = str(Path(__file__).parents[1] / "programs" / "team" / "train.py")
TWO_WORKERS = Elastic(nproc_per_node=2, monitor_interval=0.1)

with DAG(
    "te_programs",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={
        "retries": 1,
        "retry_delay": timedelta(0),
        "on_failure_callback": record_failure,
        "on_retry_callback": record_failure,
    },
):
    # `torchrun -m team.train recoverable-on-try-1 --steps 2 --try-number N`: retried, then its set_result value.
    TorchElasticOperator(
        task_id="module",
        module="team.train",
        args=["recoverable-on-try-1", "--steps", "2", "--try-number", "{{ ti.try_number }}"],
        task_config=TWO_WORKERS,
        execution="local",
    )
    # `torchrun train.py fail`: rank 1's ValueError, permanent.
    TorchElasticOperator(
        task_id="script",
        script=SCRIPT,
        args=["fail"],
        task_config=Elastic(nproc_per_node=2, start_method="fork", monitor_interval=0.1),
        execution="local",
    )
