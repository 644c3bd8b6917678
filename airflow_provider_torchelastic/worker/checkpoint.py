"""Checkpoints that survive restarts and retries: save, find and load the latest complete one.

::

    from airflow_provider_torchelastic import context
    from airflow_provider_torchelastic.worker import checkpoint

    loaded = checkpoint.load_latest()                 # None on the first try of a run
    start = loaded.step + 1 if loaded else 0
    if loaded:
        model.load_state_dict(loaded.state["model"])
    for epoch in range(start, epochs):
        ...
        checkpoint.save({"model": model.state_dict()}, step=epoch)   # rank 0 writes, the others return

Without ``uri=`` every function uses the run context's location (:func:`airflow_provider_torchelastic.context.
current`), ``{[torch_elastic] checkpoint_root}/{dag_id}/{run_id}/{task_id}/{map_index}`` or the task's own
``checkpoint_uri``. Plain paths and ``file://`` URLs need only the standard library; any other URL (``s3://``,
``gs://``, ``abfs://`` ...) is opened with fsspec, imported only then (the ``[storage]`` extra installs it and the
cloud file systems). Credentials come from the workers' environment, never from here.

Layout and atomicity: each save writes a new folder ``step-<step, 12 digits>-<token>/`` and, last, a marker file
``COMMITTED`` in it. Object stores have no atomic rename, so a checkpoint is complete exactly when its marker exists;
a save killed midway (a preempted pod, an out-of-memory kill) leaves a folder without a marker, which is never taken
as the latest. Nothing is overwritten: a step saved twice (a restart that redid it) gets a second folder, and the
later-committed one wins. Checkpoints are kept (a retry may need any of them, and Airflow cannot know when the last
one was read): delete ``{root}/{dag_id}/{run_id}/`` when a run is done with it, or give the store a lifecycle rule.
Standard library, torch and (lazily) fsspec only: this runs in the workers, without Airflow.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airflow_provider_torchelastic.worker.checkpoint_store import (
    COMMIT_MARKER,
    FOLDER_PATTERN,
    KIND_SHARDED,
    KIND_STATE,
    STATE_FILE,
    Checkpoint,
    Store,
    latest_in,
    read_marker,
)
from airflow_provider_torchelastic.worker.checkpoint_store import open_store as open_store  # its old path

__all__ = [
    "COMMIT_MARKER",
    "Checkpoint",
    "Loaded",
    "NoCheckpointLocationError",
    "commit",
    "complete",
    "folder_name",
    "latest",
    "load_latest",
    "load_sharded_latest",
    "resume_location",
    "save",
    "save_sharded",
]

_log = logging.getLogger(__name__)


class NoCheckpointLocationError(RuntimeError):
    """No checkpoint location: neither ``uri=`` nor a run context with one ([torch_elastic] checkpoint_root or the
    task's ``checkpoint_uri``)."""


@dataclass(frozen=True, kw_only=True)
class Loaded:
    step: int
    state: Any
    uri: str


# --- finding ---------------------------------------------------------------------------------------------------------


def _location(uri: str | None) -> str:
    if uri is not None:
        if not isinstance(uri, str) or not uri:
            raise TypeError(f"uri: expected a path or fsspec URL, got {uri!r}")
        return uri
    from airflow_provider_torchelastic.worker.context import current

    location = current().checkpoint_uri
    if location is None:
        raise NoCheckpointLocationError(
            "this task has no checkpoint location: set the Airflow option [torch_elastic] checkpoint_root "
            "(env AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT), or pass checkpoint_uri= to the operator or decorator"
        )
    return location


def latest(uri: str | None = None, *, kind: str | None = None) -> Checkpoint | None:
    """The complete checkpoint with the highest step (the later-committed one of a step saved twice), or None;
    with ``kind``, the latest of that kind only (``"torch.save"``, ``"torch.distributed.checkpoint"``, or an
    integration's, such as ``"transformers.Trainer"``). Without ``uri``, a task whose own location has none looks
    where ``resume_from=`` points (:func:`resume_location`)."""
    found = latest_in(Store(_location(uri)), kind)
    if found is None and uri is None:
        other = resume_location(lambda location: _committed_at(latest_in(Store(location), kind)))
        found = latest_in(Store(other), kind) if other is not None else None
    return found


def complete(uri: str | None = None, *, kind: str | None = None) -> list[Checkpoint]:
    """Every complete checkpoint (of ``kind``, or any), by step and commit time: one marker read per folder."""
    store = Store(_location(uri))
    found = []
    for name in store.children():
        match = FOLDER_PATTERN.match(name)
        if match:
            checkpoint = read_marker(store, name, int(match.group(1)))
            if checkpoint is not None and (kind is None or checkpoint.kind == kind):
                found.append(checkpoint)
    return sorted(found, key=lambda c: (c.step, c.committed_at))


# --- saving ----------------------------------------------------------------------------------------------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12:
        raise ValueError(f"step: expected an int in [0, 10**12), got {step!r}")
    return step


def _commit(store: Store, folder: str, *, step: int, kind: str) -> Checkpoint:
    committed_at = time.time()
    record = {
        "step": step,
        "kind": kind,
        "committed_at": committed_at,
        "rank": _rank(),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
    }
    with store.open(store.path(folder, COMMIT_MARKER), "wb") as handle:
        handle.write(json.dumps(record).encode())
    return Checkpoint(step=step, uri=store.url_of(folder), kind=kind, committed_at=committed_at)


def folder_name(step: int, token: str | None = None) -> str:
    """The name of a new checkpoint folder for ``step``: ``step-<12 digits>-<token>`` (a fresh random token unless
    given; letters and digits only)."""
    step = _check_step(step)
    token = uuid.uuid4().hex[:12] if token is None else token
    if not token.isalnum() or not token.isascii():
        raise ValueError(f"token: expected letters and digits, got {token!r}")
    return f"step-{step:012d}-{token}"


def commit(folder_uri: str, *, step: int, kind: str) -> Checkpoint:
    """Write the commit marker into ``folder_uri`` (a folder named by :func:`folder_name`, whose files are all
    written): from now on it is a complete checkpoint of ``kind``. For writers of their own (the framework
    integrations): write every file first, make sure every rank is done, then commit once."""
    step = _check_step(step)
    parent, _, name = folder_uri.rstrip("/").rpartition("/")
    if not FOLDER_PATTERN.match(name) or int(name[5:17]) != step:
        raise ValueError(f"commit: {folder_uri!r} is not a folder named by folder_name({step})")
    return _commit(Store(parent), name, step=step, kind=kind)


def save(state: Any, *, step: int, uri: str | None = None) -> Checkpoint | None:
    """Rank 0 writes ``state`` with ``torch.save`` as the checkpoint of ``step``; other ranks return None at once.

    Returns the committed checkpoint. The state is written first and the commit marker last, so a save killed
    midway is never found by :func:`latest`.
    """
    step = _check_step(step)
    if _rank() != 0:
        return None
    import torch

    store = Store(_location(uri))
    folder = f"step-{step:012d}-{uuid.uuid4().hex[:12]}"
    store.makedirs(store.path(folder))
    with store.open(store.path(folder, STATE_FILE), "wb") as handle:
        torch.save(state, handle)
    return _commit(store, folder, step=step, kind=KIND_STATE)


def load_latest(uri: str | None = None, *, map_location: Any = "cpu", weights_only: bool = True) -> Loaded | None:
    """The latest complete ``torch.save`` checkpoint, loaded (on every rank that calls it), or None.

    ``weights_only=True`` by default: tensors, state dicts (models' and optimizers') and plain containers and
    numbers load; nothing else is unpickled, because whoever can write under the checkpoint root could otherwise run
    code in this task's pods. ``weights_only=False`` unpickles anything, for checkpoints you trust (or allow-list
    classes with ``torch.serialization.add_safe_globals``).
    """
    found = _latest_of_kind(uri, KIND_STATE)
    if found is None:
        return None
    import torch

    store = Store(found.uri)
    with store.open(store.path(STATE_FILE), "rb") as handle:
        state = torch.load(handle, map_location=map_location, weights_only=weights_only)
    return Loaded(step=found.step, state=state, uri=found.uri)


def _latest_of_kind(uri: str | None, kind: str) -> Checkpoint | None:
    found = latest_in(Store(_location(uri)), kind)
    if found is None and uri is None:  # this task's own location is empty: perhaps resume_from names another run's
        other = resume_location(lambda location: _committed_at(latest_in(Store(location), kind)))
        found = latest_in(Store(other), kind) if other is not None else None
    return found


def _committed_at(found: Checkpoint | None) -> float | None:
    return found.committed_at if found is not None else None


def resume_location(newest: Callable[[str], float | None] | None = None) -> str | None:
    """Where this try resumes from when the task's own location has no checkpoint and the task was given
    ``resume_from=`` (the run context's ``resume_from``): the same task instance's location in that run, or, for
    ``"latest"``, in the earlier run whose newest checkpoint is the newest. None without ``resume_from``, or when no
    such run has a checkpoint.

    ``newest(location)`` says when the newest checkpoint at a location was written (a timestamp), or None when it has
    none; by default, the newest complete checkpoint of any kind there (the integrations pass their own test: a
    sub-folder, a framework's own file).
    """
    from airflow_provider_torchelastic.core.run_context import RESUME_LATEST, other_run_location, runs_folder
    from airflow_provider_torchelastic.worker.context import current

    ctx = current()
    if ctx.resume_from is None or ctx.checkpoint_uri is None:
        return None
    newest = newest or (lambda location: _committed_at(latest_in(Store(location))))
    if ctx.resume_from != RESUME_LATEST:
        location = other_run_location(
            ctx.checkpoint_uri, run_id=ctx.resume_from, task_id=ctx.task_id, map_index=ctx.map_index
        )
        return location if newest(location) is not None else None
    own = ctx.checkpoint_uri.rstrip("/")
    runs = Store(runs_folder(own))
    best: tuple[float, str] | None = None
    for run in runs.children():
        location = "/".join([runs.url, run, *own.rsplit("/", 2)[1:]])
        if location == own:
            continue
        when = newest(location)
        if when is not None and (best is None or when > best[0]):
            best = (when, location)
    if best is not None:
        _log.info("resume_from='latest': resuming from %s", best[1])
    return best[1] if best is not None else None


# --- sharded: torch.distributed.checkpoint, every rank writes its shard --------------------------------------------


def _dcp_writer(store: Store, folder: str) -> Any:
    if store.fs is None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        return FileSystemWriter(store.path(folder))
    # torch keeps its fsspec writer in a private module (it is not exported); fsspec is needed only here.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(store.url_of(folder))


def _dcp_reader(store: Store) -> Any:
    # The metadata is a pickle anyone who can write under the root could have planted: only DCP's types load.
    from airflow_provider_torchelastic.worker.dcp_safe import reader_for

    if store.fs is None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        return reader_for(FileSystemReader)(store.root)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return reader_for(FsspecReader)(store.url)


def save_sharded(state_dict: dict[str, Any], *, step: int, uri: str | None = None) -> Checkpoint:
    """Every rank calls this: ``torch.distributed.checkpoint.save`` writes each rank's shard into one new folder,
    then rank 0 writes the commit marker once all shards and DCP's metadata are written. Needs the process group.
    """
    step = _check_step(step)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    store = Store(_location(uri))
    # One folder for all ranks: rank 0 draws its token and the others receive it.
    token = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    folder = f"step-{step:012d}-{token[0]}"
    if dist.get_rank() == 0:
        store.makedirs(store.path(folder))
    dist.barrier()
    dcp_save(state_dict, storage_writer=_dcp_writer(store, folder))  # returns once every rank wrote and metadata is in
    committed: list[Checkpoint | None] = [
        _commit(store, folder, step=step, kind=KIND_SHARDED) if dist.get_rank() == 0 else None
    ]
    # Nobody goes on (and perhaps saves the next step, or ends the job) before the marker is in place.
    dist.broadcast_object_list(committed, src=0)
    if committed[0] is None:  # pragma: no cover - rank 0 always sends its commit
        raise RuntimeError(f"save_sharded: rank 0 did not commit {store.url_of(folder)}")
    return committed[0]


def load_sharded_latest(state_dict: dict[str, Any], *, uri: str | None = None, weights_only: bool = True) -> int | None:
    """Every rank calls this: loads the latest complete sharded checkpoint into ``state_dict`` in place (DCP
    reshards it to this run's world size) and returns its step, or None (``state_dict`` untouched) when there is none.

    The checkpoint's metadata loads only DCP's own types, and its non-tensor values with ``torch.load(weights_only=
    True)``: plain data, not arbitrary objects (``weights_only=False`` for objects you trust the checkpoint's writer
    with, as ``load_latest`` does). Metadata naming anything else fails as
    :class:`~.dcp_safe.CheckpointMetadataError`, inside DCP's ``CheckpointException``.
    """
    found = _latest_of_kind(uri, KIND_SHARDED)
    if found is None:
        return None
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from airflow_provider_torchelastic.worker.dcp_safe import restricted_planner

    dcp_load(
        state_dict,
        storage_reader=_dcp_reader(Store(found.uri)),
        planner=restricted_planner(weights_only=weights_only),
    )
    return found.step
