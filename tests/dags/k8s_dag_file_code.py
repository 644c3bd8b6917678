"""A training function that uses a helper, a class and a closure defined here, beside the task, on the cluster.

This file exists only where Airflow parses it. The pods run the runner image built from docker/Dockerfile on the
real node, which has neither this repository nor Airflow, so everything the function uses from here has to travel in
its payload. Run by tests/e2e/test_dag_file_code_in_pods.py; the connection ``kubernetes_default`` and the image are
set by the test (only the image's reference comes from tests/dag_support.py, when the file is parsed).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Master, PyTorch, TorchElasticOperator, Worker
from tests.dag_support import pod_image

#: The checkout this file lives in, as the Airflow side sees it; the pods report whether they can see any of it.
REPO_ROOT = str(Path(__file__).resolve().parents[2])


def normalise(values: list[float]) -> list[float]:
    total = sum(values)
    return [value / total for value in values]


class RunningMean:
    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0

    def add(self, value: float) -> RunningMean:
        self.count += 1
        self.total += value
        return self

    @property
    def mean(self) -> float:
        return self.total / self.count


def make_scaler(factor: float) -> Callable[[float], float]:
    def scale(value: float) -> float:
        return value * factor

    return scale


#: Built when the file is parsed: the payload must carry the closure's cell, not just its code.
triple = make_scaler(3.0)


def what_this_pod_sees(repo_root: str) -> dict:
    """Booleans and short lists only: rank 0's result travels in a 4 KiB termination message."""
    import importlib.util
    import os
    import sys

    def in_repo(path: str) -> bool:
        return Path(path or ".").resolve().is_relative_to(repo_root)

    return {
        "hostname": os.environ["HOSTNAME"],
        "airflow_importable": importlib.util.find_spec("airflow") is not None,
        "cwd_in_repo": in_repo(os.getcwd()),
        "repo_paths_on_sys_path": [p for p in sys.path if in_repo(p)],
    }


def train(weights: list[float], repo_root: str) -> dict | None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scaled = [triple(w) for w in normalise(weights)]
    mean = RunningMean()
    for value in scaled:
        mean.add(value)
    # Every rank reports, so that the Worker pod is seen as well as the Master pod.
    seen: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, {"rank": rank, **what_this_pod_sees(repo_root)})
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "normalised": normalise(weights),
        "scaled": scaled,
        "mean": mean.mean,
        "mean_type": type(mean).__name__,
        "pods": seen,
    }


with DAG(
    "k8s_dag_file_code",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    default_args={"retries": 0, "execution_timeout": timedelta(minutes=3)},
):
    TorchElasticOperator(
        task_id="train",
        python_callable=train,
        op_kwargs={"weights": [1.0, 2.0, 5.0], "repo_root": REPO_ROOT},
        # Master + Worker: two pods, so that both kinds of replica run the DAG file's code.
        task_config=PyTorch(master=Master(), worker=Worker(replicas=1), nproc_per_node=1),
        image=pod_image(),
        execution="kubernetes",
        deferrable=False,
        poll_interval=1,
        pending_grace_seconds=5,
    )
