"""DAGs for the ownership tests on the local cluster (tests/e2e/test_ownership.py): objects that are not this try's
(a pod with the job's labels, a payload ConfigMap created before the task) must not become its input or its result.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from tests.dag_support import record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")
FAST = {"image": "local/torchelastic-runner:test", "execution": "kubernetes", "poll_interval": 1}


def sleep_then_return(seconds: float, value: str) -> dict:
    import os
    import time

    time.sleep(seconds)
    return {"value": value, "rank": int(os.environ["RANK"])}


def return_once_released(flag: str, value: str) -> dict:
    """Wait (at most 60 s) until the test creates ``flag``: the pods run on the test's machine (the simulated
    kubelet), so a file is the test's way to say that what it does during the run is done."""
    import os
    import time
    from pathlib import Path

    deadline = time.monotonic() + 60
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"value": value, "rank": int(os.environ["RANK"])}


def _dag(dag_id: str) -> DAG:
    args = {"retries": 0, "on_failure_callback": record_failure, "execution_timeout": timedelta(minutes=2)}
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args=args)


# A PyTorchJob of two nodes that runs until the test has added a foreign pod with its labels.
with _dag("k8s_foreign_pod"):
    TorchElasticOperator(
        task_id="train",
        python_callable=return_once_released,
        # Set by the test (its failure_dir fixture) where the DAG is parsed.
        op_kwargs={
            "flag": f"{os.environ.get('TORCHELASTIC_E2E_OUT', '/nonexistent')}/release",
            "value": "the job's own",
        },
        task_config=Elastic(nnodes=2, nproc_per_node=1, monitor_interval=0.5),
        deferrable=False,
        **FAST,
    )

# One pod, whose payload ConfigMap name the test takes first.
with _dag("k8s_squatted_payload"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 0, "value": "the real payload"},
        task_config=Elastic(nproc_per_node=1, monitor_interval=0.5),
        deferrable=False,
        **FAST,
    )
