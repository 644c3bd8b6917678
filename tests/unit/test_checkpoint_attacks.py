"""Sharded (DCP) checkpoints, written as the attack (issue 34, item 4): DCP reads a checkpoint's ``.metadata`` with
``pickle.load`` and its non-tensor values with ``torch.load(weights_only=False)``, so whoever can write under the
checkpoint root chose what every rank of the next try ran. ``load_sharded_latest`` now admits only DCP's own types
in the metadata and loads the values as plain data unless the caller opts out."""

from __future__ import annotations

import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

# DCP runs each rank's reads under its collectives and raises what failed inside its own CheckpointException.
from torch.distributed.checkpoint.api import CheckpointException

from airflow_provider_torchelastic.worker import checkpoint


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.marker,))


class Settings:
    """A training setting kept in the state dict as an object (not plain data)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def committed_sharded(root: Path, state: dict[str, Any], step: int = 1) -> Path:
    """A complete sharded checkpoint of ``state`` under ``root``, as ``save_sharded`` lays it out (one process)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    folder = f"step-{step:012d}-0123456789ab"
    (root / folder).mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists: one process is the point
        save(state, storage_writer=FileSystemWriter(str(root / folder)))
    checkpoint._commit(checkpoint.Store(str(root)), folder, step=step, kind=checkpoint.KIND_SHARDED)
    return root / folder


def load(root: Path, state: dict[str, Any], **kwargs: Any) -> int | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.load_sharded_latest(state, uri=str(root), **kwargs)


def test_a_real_sharded_checkpoint_loads(tmp_path: Path) -> None:
    committed_sharded(tmp_path, {"w": torch.arange(4.0), "step": 7, "extra": {"lr": 0.1, "name": "run"}})
    state: dict[str, Any] = {"w": torch.zeros(4), "step": 0, "extra": {"lr": 0.0, "name": ""}}
    assert load(tmp_path, state) == 1
    assert torch.equal(state["w"], torch.arange(4.0)) and state["step"] == 7
    assert state["extra"] == {"lr": 0.1, "name": "run"}


def test_planted_metadata_is_refused_before_it_runs(tmp_path: Path) -> None:
    folder = committed_sharded(tmp_path, {"w": torch.ones(2)})
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointException, match=r"DCP metadata names pathlib\.Path\.touch, which DCP never writes"):
        load(tmp_path, {"w": torch.zeros(2)})
    assert not marker.exists()


def test_a_dotted_name_cannot_walk_out_of_a_dcp_module(tmp_path: Path) -> None:
    """Protocol 4 resolves ``module`` + ``a.b`` by attribute: ``filesystem`` + ``os.system`` would be os.system."""
    folder = committed_sharded(tmp_path, {"w": torch.ones(2)})
    # PROTO 4, then STACK_GLOBAL of ("torch.distributed.checkpoint.filesystem", "os.getcwd"), called with no args.
    module, name = b"torch.distributed.checkpoint.filesystem", b"os.getcwd"
    planted = (
        b"\x80\x04"
        + b"\x8c" + bytes([len(module)]) + module
        + b"\x8c" + bytes([len(name)]) + name
        + b"\x93" + b")" + b"R" + b"."
    )  # fmt: skip
    (folder / ".metadata").write_bytes(planted)
    with pytest.raises(CheckpointException, match=r"names torch\.distributed\.checkpoint\.filesystem\.os\.getcwd"):
        load(tmp_path, {"w": torch.zeros(2)})


def test_an_object_value_loads_only_when_the_caller_trusts_the_writer(tmp_path: Path) -> None:
    committed_sharded(tmp_path, {"w": torch.ones(2), "settings": Settings(0.5)})
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        load(tmp_path, {"w": torch.zeros(2), "settings": None})
    state: dict[str, Any] = {"w": torch.zeros(2), "settings": None}
    assert load(tmp_path, state, weights_only=False) == 1
    assert isinstance(state["settings"], Settings) and state["settings"].lr == 0.5


# --- links and special files under a local checkpoint root (item 2) -------------------------------------------------


def test_a_state_file_swapped_for_a_link_is_not_read_through(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = checkpoint.save({"w": torch.ones(2)}, step=1, uri=str(root))
    assert saved is not None
    elsewhere = tmp_path / "elsewhere.pt"
    torch.save({"w": torch.full((2,), 9.0)}, elsewhere)
    state_file = Path(saved.uri) / checkpoint.STATE_FILE
    state_file.unlink()
    state_file.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="symbolic link"):
        checkpoint.load_latest(str(root))


@pytest.mark.timeout(20)
def test_a_fifo_or_a_link_as_the_marker_is_no_checkpoint_and_no_hang(tmp_path: Path) -> None:
    import os

    root = tmp_path / "ckpt"
    first = checkpoint.save({"w": torch.ones(2)}, step=1, uri=str(root))
    second = checkpoint.save({"w": torch.ones(2)}, step=2, uri=str(root))
    third = checkpoint.save({"w": torch.ones(2)}, step=3, uri=str(root))
    assert first is not None and second is not None and third is not None
    (Path(third.uri) / checkpoint.COMMIT_MARKER).unlink()
    os.mkfifo(Path(third.uri) / checkpoint.COMMIT_MARKER)  # a read would block forever
    (Path(second.uri) / checkpoint.COMMIT_MARKER).unlink()
    (Path(second.uri) / checkpoint.COMMIT_MARKER).symlink_to("/dev/zero")
    found = checkpoint.latest(str(root))
    assert found is not None and found.step == 1
