"""DAGs for the training-metrics end-to-end tests (tests/e2e/test_metrics_e2e.py): ``report()`` in real workers,
progress lines in the task log, and the job summary XCom ``torch_elastic_job`` (local execution and the local
cluster's sync wait)."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, Master, PyTorch, TorchElasticOperator, Worker
from tests.dag_support import pod_image

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def train_and_report(steps: int, seconds_per_step: float, fail_rank: int = -1) -> dict:
    """Reports a falling loss every step (only rank 0's count); ``fail_rank`` raises after the last step."""
    import os
    import time

    from airflow_provider_torchelastic import report

    rank = int(os.environ["RANK"])
    for step in range(steps):
        report(step=step, loss=round(1.0 / (step + 1), 6), accuracy=round(step / steps, 6))
        time.sleep(seconds_per_step)
    if rank == fail_rank:
        raise ValueError(f"rank {rank} diverged after {steps} steps")
    print(f"rank {rank} trained {steps} steps", flush=True)
    return {"rank": rank, "steps": steps}


def _dag(dag_id: str) -> DAG:
    args = {"retries": 0, "retry_delay": timedelta(0), "execution_timeout": timedelta(minutes=4)}
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args=args)


# Local: two nodes of one worker each succeed; one node of two workers fails on rank 1 after reporting (one node:
# its agent stops the sibling at once, where a second node would first wait out its peers' grace).
with _dag("te_metrics_local"):
    TorchElasticOperator(
        task_id="train",
        python_callable=train_and_report,
        op_kwargs={"steps": 40, "seconds_per_step": 0.05},
        task_config=Elastic(nnodes=2, nproc_per_node=1, monitor_interval=0.5),
        execution="local",
    )
    TorchElasticOperator(
        task_id="train_fails",
        python_callable=train_and_report,
        op_kwargs={"steps": 5, "seconds_per_step": 0.0, "fail_rank": 1},
        task_config=Elastic(nnodes=1, nproc_per_node=2, monitor_interval=0.5),
        execution="local",
    )

# Kubernetes: a Master and a Worker (static ranks 0 and 1), waited for in the worker, and in the trigger (whose tap
# sends what it kept to execute_complete in the event).
for _dag_id, _deferrable in (("k8s_metrics_sync", False), ("k8s_metrics_deferred", True)):
    with _dag(_dag_id):
        TorchElasticOperator(
            task_id="train",
            python_callable=train_and_report,
            op_kwargs={"steps": 30, "seconds_per_step": 0.1},
            task_config=PyTorch(master=Master(), worker=Worker(replicas=1), nproc_per_node=1),
            image=pod_image(),
            execution="kubernetes",
            deferrable=_deferrable,
            poll_interval=1,
            pending_grace_seconds=5,
        )
