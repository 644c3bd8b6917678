"""DAG-file code in real workers: dataclasses and enums of a ``from __future__ import annotations`` module, declared
beside and inside the training function, exchanged between ranks with pickle.

This module plays the DAG file: the workers run in tmp_path, where it does not exist, so its code travels by value
and the payload gives it back its module there (``tests.runner.test_dag_file_code``, in spawned workers and in
forked ones alike).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import ClassVar

import pytest

from airflow_provider_torchelastic.errors import EXIT_OK
from tests.runner.support import run_runner

pytestmark = pytest.mark.slow


class Phase(Enum):
    WARMUP = "warmup"
    STEADY = "steady"


@dataclass(frozen=True)
class Report:
    rank: int
    phase: Phase
    loss: float
    notes: str | None = None
    version: ClassVar[int] = 2


def exchange_reports(scale: float) -> dict:
    import torch.distributed as dist

    @dataclass
    class Step:
        index: int
        losses: list[float] = field(default_factory=list)
        kind: ClassVar[str] = "step"

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step = Step(rank)
    step.losses.append(scale * (rank + 1))
    report = Report(rank, Phase.STEADY if rank else Phase.WARMUP, sum(step.losses))
    # pickle between ranks: each worker finds Report and Phase by name in the module the payload registered.
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    shared: list = [Report(-1, Phase.STEADY, 0.5, "from rank 0")] if rank == 0 else [None]
    dist.broadcast_object_list(shared, src=0)
    checks = [
        all(type(r) is Report and isinstance(r.phase, Phase) for r in [*gathered, *shared]),
        shared[0].notes == "from rank 0",
        sys.modules[__name__].__dict__ is globals(),
    ]
    all_ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_ranks, all(checks))
    dist.destroy_process_group()
    return {
        "gathered": [[r.rank, r.phase.value, r.loss] for r in gathered],
        "checks_on_every_rank": all_ranks,
        "step_fields": [f.name for f in dataclasses.fields(Step)],
        "report_fields": [f.name for f in dataclasses.fields(Report)],
        "report_hints": {name: repr(value) for name, value in typing.get_type_hints(Report).items()},
    }


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_dataclasses_and_enums_of_the_dag_file_in_real_workers(tmp_path: Path, start_method: str) -> None:
    run = run_runner(tmp_path, exchange_reports, (1.5,), start_method=start_method)
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome is not None and run.outcome.succeeded, run.describe()
    assert run.outcome.result == {
        "gathered": [[0, "warmup", 1.5], [1, "steady", 3.0]],
        "checks_on_every_rank": [True, True],
        "step_fields": ["index", "losses"],
        "report_fields": ["rank", "phase", "loss", "notes"],
        "report_hints": {
            "rank": "<class 'int'>",
            "phase": "<enum 'Phase'>",
            "loss": "<class 'float'>",
            "notes": "str | None",
            "version": "typing.ClassVar[int]",
        },
    }
