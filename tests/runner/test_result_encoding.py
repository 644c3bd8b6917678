"""Rank 0's value through real workers: what a training function naturally returns (a torch scalar, a small tensor,
a dataclass, NaN) arrives as strict JSON, and a value that cannot travel fails in rank 0 with its traceback."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic.core.encoding import MAX_ARRAY_ELEMENTS
from airflow_provider_torchelastic.errors import EXIT_FAILED, EXIT_OK
from tests.runner.support import run_runner

pytestmark = pytest.mark.slow


@pytest.fixture(params=["spawn", "fork"])
def start_method(request: pytest.FixtureRequest) -> str:
    return request.param


def strict_loads(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"the result file is not strict JSON: bare {constant}")

    return json.loads(text, parse_constant=refuse)


# --- training functions (shipped by value: the workers run in tmp_path, where this module is not importable) ------


@dataclasses.dataclass
class EpochMetrics:
    epoch: int
    loss: Any
    accuracy: Any
    per_class: Any


def train_and_return_tensors() -> Any:
    import numpy as np
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)], requires_grad=False)
    dist.all_reduce(total)  # 1 + 2
    grads = torch.arange(4, dtype=torch.float32).reshape(2, 2) * (rank + 1)
    dist.all_reduce(grads)
    dist.destroy_process_group()
    weights = torch.ones(3, requires_grad=True)
    return {
        "sum": total[0],  # a 0-d tensor
        "grads": grads,  # a small 2-d tensor
        "norm": (weights * 2).sum(),  # requires grad: detached
        "shape": grads.shape,  # torch.Size
        "metrics": EpochMetrics(
            epoch=3,
            loss=torch.tensor(float("nan")),
            accuracy=np.float32(0.75),
            per_class=np.array([0.5, np.inf]),
        ),
        "best": -math.inf,
        "tags": {"b", "a"},
    }


def return_large_tensor() -> Any:
    import torch

    return {"weights": torch.zeros(MAX_ARRAY_ELEMENTS // 50 + 1, 50)}


def return_object_inside() -> Any:
    return {"metrics": [0.5, 0.25, object()]}


def return_tensor_too_large_for_the_message() -> Any:
    import torch

    # Within the element limit, beyond the 4096-byte termination message.
    return torch.full((2000,), 0.123456789)


# --- tests ----------------------------------------------------------------------------------------------------------


def test_torch_numpy_dataclass_and_nan_arrive_as_strict_json(tmp_path: Path, start_method: str) -> None:
    run = run_runner(tmp_path, train_and_return_tensors, start_method=start_method)
    assert run.returncode == EXIT_OK, run.describe()
    assert run.result_text is not None
    expected = {
        "sum": 3.0,
        "grads": [[0.0, 3.0], [6.0, 9.0]],
        "norm": 6.0,
        "shape": [2, 2],
        "metrics": {"epoch": 3, "loss": "NaN", "accuracy": 0.75, "per_class": [0.5, "Infinity"]},
        "best": "-Infinity",
        "tags": ["a", "b"],
    }
    # The result file, as the kubelet keeps it: strict JSON that any reader accepts.
    assert strict_loads(run.result_text)["result"] == expected
    # What the Airflow side pushes to XCom: the same, NaN and infinities as strings.
    assert run.outcome is not None and run.outcome.result == expected, run.describe()


def test_a_large_tensor_fails_in_rank_0_naming_shape_and_limit(tmp_path: Path) -> None:
    run = run_runner(tmp_path, return_large_tensor, start_method="fork")
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 0 and not failure.recoverable, run.describe()
    assert failure.exception == "ResultNotSerializableError"
    rows = MAX_ARRAY_ELEMENTS // 50 + 1
    assert f"result['weights'] is a torch.Tensor of shape ({rows}, 50)" in failure.message, failure.message
    assert f"more than the {MAX_ARRAY_ELEMENTS} elements" in failure.message
    # rank 0's own traceback, through the encoder
    assert "encode_result" in failure.traceback, failure.traceback


def test_a_value_without_json_form_names_where_it_sits(tmp_path: Path) -> None:
    run = run_runner(tmp_path, return_object_inside, start_method="spawn")
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 0 and failure.exception == "ResultNotSerializableError"
    assert "result['metrics'][2] has type builtins.object" in failure.message, failure.message


def test_the_termination_message_limit_still_applies_to_encoded_tensors(tmp_path: Path) -> None:
    run = run_runner(tmp_path, return_tensor_too_large_for_the_message, start_method="fork")
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 0 and failure.exception == "ResultTooLargeError", run.describe()
    assert "more than the limit of 4096 bytes" in failure.message
    assert run.result_text is not None and len(run.result_text.encode()) <= 4096
