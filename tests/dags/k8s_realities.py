"""DAGs for tests/e2e/test_cluster_realities.py: waiting for capacity, Kueue queueing and preemption, elastic jobs
on fewer nodes than they asked for. The tests play the cluster (and Kueue) by patching the job while it waits."""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.pod import JobOptions, PodOptions
from tests.dag_support import record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")
FAST = {"image": "local/torchelastic-runner:test", "execution": "kubernetes", "poll_interval": 1}
QUEUE = {"kueue.x-k8s.io/queue-name": "gpu-queue"}


def _dag(dag_id: str, **default_args: object) -> DAG:
    args = {
        "retries": 0,
        "retry_delay": timedelta(0),
        "on_failure_callback": record_failure,
        "execution_timeout": timedelta(minutes=4),
        **default_args,
    }
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args=args)


def started_at(seconds: float) -> dict:
    """When this run's rank 0 started, so that a test can tell a resumed run from the preempted one."""
    import time

    start = time.time()
    time.sleep(seconds)
    return {"started": start, "world_size": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"])}


def elastic(**overrides: object) -> Elastic:
    values: dict = {"nproc_per_node": 1, "monitor_interval": 0.5}
    values.update(overrides)
    return Elastic(**values)


# No node fits the pod: it waits for capacity (not failed at pending_grace_seconds) until scheduling_timeout.
with _dag("k8s_unschedulable"):
    TorchElasticOperator(
        task_id="train",
        python_callable=started_at,
        op_kwargs={"seconds": 0},
        task_config=elastic(),
        deferrable=False,
        pending_grace_seconds=1,
        scheduling_timeout=6,
        pod_options=PodOptions(annotations={"sim.torchelastic.dev/fail": "Unschedulable"}),
        **FAST,
    )

# Created suspended in a Kueue queue: waits as queued until the test (playing Kueue) admits it. Neither
# scheduling_timeout nor execution_timeout: the task warns at submit that it may wait forever.
with _dag("k8s_queued"):
    TorchElasticOperator(
        task_id="train",
        python_callable=started_at,
        op_kwargs={"seconds": 0},
        task_config=elastic(nnodes=2),
        deferrable=True,
        execution_timeout=None,
        pending_grace_seconds=1,
        job_options=JobOptions(suspend=True),
        pod_options=PodOptions(labels=QUEUE),
        **FAST,
    )

# Queued and never admitted: fails as recoverable after scheduling_timeout, naming the queue.
with _dag("k8s_never_admitted"):
    TorchElasticOperator(
        task_id="train",
        python_callable=started_at,
        op_kwargs={"seconds": 0},
        task_config=elastic(nnodes=2),
        deferrable=False,
        scheduling_timeout=4,
        job_options=JobOptions(suspend=True),
        pod_options=PodOptions(labels=QUEUE),
        **FAST,
    )

# Preempted while running (suspended: its pods are deleted), then resumed: the resumed run's result counts.
with _dag("k8s_preempted"):
    TorchElasticOperator(
        task_id="train",
        python_callable=started_at,
        op_kwargs={"seconds": 6},
        task_config=elastic(nnodes=2),
        deferrable=True,
        pod_options=PodOptions(labels=QUEUE),
        **FAST,
    )

# An elastic job asking for 2 nodes gets 1 (worker-1 never schedules): it runs and ends on what it got.
with _dag("k8s_partial_capacity"):
    TorchElasticOperator(
        task_id="train",
        python_callable=started_at,
        op_kwargs={"seconds": 0},
        # A short last call: the rendezvous closes soon after the minimum joined instead of waiting 30 s for more.
        task_config=elastic(nnodes="1:2", rdzv_configs={"last_call_timeout": 1}),
        deferrable=True,
        pending_grace_seconds=1,
        scheduling_timeout=5,
        pod_options=PodOptions(
            annotations={"sim.torchelastic.dev/fail": "Unschedulable", "sim.torchelastic.dev/fail-indexes": "1"}
        ),
        **FAST,
    )

# A PyTorchJob whose worker pods never fit (no GPU node): recoverable after scheduling_timeout, naming a pod.
with _dag("k8s_job_unschedulable"):
    TorchElasticOperator(
        task_id="train",
        python_callable=started_at,
        op_kwargs={"seconds": 0},
        task_config=elastic(nnodes=2),
        deferrable=True,
        pending_grace_seconds=1,
        scheduling_timeout=4,
        pod_options=PodOptions(annotations={"sim.torchelastic.dev/fail": "Unschedulable"}),
        **FAST,
    )

# An elastic job whose worker-0 never schedules: only worker-0 can host the c10d store (every PET_RDZV_ENDPOINT names
# it), so worker-1 running alone cannot start; the task waits for capacity and fails as recoverable after
# scheduling_timeout, although min (1) pods run.
with _dag("k8s_rdzv_host_unschedulable"):
    TorchElasticOperator(
        task_id="train",
        python_callable=started_at,
        op_kwargs={"seconds": 0},
        task_config=elastic(nnodes="1:2", rdzv_configs={"last_call_timeout": 1}),
        deferrable=True,
        pending_grace_seconds=1,
        scheduling_timeout=6,
        pod_options=PodOptions(
            annotations={"sim.torchelastic.dev/fail": "Unschedulable", "sim.torchelastic.dev/fail-indexes": "0"}
        ),
        **FAST,
    )
