"""A DAG for tests/deployment/test_plugged_kind.py: one task whose config, ``nproc_per_node=3``, the test-only job kind
``FakeJob`` claims (tests/fake_kind.py, plugged into every process of the deployment through an entry point).

Nothing runs a FakeJob: the test plays its controller (it creates the job's pod and writes the statuses), so the
function is never called, and the result is what the test writes into the pod's termination message.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def never_called() -> None:
    raise AssertionError("a FakeJob's pods run nothing: the test reports the result itself")


with DAG(
    "deploy_plugged_kind",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={"retries": 0, "execution_timeout": timedelta(minutes=4)},
):
    TorchElasticOperator(
        task_id="train",
        python_callable=never_called,
        task_config=Elastic(nproc_per_node=3),
        execution="kubernetes",
        deferrable=True,
        poll_interval=1,
        pending_grace_seconds=10,
        on_finish_action="delete_succeeded",
    )
