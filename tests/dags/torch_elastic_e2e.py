"""DAGs for the end-to-end tests (tests/e2e): local execution through ``dag.test()``.

Training functions are tiny (a gloo all_reduce of a scalar) and workers few, so that every run stays cheap on a small
machine; a short monitor interval makes failures surface fast.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from tests.dag_support import fail_on_rank_1, flaky_on_first_try, record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")


def small(**overrides: object) -> Elastic:
    # spawn, the default: fork is covered by the runner tests, and a rare fork-after-threads hang (see the
    # README) must not make these DAG tests flaky.
    values: dict = {"nproc_per_node": 2, "start_method": "spawn", "monitor_interval": 0.5}
    values.update(overrides)
    return Elastic(**values)


def all_reduce_ranks(offset: float = 0.0) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    result = {"rank": rank, "world_size": dist.get_world_size(), "sum": value.item()}
    dist.destroy_process_group()
    return result


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


with DAG("te_two_nodes", schedule=None, start_date=START, catchup=False):
    TorchElasticOperator(
        task_id="train",
        python_callable=all_reduce_ranks,
        op_kwargs={"offset": 1.0},
        task_config=small(nnodes=2),
        execution="local",
    )


with DAG("te_mapped_decorator", schedule=None, start_date=START, catchup=False):

    @task.torch_elastic(task_config=small(), execution="local", multiple_outputs=True)
    def scaled_sum(factor: int) -> dict:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)  # 1 + 2
        result = {"factor": factor, "total": value.item() * factor, "world_size": dist.get_world_size()}
        dist.destroy_process_group()
        return result

    scaled_sum.expand(factor=[2, 5])


with DAG("te_context_arguments", schedule=None, start_date=START, catchup=False, params={"lr": 0.1}):
    # As @task fills them: the context's plain values, for the parameters that name them, in an async function,
    # mapped (the arguments, and so the parameters left to fill, are known only at run time).
    @task.torch_elastic(task_config=small(nproc_per_node=1), execution="local")
    async def context_values(  # type: ignore[no-untyped-def]
        epochs: int, ds=None, params=None, logical_date=None, run_id=None, try_number=None, **kwargs
    ) -> dict:
        import asyncio
        import datetime
        import decimal
        import uuid

        await asyncio.sleep(0)
        return {
            "epochs": epochs,
            "ds": ds,
            "params": params,
            "logical_date": [type(logical_date).__module__, logical_date.isoformat()],
            "run_id": run_id,
            "try_number": try_number,
            "kwargs": kwargs,
            # Values rank 0 returns as they are: the encoder converts them in the worker.
            "converted": {
                "duration": datetime.timedelta(minutes=2),
                "lr": decimal.Decimal(str(params["lr"])),
                "run": uuid.uuid5(uuid.NAMESPACE_URL, run_id),
            },
        }

    context_values.expand(epochs=[3])


with DAG(
    "te_recoverable_retry",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={"retries": 1, "retry_delay": timedelta(0), "on_failure_callback": record_failure},
):
    TorchElasticOperator(
        task_id="train",
        python_callable=flaky_on_first_try,
        op_kwargs={"try_number": "{{ ti.try_number }}"},
        task_config=small(nproc_per_node=1),
        execution="local",
        on_retry_callback=record_failure,
    )


with DAG(
    "te_permanent_failure",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={"retries": 2, "retry_delay": timedelta(0), "on_failure_callback": record_failure},
):
    TorchElasticOperator(
        task_id="train",
        python_callable=fail_on_rank_1,
        task_config=small(),
        execution="local",
        on_retry_callback=record_failure,
    )


with DAG(
    "te_execution_from_config",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={"on_failure_callback": record_failure},
):
    # execution is not set: [torch_elastic] execution decides, when the task runs. deferrable=True is for Kubernetes:
    # a local try waits in the task and reads none of the deferral's options.
    TorchElasticOperator(
        task_id="train", python_callable=world_size, task_config=small(nproc_per_node=1), deferrable=True
    )


def six_kilobytes() -> str:
    return "x" * 6000


with DAG(
    "te_result_over_the_limit",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={"retries": 1, "retry_delay": timedelta(0), "on_failure_callback": record_failure},
):
    # 6 KB from rank 0: over a Kubernetes termination message's 4096 bytes, so refused locally as well.
    TorchElasticOperator(
        task_id="train", python_callable=six_kilobytes, task_config=small(nproc_per_node=1), execution="local"
    )


def print_hostile_output() -> dict:
    """What a careless (or hostile) training function may print: the task must still end, with rank 0's value."""
    import sys

    if int(os.environ["RANK"]) == 0:
        hostile = [
            'TORCHELASTIC_METRICS {"last": [1]}',
            'TORCHELASTIC_METRICS {"step": "z", "last": {"loss": "NaN", "x": {}}, "points": {"loss": [[1, "a"], 2]}}',
            'TORCHELASTIC_METRICS {"a": ' + "[" * 5000 + "]" * 5000 + "}",
            "TORCHELASTIC_METRICS {" + "x" * (2 * 1024 * 1024) + "}",
        ]
        for line in hostile:
            print(line, flush=True)
        sys.stdout.buffer.write(b"\xff\xfe not UTF-8 \xc3\n")
        sys.stdout.buffer.write(b"y" * (3 * 1024 * 1024) + b"\n")  # one 3 MiB line
        sys.stdout.flush()
    return {
        "airflow_settings": sorted(
            k for k in os.environ if k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_"))
        ),
        "stdin": sys.stdin.read(),
    }


with DAG("te_hostile_output", schedule=None, start_date=START, catchup=False):
    TorchElasticOperator(
        task_id="train",
        python_callable=print_hostile_output,
        task_config=small(nproc_per_node=1),
        execution="local",
        execution_timeout=timedelta(minutes=3),
    )
