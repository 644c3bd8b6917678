"""DAGs for the Kubernetes end-to-end tests (tests/e2e/test_kubernetes.py on the simulated kubelet, and
test_kubernetes_on_node.py on the real node), run against the local test cluster.

On the real node the pods run the runner image (tests/dag_support.pod_image); the simulated kubelet runs each pod's
containers as local processes (the image is ignored, but the renderer needs one). Either way every run is real torch
elastic: keep workers few, functions tiny and polls short on a small machine.
The connection ``kubernetes_default`` is set by the test (``AIRFLOW_CONN_KUBERNETES_DEFAULT``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, Master, PyTorch, TorchElasticOperator, Worker
from airflow_provider_torchelastic.pod import PodOptions
from tests.dag_support import fail_on_rank_1, flaky_on_first_try, pod_image, record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")
#: Every Kubernetes task: fast polls, fast failure of stuck pods.
FAST = {"image": pod_image(), "execution": "kubernetes", "poll_interval": 1, "pending_grace_seconds": 5}


def small(**overrides: object) -> Elastic:
    # start_method stays "spawn" (the default): a worker forked from the multi-threaded agent can deadlock on a lock
    # held at fork time (seen here: a forked worker stuck on a futex, its peers waiting for it in gloo forever).
    values: dict = {"nproc_per_node": 1, "monitor_interval": 0.5}
    values.update(overrides)
    return Elastic(**values)


def all_reduce_ranks(offset: float = 0.0, sleep: float = 0.0) -> dict:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    result = {"rank": rank, "world_size": dist.get_world_size(), "sum": value.item()}
    dist.destroy_process_group()
    time.sleep(sleep)
    return result


def sleep_then_return(seconds: float, value: str) -> dict:
    import time

    time.sleep(seconds)
    return {"value": value, "rank": int(os.environ["RANK"])}


def _dag(dag_id: str, **default_args: object) -> DAG:
    args = {
        "retries": 0,
        "retry_delay": timedelta(0),
        "on_failure_callback": record_failure,
        # A hang fails the task (and deletes its job) instead of stalling the suite.
        "execution_timeout": timedelta(minutes=4),
        **default_args,
    }
    return DAG(dag_id, schedule=None, start_date=START, catchup=False, default_args=args)


# (a) one node -> a single Pod, waited for in the worker.
with _dag("k8s_single_pod"):
    TorchElasticOperator(
        task_id="train",
        python_callable=all_reduce_ranks,
        op_kwargs={"offset": 1.0},
        task_config=small(nnodes=1, nproc_per_node=2),
        deferrable=False,
        **FAST,
    )

# (b) elastic 2:2 -> PyTorchJob, waited for by the trigger (run inline by dag.test()); kept to inspect its pods.
with _dag("k8s_elastic_job"):
    TorchElasticOperator(
        task_id="train",
        python_callable=all_reduce_ranks,
        op_kwargs={"offset": 1.0},
        task_config=small(nnodes="2:2", nproc_per_node=2),
        deferrable=True,
        on_finish_action="keep",
        **FAST,
    )

# (c) Master + 1 Worker: static rendezvous on MASTER_ADDR/MASTER_PORT injected by the training operator.
with _dag("k8s_master_worker"):
    TorchElasticOperator(
        task_id="train",
        python_callable=all_reduce_ranks,
        op_kwargs={"offset": 1.0},
        task_config=PyTorch(master=Master(), worker=Worker(replicas=1), nproc_per_node=1),
        deferrable=False,
        **FAST,
    )

# (e) RecoverableError on try 1 -> retried with a new job on try 2.
with _dag("k8s_recoverable_retry", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=flaky_on_first_try,
        op_kwargs={"try_number": "{{ ti.try_number }}"},
        task_config=small(),
        deferrable=True,
        on_retry_callback=record_failure,
        **FAST,
    )

# (f) ValueError on rank 1 -> fails at once despite retries=2; the failed Pod is kept.
with _dag("k8s_permanent_failure", retries=2):
    TorchElasticOperator(
        task_id="train",
        python_callable=fail_on_rank_1,
        task_config=small(nproc_per_node=2),
        deferrable=False,
        on_retry_callback=record_failure,
        **FAST,
    )

# (h) killed while running: the worker's on_kill (SIGTERM) deletes the PyTorchJob (and so its pods).
with _dag("k8s_killed_worker"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 300, "value": "never"},
        task_config=small(nnodes="2:2"),
        deferrable=False,
        # The deletion is what is tested, not the graceful stop: a function that never checks stop_requested()
        # would keep its pods for the default 120 s grace period.
        termination_grace_period=10,
        **FAST,
    )

# (h) killed while deferred: the trigger's on_kill deletes the job.
with _dag("k8s_killed_trigger"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 300, "value": "never"},
        task_config=small(),
        deferrable=True,
        # The deletion is what is tested, not the graceful stop: a function that never checks stop_requested()
        # would keep its pods for the default 120 s grace period.
        termination_grace_period=10,
        **FAST,
    )

# (i) the triggerer restarts while the job runs; kept so that the test can count the jobs of the try.
with _dag("k8s_triggerer_restart"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 8, "value": "survived a triggerer restart"},
        task_config=small(),
        deferrable=True,
        on_finish_action="keep",
        **FAST,
    )

# (j) the worker dies after creating the job; the same try re-attaches. Kept so that the test can count jobs.
with _dag("k8s_worker_crash"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 10, "value": "re-attached"},
        task_config=small(),
        deferrable=False,
        on_finish_action="keep",
        **FAST,
    )

# (j') the same, with a job that ends before the same try runs again, deferrable: the try must finish in the worker
# (the test flips deferrable, as a worker whose configuration defers would).
with _dag("k8s_ended_before_defer"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 0, "value": "ended before the deferral"},
        task_config=small(),
        deferrable=False,
        on_finish_action="keep",
        **FAST,
    )


def sleep_on_the_first_try(value: str) -> dict:
    """Outlives any test on try 1 (its worker is killed meanwhile); returns at once on the next."""
    import time

    from airflow_provider_torchelastic import context

    if context.current().try_number == 1:
        time.sleep(600)
    return {"value": value, "rank": int(os.environ["RANK"])}


# (j'') the worker dies while it waits for try 1's job; the next try must not leave that job running.
with _dag("k8s_worker_lost", retries=1):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_on_the_first_try,
        op_kwargs={"value": "try 2"},
        task_config=small(),
        deferrable=False,
        **FAST,
    )

#: A sensitive env value (issue 20, item 2): it must reach the pod and nothing anyone else reads.
SENSITIVE_VALUE = "s3cr3t-e2e-value-7f41"


def print_the_token() -> dict:
    token = os.environ.get("API_TOKEN", "")
    print(f"the token is {token}", flush=True)
    return {"token_arrived": token == SENSITIVE_VALUE, "rank": int(os.environ["RANK"])}


with _dag("k8s_sensitive_env"):
    TorchElasticOperator(
        task_id="train",
        python_callable=print_the_token,
        task_config=small(),
        deferrable=False,
        pod_options=PodOptions(env={"API_TOKEN": SENSITIVE_VALUE}),
        **FAST,
    )

# RBAC and API faults: the cheapest task (one pod, one worker) that still takes a few seconds.
with _dag("k8s_minimal"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 4, "value": "ok"},
        task_config=small(),
        deferrable=False,
        **FAST,
    )

# The same, waited for by the trigger.
with _dag("k8s_minimal_deferred"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 4, "value": "ok"},
        task_config=small(),
        deferrable=True,
        **FAST,
    )

# The API refuses the submission (no permission, no CRD, admission): fails at once although retries=2.
with _dag("k8s_submit_refused", retries=2):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 0, "value": "never"},
        task_config=small(nnodes=2),
        deferrable=False,
        on_retry_callback=record_failure,
        **FAST,
    )

# Kept after it succeeded: a late kill (a stale trigger cancelled) must leave it.
with _dag("k8s_kept"):
    TorchElasticOperator(
        task_id="train",
        python_callable=sleep_then_return,
        op_kwargs={"seconds": 0, "value": "kept"},
        task_config=small(),
        deferrable=True,
        on_finish_action="keep",
        **FAST,
    )
