"""DAGs for tests/deployment: parsed by a real dag-processor, run by a real scheduler, LocalExecutor and triggerer
(tests/airflow_services), on the real node (kubelet, scheduler, controller-manager, containerd) of the local test
cluster through the connection ``kubernetes_default``; every pod mounts the folder it shares with the deployment
(node_storage.py).

No ``image=``: the deployment's ``[torch_elastic] image`` gives it, as in production. Training functions are defined
here, so they travel by value in the payload (the pods have neither Airflow nor this repository). Keep them tiny and
the polls short: two cores run Airflow, the cluster, the node and every pod.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task
from node_storage import SHARED

from airflow_provider_torchelastic import Elastic, TorchElasticOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")
FAST = {
    "execution": "kubernetes",
    "poll_interval": 1,
    "pending_grace_seconds": 10,
    "deferrable": True,
    "pod_options": SHARED,
}
DEFAULT_ARGS = {"retries": 0, "execution_timeout": timedelta(minutes=4)}


def one_worker(nnodes: int | str) -> Elastic:
    return Elastic(nnodes=nnodes, nproc_per_node=1, monitor_interval=0.5)


def sleep_then_return(seconds: float, value: str) -> dict:
    import time

    time.sleep(seconds)
    return {"value": value, "rank": int(os.environ["RANK"])}


def sleep_on_the_first_try(value: str) -> dict:
    """Outlives the test on try 1 (whose task process is killed meanwhile); returns at once on the next."""
    import time

    from airflow_provider_torchelastic import context

    if context.current().try_number == 1:
        time.sleep(300)
    return {"value": value, "rank": int(os.environ["RANK"])}


# (a) An elastic 2-node PyTorchJob, waited for by the triggerer; rank 0's result becomes the XCom.
with DAG("deploy_elastic", schedule=None, start_date=START, catchup=False, default_args=DEFAULT_ARGS):

    @task.torch_elastic(task_config=one_worker("2:2"), **FAST)
    def train(offset: float) -> dict:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        value = torch.tensor([dist.get_rank() + offset])
        dist.all_reduce(value)
        result = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": value.item()}
        dist.destroy_process_group()
        return result

    train(1.0)

# (b) Marked failed by a user while deferred: the triggerer's on_kill deletes the PyTorchJob.
with DAG("deploy_mark_failed", schedule=None, start_date=START, catchup=False, default_args=DEFAULT_ARGS):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 300, "value": "never"},
        task_config=one_worker("2:2"),
        # The deletion is what is tested, not the graceful stop: a function that never checks stop_requested()
        # would otherwise keep its pods for the default 120 s grace period.
        termination_grace_period=10,
        **FAST,
    )

# (c) The triggerer is killed, or stopped, while the job runs; kept, so that the test can count the try's jobs.
with DAG("deploy_triggerer_restart", schedule=None, start_date=START, catchup=False, default_args=DEFAULT_ARGS):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        # Outlives the old triggerer's stop, the new one's start and its taking the trigger over: 25 s did not, once,
        # on the loaded 2-core node of a CI run (the takeover waits for the old heartbeat to go stale).
        op_kwargs={"seconds": 60, "value": "survived a triggerer restart"},
        task_config=one_worker(1),
        on_finish_action="keep",
        **FAST,
    )

# (d) Try 1's task process is killed while it waits for its pod in the worker (not deferred, so that there is a
# process to kill): nothing of try 1 is left to delete the pod, and try 2, which the scheduler starts (retries=1),
# must delete it before creating its own. Kept, so that the test can count each try's pods.
with DAG(
    "deploy_next_try_cleanup",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={**DEFAULT_ARGS, "retries": 1, "retry_delay": timedelta(0)},
):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_on_the_first_try,
        op_kwargs={"value": "try 2"},
        task_config=one_worker(1),
        on_finish_action="keep",
        # Try 2 deletes a pod whose function never checks stop_requested(): without this it would keep running
        # for the default 120 s grace period.
        termination_grace_period=10,
        **{**FAST, "deferrable": False},
    )
