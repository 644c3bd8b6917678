"""DAGs for the browser tests (tests/ui): training that reports metrics, and training that fails, on the real node of
the local cluster. Both wait in the worker (deferrable=False), whose wait turns rank 0's metrics lines into the job
summary.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task
from node_storage import SHARED

from airflow_provider_torchelastic import Elastic

START = pendulum.datetime(2026, 1, 1, tz="UTC")
SETTINGS = {
    "execution": "kubernetes",
    "poll_interval": 1,
    "pending_grace_seconds": 10,
    "deferrable": False,
    "pod_options": SHARED,
}
DEFAULT_ARGS = {"retries": 0, "execution_timeout": timedelta(minutes=4)}
#: Steps the reporting job reports; the browser test counts them in the charts.
STEPS = 12
#: Elements of the tensor ui_metrics returns: an artifact the tab lists.
WEIGHTS = 1000

with DAG("ui_metrics", schedule=None, start_date=START, catchup=False, default_args=DEFAULT_ARGS):

    @task.torch_elastic(task_config=Elastic(nnodes="2:2", nproc_per_node=1, monitor_interval=0.5), **SETTINGS)
    def train(steps: int, hold_seconds: float) -> dict:
        import math
        import os
        import time

        # One metrics line per report() (15 s apart by default), so that the page sees the run's points while it runs.
        os.environ["TORCHELASTIC_REPORT_INTERVAL"] = "0"
        from airflow_provider_torchelastic import report

        for step in range(1, steps + 1):
            report(step=step, loss=2.0 * math.exp(-step / 4) + 0.05, accuracy=1 - math.exp(-step / 3))
        time.sleep(hold_seconds)  # long enough for the page to show the job running, from Kubernetes
        import torch

        # A tensor in rank 0's value travels as an artifact; the tab lists it (WEIGHTS float32 elements).
        return {"steps": steps, "weights": torch.ones(WEIGHTS)}

    @task
    def publish(result: dict) -> int:
        return int(result["steps"])

    publish(train(STEPS, 25.0))

with DAG("ui_failure", schedule=None, start_date=START, catchup=False, default_args=DEFAULT_ARGS):

    @task.torch_elastic(task_config=Elastic(nnodes="2:2", nproc_per_node=1, monitor_interval=0.5), **SETTINGS)
    def train_diverges() -> None:
        import os
        import time

        os.environ["TORCHELASTIC_REPORT_INTERVAL"] = "0"
        from airflow_provider_torchelastic import report

        if os.environ["RANK"] == "1":
            time.sleep(4)
            raise FloatingPointError("loss diverged to nan at step 6")
        for step in range(1, 6):
            report(step=step, loss=1.0 + step * 0.4, accuracy=0.5 - step * 0.05)
        time.sleep(60)  # rank 0 is stopped when rank 1 fails the job

    train_diverges()
