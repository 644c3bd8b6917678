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
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from airflow_provider_torchelastic.core.encoding import loads_untrusted
from airflow_provider_torchelastic.core.validation import finite_float, short_repr

__all__ = [
    "COMMIT_MARKER",
    "Checkpoint",
    "Loaded",
    "NoCheckpointLocationError",
    "latest",
    "load_latest",
    "load_sharded_latest",
    "save",
    "save_sharded",
]

#: Written last into a checkpoint's folder: the folder is complete exactly when this file exists.
COMMIT_MARKER: Final = "COMMITTED"
#: The file of a rank-0 checkpoint (``torch.save``).
STATE_FILE: Final = "state.pt"
KIND_STATE: Final = "torch.save"
KIND_SHARDED: Final = "torch.distributed.checkpoint"
_FOLDER = re.compile(r"^step-(\d{12})-([A-Za-z0-9]+)\Z")
#: A marker is a few dozen bytes of JSON; a larger one is not ours, and is not parsed.
_MAX_MARKER_BYTES: Final = 64 * 1024

_log = logging.getLogger(__name__)


class NoCheckpointLocationError(RuntimeError):
    """No checkpoint location: neither ``uri=`` nor a run context with one ([torch_elastic] checkpoint_root or the
    task's ``checkpoint_uri``)."""


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A complete checkpoint: its step, its folder's URL and how it was written."""

    step: int
    uri: str
    kind: str
    committed_at: float


@dataclass(frozen=True, kw_only=True)
class Loaded:
    step: int
    state: Any
    uri: str


# --- the store: a local folder, or fsspec for anything else ----------------------------------------------------------


class _Store:
    """The few file operations a checkpoint needs, on a local folder or (lazily) an fsspec file system."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        local = _local_path(url)
        self.local = local
        self.fs: Any = None
        self.root = str(local) if local is not None else ""
        if local is None:
            try:
                import fsspec
            except ImportError:
                raise ImportError(
                    f"{url!r}: a location other than a path or file:// needs fsspec and the store's file system "
                    "(pip install 'airflow-provider-torchelastic[storage]', or the image's STORAGE build argument)"
                ) from None
            self.fs, self.root = fsspec.core.url_to_fs(url)
            self.root = self.root.rstrip("/")

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def makedirs(self, path: str) -> None:
        if self.fs is None:
            Path(path).mkdir(parents=True, exist_ok=True)
        else:  # object stores have no folders; a local fsspec file system does
            self.fs.makedirs(path, exist_ok=True)

    @contextmanager
    def open(self, path: str, mode: str) -> Iterator[IO[Any]]:
        if self.fs is None:
            # A local root may be shared with other tries' pods: no link below it is followed, only a regular file
            # is read, and a write replaces its file whole (core/safe_files.py); PermissionError names what is not.
            from airflow_provider_torchelastic.core.safe_files import open_regular, open_replacing

            if "w" in mode:
                with open_replacing(path, root=self.root, error=PermissionError) as handle:
                    yield handle
            else:
                with open_regular(path, root=self.root, error=PermissionError) as handle:
                    yield handle
        else:
            with self.fs.open(path, mode) as handle:
                yield handle

    def exists(self, path: str) -> bool:
        return Path(path).exists() if self.fs is None else bool(self.fs.exists(path))

    def children(self) -> list[str]:
        """The names directly under the root; none when it does not exist yet."""
        if self.fs is None:
            root = Path(self.root)
            return sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def remove(self, path: str) -> None:
        if self.fs is None:
            shutil.rmtree(path, ignore_errors=True)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def _local_path(url: str) -> Path | None:
    if url.startswith("file://"):
        return Path(url[len("file://") :])
    if "://" in url or "::" in url:
        return None
    return Path(url)


def open_store(url: str) -> _Store:
    return _Store(url)


def write_bytes(url: str, data: bytes) -> None:
    """Write one file at ``url`` (a path, ``file://`` or an fsspec URL), creating its folder where there are folders."""
    folder, _, name = url.rstrip("/").rpartition("/")
    store = _Store(folder)
    store.makedirs(store.root)
    with store.open(store.path(name), "wb") as handle:
        handle.write(data)


def read_bytes(url: str) -> bytes:
    folder, _, name = url.rstrip("/").rpartition("/")
    store = _Store(folder)
    with store.open(store.path(name), "rb") as handle:
        return bytes(handle.read())


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


def _read_marker(store: _Store, name: str, step: int) -> Checkpoint | None:
    """The checkpoint whose marker is in folder ``name``, or None: without a marker it is a save that never finished;
    with one that is not ours (not JSON, or fields of the wrong type) it is not a checkpoint either, and is logged.
    Never an exception for a marker's contents: whoever can write under the root could block every resume."""
    try:
        with store.open(store.path(name, COMMIT_MARKER), "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None
    except (IsADirectoryError, NotADirectoryError, PermissionError):
        # A folder named COMMITTED, a file named like a checkpoint, a link or a FIFO planted as the marker.
        data = b""
    record = loads_untrusted(data, max_bytes=_MAX_MARKER_BYTES)
    kind = record.get("kind", KIND_STATE) if isinstance(record, dict) else None
    committed_at = finite_float(record.get("committed_at", 0.0)) if isinstance(record, dict) else None
    if not isinstance(kind, str) or committed_at is None:
        _log.warning(
            "checkpoint %s: its %s marker is not one this package writes (%s), so the folder is not taken as a "
            "checkpoint; delete it, or the marker, if it is not meant to be one",
            store.url_of(name),
            COMMIT_MARKER,
            short_repr(record if record is not None else data[:200]),
        )
        return None
    return Checkpoint(step=step, uri=store.url_of(name), kind=kind, committed_at=committed_at)


def _latest_in(store: _Store, kind: str | None = None) -> Checkpoint | None:
    """The complete checkpoint (of ``kind``, or any) with the highest step; of a step saved twice, the later commit.

    Markers are read from the highest step down and the search stops at the first step with a complete one, so a
    location with a thousand checkpoints costs one listing and a read or two, not a thousand reads.
    """
    by_step: dict[int, list[str]] = {}
    for name in store.children():
        match = _FOLDER.match(name)
        if match:
            by_step.setdefault(int(match.group(1)), []).append(name)
    for step in sorted(by_step, reverse=True):
        found = [c for name in by_step[step] if (c := _read_marker(store, name, step)) is not None]
        found = [c for c in found if kind is None or c.kind == kind]
        if found:
            return max(found, key=lambda c: c.committed_at)
    return None


def latest(uri: str | None = None) -> Checkpoint | None:
    """The complete checkpoint with the highest step (the later-committed one of a step saved twice), or None."""
    return _latest_in(_Store(_location(uri)))


# --- saving ----------------------------------------------------------------------------------------------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12:
        raise ValueError(f"step: expected an int in [0, 10**12), got {step!r}")
    return step


def _commit(store: _Store, folder: str, *, step: int, kind: str) -> Checkpoint:
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


def save(state: Any, *, step: int, uri: str | None = None) -> Checkpoint | None:
    """Rank 0 writes ``state`` with ``torch.save`` as the checkpoint of ``step``; other ranks return None at once.

    Returns the committed checkpoint. The state is written first and the commit marker last, so a save killed
    midway is never found by :func:`latest`.
    """
    step = _check_step(step)
    if _rank() != 0:
        return None
    import torch

    store = _Store(_location(uri))
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

    store = _Store(found.uri)
    with store.open(store.path(STATE_FILE), "rb") as handle:
        state = torch.load(handle, map_location=map_location, weights_only=weights_only)
    return Loaded(step=found.step, state=state, uri=found.uri)


def _latest_of_kind(uri: str | None, kind: str) -> Checkpoint | None:
    return _latest_in(_Store(_location(uri)), kind)


# --- sharded: torch.distributed.checkpoint, every rank writes its shard --------------------------------------------


def _dcp_writer(store: _Store, folder: str) -> Any:
    if store.fs is None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        return FileSystemWriter(store.path(folder))
    # torch keeps its fsspec writer in a private module (it is not exported); fsspec is needed only here.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(store.url_of(folder))


def _dcp_reader(store: _Store) -> Any:
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

    store = _Store(_location(uri))
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
        storage_reader=_dcp_reader(_Store(found.uri)),
        planner=restricted_planner(weights_only=weights_only),
    )
    return found.step
