"""Where checkpoints are kept, and how a complete one is found there: the store (a local folder, or fsspec for any
other URL), the folder and marker layout, and the search for the latest complete checkpoint.

Below both :mod:`.checkpoint` (saving, loading and resuming, which reads the run context for its default location)
and :mod:`.context` (whose ``RunContext.has_checkpoint`` looks at a location it already knows): neither imports the
other. The artifacts read and write through the same store. Standard library and (lazily) fsspec only.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from airflow_provider_torchelastic.core.encoding import loads_untrusted
from airflow_provider_torchelastic.core.validation import finite_float, short_repr

#: Written last into a checkpoint's folder: the folder is complete exactly when this file exists.
COMMIT_MARKER: Final = "COMMITTED"
#: The file of a rank-0 checkpoint (``torch.save``).
STATE_FILE: Final = "state.pt"
KIND_STATE: Final = "torch.save"
KIND_SHARDED: Final = "torch.distributed.checkpoint"
#: A checkpoint folder's name: ``step-<step, 12 digits>-<token>`` (:func:`.checkpoint.folder_name`).
FOLDER_PATTERN = re.compile(r"^step-(\d{12})-([A-Za-z0-9]+)\Z")
#: A marker is a few dozen bytes of JSON; a larger one is not ours, and is not parsed.
_MAX_MARKER_BYTES: Final = 64 * 1024

#: The checkpoint module's logger, as before the store moved here: what users' logging configuration names.
_log = logging.getLogger("airflow_provider_torchelastic.worker.checkpoint")


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A complete checkpoint: its step, its folder's URL and how it was written."""

    step: int
    uri: str
    kind: str
    committed_at: float


# --- the store: a local folder, or fsspec for anything else ----------------------------------------------------------


class Store:
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

    def files(self, path: str) -> list[str]:
        """The files below ``path``, as paths relative to it (``a/b.bin``), links and other non-files left out;
        none when it does not exist."""
        if self.fs is None:
            top = Path(path)
            found = []
            for folder, _, names in os.walk(top):  # os.walk follows no link to a folder
                for name in names:
                    if (Path(folder) / name).is_file() and not (Path(folder) / name).is_symlink():
                        found.append(str((Path(folder) / name).relative_to(top)))
            return sorted(found)
        try:
            entries = self.fs.find(path, withdirs=False)
        except FileNotFoundError:
            return []
        prefix = path.rstrip("/") + "/"
        return sorted(str(entry)[len(prefix) :] for entry in entries if str(entry).startswith(prefix))

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


def open_store(url: str) -> Store:
    return Store(url)


def write_bytes(url: str, data: bytes) -> None:
    """Write one file at ``url`` (a path, ``file://`` or an fsspec URL), creating its folder where there are folders."""
    folder, _, name = url.rstrip("/").rpartition("/")
    store = Store(folder)
    store.makedirs(store.root)
    with store.open(store.path(name), "wb") as handle:
        handle.write(data)


def read_bytes(url: str) -> bytes:
    folder, _, name = url.rstrip("/").rpartition("/")
    store = Store(folder)
    with store.open(store.path(name), "rb") as handle:
        return bytes(handle.read())


# --- finding ---------------------------------------------------------------------------------------------------------


def read_marker(store: Store, name: str, step: int) -> Checkpoint | None:
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


def latest_in(store: Store, kind: str | None = None) -> Checkpoint | None:
    """The complete checkpoint (of ``kind``, or any) with the highest step; of a step saved twice, the later commit.

    Markers are read from the highest step down and the search stops at the first step with a complete one, so a
    location with a thousand checkpoints costs one listing and a read or two, not a thousand reads.
    """
    by_step: dict[int, list[str]] = {}
    for name in store.children():
        match = FOLDER_PATTERN.match(name)
        if match:
            by_step.setdefault(int(match.group(1)), []).append(name)
    for step in sorted(by_step, reverse=True):
        found = [c for name in by_step[step] if (c := read_marker(store, name, step)) is not None]
        found = [c for c in found if kind is None or c.kind == kind]
        if found:
            return max(found, key=lambda c: c.committed_at)
    return None
