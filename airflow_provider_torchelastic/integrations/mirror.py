"""A local checkpoint folder kept in the task's checkpoint location, for frameworks that write local paths only (the
Hugging Face ``Trainer``, ``accelerate``'s ``save_state``).

The framework saves its checkpoints as sub-folders of one local folder (``checkpoint-40/``); :class:`FolderMirror`

- **restores** the folder when the try starts: every complete checkpoint of the location is copied in, and a local
  sub-folder the location does not hold complete (a previous try's torn save on the same disk) is removed, so the
  framework's own "resume from the newest local checkpoint" finds exactly the newest complete one;
- **publishes** each save: every rank uploads the files it wrote (a rank's own file is named by a pattern, such as
  ``rng_state_3.pth``; the others are rank 0's), all ranks meet at a barrier, and rank 0 writes one commit marker,
  with the checkpoint module's protocol (:func:`~airflow_provider_torchelastic.worker.checkpoint.commit`): a try
  killed mid-copy leaves a folder without a marker, never taken, and the previous checkpoint stays the newest;
- **mirrors deletions**: after the commit, a checkpoint that is no longer in the local folder (the framework rotated
  it out, ``save_total_limit``) is deleted from the location too.

Location layout: ``{location}/step-<step>-<token>/<sub-folder name>/<files>`` and ``COMMITTED`` beside the
sub-folder. Local files are read and written with :mod:`~airflow_provider_torchelastic.core.safe_files` (no link
below the folder is followed; a file is replaced whole). Collectives (a barrier, one broadcast) use the process group
the framework set up; without one it is a single process's mirror.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from airflow_provider_torchelastic.core.safe_files import open_regular, open_replacing
from airflow_provider_torchelastic.integrations.common import (
    barrier,
    broadcast_from_rank_0,
    checkpoint_location,
    resume_subfolder,
)
from airflow_provider_torchelastic.worker import checkpoint
from airflow_provider_torchelastic.worker.checkpoint_store import open_store
from airflow_provider_torchelastic.worker.liveness import heartbeat

__all__ = ["FolderMirror", "MirrorLayout"]

_COPY_CHUNK = 8 << 20


class FolderMirror:
    """A local folder whose checkpoint sub-folders are restored from, and published to, ``location``.

    :param local: the framework's folder (per node: the ranks of one node share it, nodes do not).
    :param location: the checkpoint location (a path or fsspec URL); None keeps everything local.
    :param kind: the kind written into each commit marker (this mirror finds only its own kind).
    :param managed: the names of the sub-folders that are checkpoints (``checkpoint-\\d+``): only those are restored,
        published or removed.
    :param rank_file: a file name pattern whose first group is the rank that wrote the file; every other file is
        rank 0's.
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        location: str | None,
        *,
        kind: str,
        managed: re.Pattern[str],
        rank_file: re.Pattern[str],
        resume_from: Callable[[], str | None] | None = None,
    ) -> None:
        self.local = Path(os.path.abspath(local))
        self.location = location.rstrip("/") if location else None
        self.kind = kind
        self.managed = managed
        self.rank_file = rank_file
        self.resume_from = resume_from

    # --- restore -------------------------------------------------------------------------------------------------

    def remote_checkpoints(self, location: str | None = None) -> dict[str, checkpoint.Checkpoint]:
        """Each complete sub-folder in the location (or ``location``) by name (of a name committed twice, the later
        commit)."""
        location = location or self.location
        if location is None:
            return {}
        found: dict[str, checkpoint.Checkpoint] = {}
        for committed in checkpoint.complete(location, kind=self.kind):  # by step, then commit time
            for name in open_store(committed.uri).children():
                if self.managed.fullmatch(name):
                    found[name] = committed
        return found

    def restore(self) -> list[str]:
        """Make the local folder hold exactly the location's complete checkpoints (one copier per node, then a
        barrier): returns their names. When the location has none, ``resume_from()`` may name another (an earlier
        run's: the task's ``resume_from=``), read but never written. Without a location the local folder is left as
        it is."""
        if self.location is None:
            return []
        remote = self.remote_checkpoints()
        if not remote and self.resume_from is not None:
            other = self.resume_from()
            remote = self.remote_checkpoints(other) if other is not None else {}
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            self.local.mkdir(parents=True, exist_ok=True)
            for entry in self.local.iterdir():
                if self.managed.fullmatch(entry.name) and entry.name not in remote:
                    _remove(entry)  # a torn or foreign save: never resumed from
            for name, committed in remote.items():
                _remove(self.local / name)  # copied whole: a partial local copy is never trusted
                store = open_store(committed.uri)
                for relative in store.files(store.path(name)):
                    with (
                        store.open(store.path(name, relative), "rb") as source,
                        open_replacing(self.local / name / relative, root=self.local, error=PermissionError) as target,
                    ):
                        _copy(source, target)
        barrier()
        return sorted(remote)

    # --- publish -------------------------------------------------------------------------------------------------

    def _owner(self, relative: str) -> int:
        match = self.rank_file.fullmatch(relative.rsplit("/", 1)[-1])
        return int(match.group(1)) if match else 0

    def publish(self, name: str, *, step: int) -> checkpoint.Checkpoint | None:
        """Every rank calls this after the framework saved ``<local>/<name>``: each uploads its own files, then rank 0
        commits once everyone is done, and deletes from the location what the local folder no longer holds. Returns
        the committed checkpoint (on every rank), or None without a location."""
        if self.location is None:
            return None
        rank = int(os.environ.get("RANK", "0"))
        folder = checkpoint.folder_name(step, broadcast_from_rank_0(uuid.uuid4().hex[:12]))
        store = open_store(f"{self.location}/{folder}")
        source = self.local / name
        for relative in _local_files(source):
            if self._owner(relative) != rank:
                continue
            with (
                open_regular(source / relative, root=self.local, error=PermissionError) as handle,
                store.open(store.path(name, relative), "wb") as target,
            ):
                _copy(handle, target)
            heartbeat()
        barrier()  # every rank's files are in
        committed = None
        if rank == 0:
            committed = checkpoint.commit(store.url, step=step, kind=self.kind)
            self._prune(keep=committed)
        # Nobody goes on (and perhaps fails the try, which stops rank 0) before the marker is in place.
        result: checkpoint.Checkpoint | None = broadcast_from_rank_0(committed)
        return result

    def _prune(self, *, keep: checkpoint.Checkpoint) -> None:
        """Delete the location's checkpoints that the local folder no longer holds, and older copies of a name."""
        assert self.location is not None
        newest = self.remote_checkpoints()
        root = open_store(self.location)
        for committed in checkpoint.complete(self.location, kind=self.kind):
            if committed.uri == keep.uri:
                continue
            names = [n for n in open_store(committed.uri).children() if self.managed.fullmatch(n)]
            stale = all(not (self.local / n).is_dir() or newest.get(n) != committed for n in names)
            if stale:
                # The marker goes first: a prune cut short leaves an incomplete folder, never a half checkpoint.
                folder = committed.uri.rstrip("/").rsplit("/", 1)[-1]
                marker = root.path(folder, checkpoint.COMMIT_MARKER)
                if root.fs is None:
                    Path(marker).unlink(missing_ok=True)
                else:
                    root.fs.rm(marker)
                root.remove(root.path(folder))


def _local_files(folder: Path) -> list[str]:
    found = []
    for parent, _, names in os.walk(folder):
        for name in names:
            path = Path(parent) / name
            if path.is_file() and not path.is_symlink():
                found.append(path.relative_to(folder).as_posix())
    return sorted(found)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _copy(source: IO[bytes], target: IO[bytes]) -> None:
    shutil.copyfileobj(source, target, _COPY_CHUNK)


@dataclass(frozen=True)
class MirrorLayout:
    """What one framework saves into its local folder, and where the task keeps it: what an integration declares
    once to get its :class:`FolderMirror`."""

    #: The kind written into each commit marker.
    kind: str
    #: The sub-folder of the task's checkpoint location.
    subfolder: str
    #: The names of the sub-folders that are checkpoints; the first group is the step.
    managed: re.Pattern[str]
    #: The file name pattern of the one file each rank writes itself (the first group is its rank).
    rank_file: re.Pattern[str]

    def mirror(self, local: str | os.PathLike[str], location: str | None = None) -> FolderMirror:
        """``local`` kept in ``location``, by default ``{context.current().checkpoint_uri}/{subfolder}``; a try whose
        own location holds none resumes from the run that ``resume_from=`` names."""
        return FolderMirror(
            local,
            location if location is not None else checkpoint_location(self.subfolder),
            kind=self.kind,
            managed=self.managed,
            rank_file=self.rank_file,
            resume_from=lambda: resume_subfolder(self.subfolder, self.kind),
        )
