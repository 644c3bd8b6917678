"""An FSDP-sharded Module returned by real workers (2 ranks, gloo, on the CPU): every rank gathers its full state dict
(a collective), and rank 0's reference holds the full, unsharded tensors, which load into a fresh module.

Each rank fills its own shard with ``rank + 1`` before returning, so the full tensors show both ranks' shards, in
place: FSDP2 (``fully_shard``) shards each parameter's dim 0 as ``torch.chunk`` does; FSDP1 shards the one flat
parameter of all of them, padded to a multiple of the world size."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from airflow_provider_torchelastic import artifacts
from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext
from airflow_provider_torchelastic.errors import EXIT_FAILED, EXIT_OK
from tests.runner.support import RunnerRun, run_runner, runner_env

pytestmark = pytest.mark.slow

TRY = TaskContext(dag_id="d", task_id="t", run_id="manual__1", try_number=1)
#: Parameter name -> shape of the module the workers shard (buffer ``steps`` besides).
SHAPES = {"a.weight": (6, 8), "a.bias": (6,), "b.weight": (3, 6), "b.bias": (3,)}


class Net(torch.nn.Module):
    """The workers define the same class themselves (this module is not importable where they run)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.b = torch.nn.Linear(6, 3)
        self.register_buffer("steps", torch.tensor(7))


# --- training functions (shipped by value) --------------------------------------------------------------------------


def _net() -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 6)
            self.b = torch.nn.Linear(6, 3)
            self.register_buffer("steps", torch.tensor(7))

    return Net()


def return_fully_sharded() -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    net = _net()
    fully_shard(net.a)
    fully_shard(net)
    with torch.no_grad():
        for param in net.parameters():
            assert isinstance(param, DTensor), type(param)
            param.to_local().fill_(dist.get_rank() + 1)
    local = {name: list(param.to_local().shape) for name, param in net.named_parameters()}
    return {"model": net, "local_shapes": local}  # every rank returns the module: the gathering is a collective


def return_fsdp1_wrapped() -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo")
    net = FullyShardedDataParallel(_net(), device_id=torch.device("cpu"))
    with torch.no_grad():
        (flat,) = list(net.parameters())  # one flat parameter, this rank's shard of it
        flat.fill_(dist.get_rank() + 1)
    return {"model": net, "local_shapes": {"flat": list(flat.shape)}}


def return_only_on_rank_0() -> Any:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    net = fully_shard(_net())
    return net if dist.get_rank() == 0 else None  # the others return nothing to gather


def return_sharded_state_dict() -> Any:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    return fully_shard(_net()).state_dict()  # DTensors: each rank's shards


# --- expected values ------------------------------------------------------------------------------------------------


def fsdp2_full(shape: tuple[int, ...]) -> torch.Tensor:
    """Rank 0's rows 1, rank 1's rows 2: dim 0 split as torch.chunk splits it."""
    rows = torch.arange(shape[0]).chunk(2)
    return torch.cat([torch.full((len(part), *shape[1:]), float(rank + 1)) for rank, part in enumerate(rows)])


def fsdp1_full() -> dict[str, torch.Tensor]:
    """The parameters flattened in order, padded to an even length, the first half rank 0's (1), the rest 2's."""
    sizes = [torch.Size(shape).numel() for shape in SHAPES.values()]
    half = -(-sum(sizes) // 2)
    flat = torch.cat([torch.ones(half), torch.full((sum(sizes) - half,), 2.0)])
    return {name: part.reshape(SHAPES[name]) for name, part in zip(SHAPES, flat.split(sizes), strict=True)}


def run_with_artifacts(tmp_path: Path, fn: Any, start_method: str) -> tuple[RunnerRun, str]:
    location = f"file://{tmp_path}/artifacts"
    context = dataclasses.replace(TRY, artifact_uri=location).to_env_value()
    run = run_runner(tmp_path, fn, start_method=start_method, env=runner_env(**{CONTEXT_ENV: context}))
    return run, location


# --- tests ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "start_method", "local_shapes"),
    [
        (return_fully_sharded, "spawn", {"a.weight": [3, 8], "a.bias": [3], "b.weight": [2, 6], "b.bias": [2]}),
        (return_fsdp1_wrapped, "fork", {"flat": [38]}),  # 75 elements, padded to 76
    ],
    ids=["fsdp2-fully_shard", "fsdp1-wrapper"],
)
def test_rank_0s_reference_holds_the_full_state_dict(
    tmp_path: Path, fn: Any, start_method: str, local_shapes: dict[str, list[int]]
) -> None:
    run, location = run_with_artifacts(tmp_path, fn, start_method)
    assert run.returncode == EXIT_OK, run.describe()
    value = run.outcome.result  # type: ignore[union-attr]
    assert value["local_shapes"] == local_shapes  # the workers really held shards
    ref = value["model"]
    assert ref["kind"] == "module" and ref["url"].startswith(f"{location}/"), ref
    # The user's class, not FSDP's wrapper or the class fully_shard makes (FSDPNet); defined in the function.
    assert ref["class"].endswith("_net.<locals>.Net"), ref["class"]
    assert {name: tuple(info["shape"]) for name, info in ref["tensors"].items()} == {**SHAPES, "steps": ()}

    expected = fsdp1_full() if fn is return_fsdp1_wrapped else {name: fsdp2_full(s) for name, s in SHAPES.items()}
    state = artifacts.load(ref)
    assert list(state) == list(ref["tensors"])
    for name, tensor in expected.items():
        assert type(state[name]) is torch.Tensor and torch.equal(state[name], tensor), name
    assert state["steps"].item() == 7

    fresh = Net()
    assert artifacts.load(ref, into=fresh) is fresh
    for name, param in fresh.named_parameters():
        assert param.shape == SHAPES[name] and torch.equal(param, expected[name]), name
    assert fresh.steps.item() == 7


def test_a_sharded_module_returned_by_rank_0_alone_fails_saying_every_rank_must_return_it(tmp_path: Path) -> None:
    run, _ = run_with_artifacts(tmp_path, return_only_on_rank_0, "fork")
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 0 and failure.exception == "TypeError", run.describe()
    assert "every rank must return it" in failure.message and not failure.recoverable


def test_a_sharded_state_dict_fails_naming_the_tensor_and_the_way_out(tmp_path: Path) -> None:
    run, _ = run_with_artifacts(tmp_path, return_sharded_state_dict, "fork")
    assert run.returncode == EXIT_FAILED, run.describe()
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and failure.rank == 0 and failure.exception == "TypeError", run.describe()
    assert "a.weight: a sharded DTensor" in failure.message and "return the module itself" in failure.message
