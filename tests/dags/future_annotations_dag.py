"""A DAG file with ``from __future__ import annotations`` whose training code declares dataclasses and an enum beside
and inside the training function, and exchanges them between ranks with pickle.

In the workers this file does not exist, and the module Airflow imported it as (``unusual_prefix_<sha1>_...``) is not
importable: the payload gives the shipped code that module back. Run locally by
tests/e2e/test_local_dag_file_code.py; nothing here imports torch at parse time.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import pendulum
from airflow.sdk import DAG

from airflow_provider_torchelastic import Elastic, TorchElasticOperator

START = pendulum.datetime(2026, 1, 1, tz="UTC")


class Split(Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclass(frozen=True)
class Metrics:
    rank: int
    split: Split
    loss: float
    schema: ClassVar[int] = 1


def train(scale: float) -> dict:
    import typing

    import torch.distributed as dist

    @dataclass
    class Config:
        lr: float
        milestones: list[int] = field(default_factory=lambda: [10, 20])
        # A mutable default is refused for a field, allowed for a class variable: the ClassVar must be seen.
        registry: ClassVar[dict] = {}

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = Config(lr=0.25 * scale)
    metrics = Metrics(rank, Split.EVAL if rank else Split.TRAIN, config.lr * (rank + 1))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics)
    dist.destroy_process_group()
    return {
        "gathered": [[m.rank, m.split.value, m.loss] for m in gathered],
        "same_classes": all(type(m) is Metrics and isinstance(m.split, Split) for m in gathered),
        "config_fields": [f.name for f in dataclasses.fields(Config)],
        "milestones": config.milestones,
        "metrics_hints": sorted(typing.get_type_hints(Metrics)),
        "module": sys.modules[__name__].__dict__ is globals() and Config.__module__ == __name__,
    }


with DAG("te_future_annotations", schedule=None, start_date=START, catchup=False):
    TorchElasticOperator(
        task_id="train",
        python_callable=train,
        op_kwargs={"scale": 2.0},
        task_config=Elastic(nproc_per_node=2, start_method="spawn", monitor_interval=0.5),
        execution="local",
    )
