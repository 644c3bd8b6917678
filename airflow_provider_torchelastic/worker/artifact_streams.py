"""An artifact's bytes, read from its store and checked against its reference (:mod:`.artifacts` makes values of
them): its size before a byte is fetched, its sha256 while the bytes arrive.

Where the store can, the bytes come from one request, streamed (``open_async``: s3fs and the other async file
systems), else from one read per chunk (``fs.open``). Standard library; fsspec is imported only for a URL that
needs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from airflow_provider_torchelastic.core.artifact_ref import ArtifactRef
from airflow_provider_torchelastic.core.safe_files import local_path, open_regular
from airflow_provider_torchelastic.worker.checkpoint_store import open_store
from airflow_provider_torchelastic.worker.safetensors_io import CHUNK_BYTES, HashingReader, Readable

__all__ = [
    "ArtifactIntegrityError",
    "AsyncStream",
    "Locator",
    "check",
    "default_locator",
    "file_digest",
    "local_path",
    "opened",
    "read_verified",
]


class ArtifactIntegrityError(ValueError):
    """An artifact's bytes are not those its reference names (sha256 or size), or its local file is a symbolic link or
    not a regular file: refused, and nothing read from them is returned."""


#: Finds a URL's fsspec file system and path there, with credentials the caller knows (the Airflow side: a
#: connection).
Locator = Callable[[str], tuple[Any, str]]


def default_locator(url: str) -> tuple[Any, str]:
    """fsspec, with the environment's credentials (the workers')."""
    folder, _, name = url.rpartition("/")
    store = open_store(folder)  # says which package a URL needs, if it is missing
    return store.fs, store.path(name)


def file_digest(path: Path, *, max_bytes: int | None = None) -> tuple[int, str]:
    """The size and sha256 of a local regular file (a link, or a FIFO or device that would never end, is refused
    before a byte is read, as is a file over ``max_bytes``)."""
    digest, size = hashlib.sha256(), 0
    with open_regular(path, max_bytes=max_bytes, error=ArtifactIntegrityError) as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def check(ref: ArtifactRef, size: int, digest: str | None) -> None:
    if size != ref.bytes or digest is None or not hmac.compare_digest(digest, ref.sha256):
        found = f"sha256 {digest}, {size} bytes" if digest is not None else f"{size} bytes, not fetched"
        raise ArtifactIntegrityError(
            f"artifact {ref.url} is not the one its reference names ({found}; expected sha256 {ref.sha256}, "
            f"{ref.bytes} bytes): refusing to read it; was it replaced or damaged in the store?"
        )


class AsyncStream:
    """An object's bytes from one request, as they arrive: ``open_async`` (s3fs, and other async file systems)
    streams one GET's body. ``fs.open`` would send a ranged GET per read, and a store may serve each slowly (moto
    reads the whole object for every range: 8 MiB reads took 203 s for 256 MiB, benchmarks/results.md)."""

    def __init__(self, fs: Any, handle: Any) -> None:
        self.fs, self.handle = fs, handle

    def readinto(self, view: memoryview) -> int:
        from fsspec.asyn import sync

        # One trip to the file system's event loop per chunk (8 MiB), however small the pieces that arrive.
        return int(sync(self.fs.loop, self._fill, view))

    async def _fill(self, view: memoryview) -> int:
        filled = 0
        while filled < len(view):
            piece = await self.handle.read(len(view) - filled)
            if not piece:
                break
            view[filled : filled + len(piece)] = piece
            filled += len(piece)
        return filled

    def close(self) -> None:
        from fsspec.asyn import sync

        body = getattr(self.handle, "r", None)  # s3fs: the response, which an unfinished read leaves open
        if body is not None and callable(getattr(body, "close", None)):
            body.close()
        sync(self.fs.loop, self.handle.close)


@contextlib.contextmanager
def opened(ref: ArtifactRef, locate: Locator | None) -> Iterator[Readable]:
    """A stream of the artifact's bytes, from one request where the store can (else a read per chunk), once its
    size is the reference's: an object that is not the reference's is refused before a byte of it is fetched."""
    local = local_path(ref.url)
    if local is not None:
        # A regular file, not a link: the store may be shared with other tries' pods. Unbuffered: read straight into
        # the tensors.
        with open_regular(local, error=ArtifactIntegrityError) as handle:
            check_size(ref, os.fstat(handle.fileno()).st_size)
            yield handle
        return
    fs, path = (locate or default_locator)(ref.url)
    check_size(ref, int(fs.size(path)))
    if getattr(fs, "async_impl", False):
        from fsspec.asyn import sync

        try:
            streamed = sync(fs.loop, fs.open_async, path, "rb")
        except NotImplementedError:  # an async file system without streamed reads
            streamed = None
        if streamed is not None:
            stream = AsyncStream(fs, streamed)
            try:
                yield stream
            finally:
                stream.close()
            return
    with fs.open(path, "rb", cache_type="none") as remote:  # a read per chunk, each one request, nothing cached
        yield remote


def check_size(ref: ArtifactRef, size: int) -> None:
    if size != ref.bytes:
        check(ref, size, None)


def read_verified(ref: ArtifactRef, locate: Locator | None, read: Callable[[HashingReader], Any]) -> Any:
    """What ``read`` makes of the artifact's bytes, hashed while they arrive; returned only when they are the
    reference's (``ArtifactIntegrityError`` else, and what ``read`` made is dropped)."""
    with opened(ref, locate) as stream:
        reader = HashingReader(stream)
        try:
            value = read(reader)
        except (ValueError, EOFError) as e:
            # Not a file of ours: its bytes cannot be the reference's, which our writer wrote.
            raise ArtifactIntegrityError(
                f"artifact {ref.url} is not the one its reference names ({e}): refusing it; was it replaced or "
                "damaged in the store?"
            ) from e
        finally:
            reader.close()
    check(ref, reader.count, reader.hexdigest())
    return value
