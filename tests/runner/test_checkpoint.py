"""Checkpoints and stored results with real torch, on a local folder, a file:// URL and an S3-compatible server
(moto, started by the tests): the latest complete checkpoint is found, a torn write never is, and sharded
checkpoints are written by every rank of a real elastic launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic import checkpoint
from airflow_provider_torchelastic.core.outcome import TERMINATION_MESSAGE_LIMIT
from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV, TaskContext
from airflow_provider_torchelastic.errors import EXIT_OK
from airflow_provider_torchelastic.worker.checkpoint import NoCheckpointLocationError
from tests.runner.support import run_runner, runner_env
from tests.s3_server import S3Server, s3, s3_env  # noqa: F401

pytestmark = pytest.mark.slow


class FailsHalfwayThrough:
    """Pickling it raises, after torch.save has already written what came before it: a save torn midway."""

    def __reduce__(self) -> Any:
        raise OSError("node lost in the middle of a checkpoint write")


@pytest.fixture(params=["path", "file-url", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "path":
        return str(tmp_path / "ckpt")
    if request.param == "file-url":
        return f"file://{tmp_path / 'ckpt'}"
    server: S3Server = request.getfixturevalue("s3_env")
    return server.url(f"ckpt/{tmp_path.name}")


def test_save_then_find_and_load_the_latest_and_a_torn_write_is_never_taken(
    location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setenv("RANK", "0")
    assert checkpoint.latest(location) is None and checkpoint.load_latest(location) is None
    for step in (1, 2):
        saved = checkpoint.save({"step": step, "weights": torch.full((1000,), float(step))}, step=step, uri=location)
        assert saved is not None and saved.step == step
    # A save of step 3 dies after writing part of its state: its folder exists, its marker does not.
    with pytest.raises(OSError, match="node lost"):
        checkpoint.save({"weights": torch.zeros(100_000), "then": FailsHalfwayThrough()}, step=3, uri=location)
    found = checkpoint.latest(location)
    assert found is not None and found.step == 2
    loaded = checkpoint.load_latest(location)
    assert loaded is not None and loaded.step == 2 and loaded.state["step"] == 2
    assert torch.equal(loaded.state["weights"], torch.full((1000,), 2.0))
    # The same step saved again (a restart that redid it): the later commit wins, nothing is overwritten.
    checkpoint.save({"step": 2, "again": True}, step=2, uri=location)
    again = checkpoint.load_latest(location)
    assert again is not None and again.state.get("again") is True and again.uri != loaded.uri


def test_the_torn_folder_is_there_without_its_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(OSError):
        checkpoint.save({"then": FailsHalfwayThrough()}, step=7, uri=str(tmp_path))
    (torn,) = tmp_path.iterdir()
    assert torn.name.startswith("step-000000000007-")
    # A local write replaces its file whole when it completes: a torn one leaves neither the file nor its temporary.
    assert list(torn.iterdir()) == [] and checkpoint.latest(str(tmp_path)) is None


def test_only_rank_0_writes_and_a_missing_location_says_how_to_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    assert checkpoint.save({"x": 1}, step=0, uri=str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(CONTEXT_ENV, TaskContext(dag_id="d", task_id="t", run_id="r").to_env_value())
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NoCheckpointLocationError, match=r"\[torch_elastic\] checkpoint_root"):
        checkpoint.latest()
    with pytest.raises(ValueError, match="step: expected an int in"):
        checkpoint.save({}, step=-1, uri=str(tmp_path))


# --- sharded checkpoints: every rank of a real launch writes its shard ----------------------------------------------


def sharded_round_trip() -> dict:
    import torch
    import torch.distributed as dist

    from airflow_provider_torchelastic import checkpoint, context

    dist.init_process_group("gloo")
    ctx = context.current()
    rank = ctx.rank
    state = {"weights": torch.full((4,), float(rank + 1)), "step": torch.tensor(0)}
    before = checkpoint.load_sharded_latest(state)
    for step in (1, 2):
        state["step"] = torch.tensor(step)
        checkpoint.save_sharded(state, step=step)
    fresh = {"weights": torch.zeros(4), "step": torch.tensor(-1)}
    step = checkpoint.load_sharded_latest(fresh)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, fresh["weights"].tolist())
    dist.destroy_process_group()
    return {"before": before, "step": step, "saved_step": int(fresh["step"]), "weights": gathered}


@pytest.mark.parametrize("store", ["path", "s3"])
def test_sharded_checkpoints_are_written_by_every_rank_and_loaded_back(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    env = runner_env()
    if store == "path":
        where = str(tmp_path / "sharded")
    else:
        # The runners get the server from their env; this process reads the checkpoint back too (below), so it needs
        # the same env: without it only an S3 file system another test left in fsspec's cache could read it.
        server: S3Server = request.getfixturevalue("s3_env")
        env.update(server.env)
        where = server.url(f"sharded/{tmp_path.name}")
    task = TaskContext(dag_id="d", task_id="t", run_id="r", checkpoint_uri=where)
    env[CONTEXT_ENV] = task.to_env_value()
    run = run_runner(tmp_path, sharded_round_trip, nproc=2, env=env)
    assert run.returncode == EXIT_OK, run.describe()
    result = run.outcome.result  # type: ignore[union-attr]
    # Each rank's tensor is a replicated (non-DTensor) value: DCP keeps rank 0's copy, which every rank loads.
    assert result == {"before": None, "step": 2, "saved_step": 2, "weights": [[1.0] * 4, [1.0] * 4]}, result
    found = checkpoint.latest(where)
    assert found is not None and found.kind == checkpoint.KIND_SHARDED and found.step == 2


# --- results too large for the termination message ------------------------------------------------------------------


def big_result() -> dict:
    return {"values": list(range(20_000)), "label": "per-class metrics"}


def test_a_large_result_goes_to_result_storage_and_the_outcome_carries_its_reference(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'results' / 'd' / 'r' / 't' / '-1' / '1' / 'result.json'}"
    run = run_runner(tmp_path, big_result, nproc=1, extra=["--result-url", url])
    assert run.returncode == EXIT_OK, run.describe()
    outcome = run.outcome
    assert outcome is not None and outcome.result is None and outcome.result_ref == url
    assert len(run.result_text or "") < TERMINATION_MESSAGE_LIMIT
    stored = (tmp_path / "results" / "d" / "r" / "t" / "-1" / "1" / "result.json").read_text()
    assert json.loads(stored) == big_result()


def test_a_small_result_stays_in_the_result_file_even_with_result_storage(tmp_path: Path) -> None:
    run = run_runner(tmp_path, lambda: {"loss": 0.5}, nproc=1, extra=["--result-url", str(tmp_path / "r.json")])
    assert run.returncode == EXIT_OK, run.describe()
    assert run.outcome is not None and run.outcome.result == {"loss": 0.5} and run.outcome.result_ref is None
    assert not (tmp_path / "r.json").exists()


def test_without_result_storage_a_large_result_fails_and_names_the_option(tmp_path: Path) -> None:
    run = run_runner(tmp_path, big_result, nproc=1)
    failure = run.outcome.failure  # type: ignore[union-attr]
    assert failure is not None and "more than the limit of 4096 bytes" in failure.message
    assert "[torch_elastic] result_storage" in failure.message


class _Planted:
    """Any picklable object: what a checkpoint written by someone else could carry to run code on load."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("unpickled a planted object",))


def test_load_latest_unpickles_only_weights_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    import torch

    monkeypatch.setenv("RANK", "0")
    location = str(tmp_path)
    checkpoint.save({"weights": torch.ones(3), "step": 1, "lr": [0.1]}, step=1, uri=location)
    loaded = checkpoint.load_latest(location)
    assert loaded is not None and loaded.state["lr"] == [0.1], "state dicts and plain values load by default"
    checkpoint.save({"planted": _Planted()}, step=2, uri=location)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load_latest(location)
    trusted = checkpoint.load_latest(location, weights_only=False)
    assert trusted is not None and trusted.step == 2
