"""DAGs for tests/e2e/test_cluster_says_no.py: more memory after an OOM (``retry_resources``) and the Kueue limits
(``max_preemptions``, an admitted Workload whose job stays suspended). The tests play the kubelet's OOM kill (a fault
annotation) and Kueue (patching ``suspend``, creating the Workload)."""

from __future__ import annotations

import os

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.core.naming import LABEL_RUN_ID
from airflow_provider_torchelastic.pod import JobOptions, PodOptions
from tests.dag_support import recording_dag

FAST = {"image": "local/torchelastic-runner:test", "execution": "kubernetes", "poll_interval": 1}
QUEUE = {"kueue.x-k8s.io/queue-name": "gpu-queue"}


def report(seconds: float) -> dict:
    import time

    time.sleep(seconds)
    return {"world_size": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"])}


def small(**overrides: object) -> Elastic:
    values: dict = {"nproc_per_node": 1, "monitor_interval": 0.5}
    values.update(overrides)
    return Elastic(**values)


# Both workers are OOM-killed on try 1 (once per DAG run: the retry's new pods are spared); with retry_resources=2.0
# try 2 runs with twice the memory on every replica, and succeeds.
with recording_dag("k8s_retry_memory", execution_timeout_minutes=4, retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=report,
        op_kwargs={"seconds": 1},
        task_config=small(nnodes=2),
        deferrable=True,
        retry_resources=2.0,
        pod_options=PodOptions(
            requests={"memory": "256Mi"},
            limits={"memory": "256Mi"},
            annotations={
                "sim.torchelastic.dev/fail": "OOMKilled",
                "sim.torchelastic.dev/fail-after-seconds": "1",
                "sim.torchelastic.dev/fail-times": "1",
                "sim.torchelastic.dev/fail-times-scope": LABEL_RUN_ID,
            },
        ),
        **FAST,
    )

# Preempted twice (suspended after it ran): with max_preemptions=2 the second preemption fails the try.
with recording_dag("k8s_max_preemptions", execution_timeout_minutes=4):
    TorchElasticOperator(
        task_id="train",
        python_callable=report,
        op_kwargs={"seconds": 120},
        task_config=small(nnodes=2),
        deferrable=True,
        max_preemptions=2,
        pod_options=PodOptions(labels=QUEUE),
        **FAST,
    )

# Queued (created suspended) and "admitted" by a Workload the test creates, yet never un-suspended (the version skew
# of kueue#11931): fails after pending_grace_seconds, naming the Workload, long before scheduling_timeout.
with recording_dag("k8s_admitted_but_suspended", execution_timeout_minutes=4):
    TorchElasticOperator(
        task_id="train",
        python_callable=report,
        op_kwargs={"seconds": 0},
        task_config=small(nnodes=2),
        deferrable=True,
        pending_grace_seconds=2,
        scheduling_timeout=120,
        job_options=JobOptions(suspend=True),
        pod_options=PodOptions(labels=QUEUE),
        **FAST,
    )
