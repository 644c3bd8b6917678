"""Files of a local store (a plain path or a ``file://`` URL), opened without following a symbolic link below the
store's root (issue 34, item 2).

Results, artifacts, checkpoints and spilled arguments may live on a shared file system, which the pods of other tries
(and of other tenants) can write. A planted symbolic link would turn a read into a read of whatever it points at (a
file only the Airflow worker may read becomes the task's XCom; ``/dev/zero`` is hashed forever), and a write into a
write there. So, below the store's root:

- each folder is opened relative to the one above it with ``O_NOFOLLOW``: no component can be a link, and none can
  be swapped for one between a check and the open (as it could between a real-path check and an open by path);
- a file is read only when it is a regular file: ``lstat`` before the open (a FIFO, a device or a link is never
  opened), ``O_NOFOLLOW | O_NONBLOCK`` for the open (a link or FIFO swapped in meanwhile fails it, or cannot block
  it), ``fstat`` after it (the same inode);
- a file is written to a new temporary file beside it, renamed over its name when complete: whatever sat at the
  name is replaced, never written through, and a half-written file never takes the name.

The root itself is followed: it is the platform's configuration, not the pods'. A caller that does not know the root
(a loader handed a reference) passes none: the file's own folder is the root then, and only the last component is
guarded (the reference's sha256 checks the bytes).

Standard library only, POSIX (``O_NOFOLLOW``, ``dir_fd``): the Airflow side, the runner and the workers share it.
What is refused raises ``error(message)``, of the caller's own class, the message naming the path and what is wrong;
any other ``OSError`` (a missing file, say) passes through as it is.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final

__all__ = [
    "ErrorFactory",
    "local_path",
    "open_regular",
    "open_replacing",
    "read_regular",
    "remove_file",
]

#: Makes the exception a refusal raises, of the caller's own class, from a message.
ErrorFactory = Callable[[str], Exception]

_FOLDER_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK_BYTES: Final = 8 << 20
_KINDS: Final = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def local_path(url: str) -> Path | None:
    """The path of a local store's URL: a plain path, ``file://`` or ``local://`` (fsspec's names for the local file
    system); None for any other URL (``s3://``, a chained ``simplecache::s3://``)."""
    for scheme in ("file://", "local://"):
        if url.startswith(scheme):
            return Path(url[len(scheme) :])
    return None if "://" in url or "::" in url else Path(url)


def open_regular(
    path: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    max_bytes: int | None = None,
    error: ErrorFactory,
) -> io.FileIO:
    """``path``, a regular file under ``root`` reached through no symbolic link, opened for reading (unbuffered, so
    that a reader can fill its own memory); refused when it is larger than ``max_bytes``, before a byte is read."""
    folder, where, name = _open_parent(path, root, error, create=False)
    try:
        before = os.stat(name, dir_fd=folder, follow_symlinks=False)
        _require_regular(where, before, error, "read")
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=folder)
        except OSError as e:
            if e.errno == errno.ELOOP:  # made a link since the lstat
                raise error(f"{where} is a symbolic link: refusing to read through it") from None
            raise
    finally:
        os.close(folder)
    try:
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != (before.st_dev, before.st_ino):
            raise error(f"{where} was replaced while it was opened: refusing to read it")
        if max_bytes is not None and found.st_size > max_bytes:
            raise error(f"{where} is {found.st_size} bytes, more than the {max_bytes} allowed: refusing to read it")
        os.set_blocking(fd, True)
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def read_regular(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None, limit: int, error: ErrorFactory
) -> bytes:
    """The bytes of ``path`` (as :func:`open_regular` opens it), at most ``limit`` of them: a caller that must tell a
    file too large passes one more than it accepts. Read once, so that what a caller hashes is what it uses."""
    with open_regular(path, root=root, error=error) as handle:
        size = os.fstat(handle.fileno()).st_size
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            # First fstat's size and one byte more (a file that grew since shows it): usually all of it in one read,
            # and then no copy is made.
            chunk = handle.read(min(left, size + 1 if not chunks else _CHUNK_BYTES))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def open_replacing(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None, error: ErrorFactory
) -> IO[bytes]:
    """``path`` under ``root`` opened for writing: its folders made one by one below ``root`` (``root`` itself as
    ``os.makedirs`` makes it), none of them a symbolic link; the bytes go to a temporary file beside it, which takes
    the name when closed (and is removed instead when the ``with`` block raises). Refused when the name is taken by
    anything but a regular file."""
    folder, where, name = _open_parent(path, root, error, create=True)
    try:
        try:
            found: os.stat_result | None = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            found = None
        if found is not None:
            _require_regular(where, found, error, "write")
        temporary = f".{name[:100]}.{secrets.token_hex(8)}.tmp"
        fd = os.open(temporary, _NEW_FLAGS, 0o666, dir_fd=folder)
    except BaseException:
        os.close(folder)
        raise
    return _Replacing(io.FileIO(fd, "wb", closefd=True), folder, temporary, name)


def remove_file(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None, error: ErrorFactory
) -> None:
    """Remove ``path`` under ``root`` (a link is removed, never what it points at); nothing when it is gone."""
    folder, _, name = _open_parent(path, root, error, create=False)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=folder)
    finally:
        os.close(folder)


class _Replacing(io.BufferedWriter):
    """Buffered writes to a temporary file, renamed over the file's name when closed; removed instead when its
    ``with`` block raises, or when it is collected unclosed."""

    def __init__(self, raw: io.FileIO, folder: int, temporary: str, name: str) -> None:
        self._folder, self._temporary, self._name, self._settled = folder, temporary, name, False
        super().__init__(raw, buffer_size=_CHUNK_BYTES)

    def close(self) -> None:
        if self._settled:
            return
        self._settled = True
        try:
            super().close()
            # rename(2) replaces a link at the name itself, never its target.
            os.replace(self._temporary, self._name, src_dir_fd=self._folder, dst_dir_fd=self._folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self._temporary, dir_fd=self._folder)
            raise
        finally:
            os.close(self._folder)

    def discard(self) -> None:
        if self._settled:
            return
        self._settled = True
        try:
            with contextlib.suppress(OSError):
                super().close()
            with contextlib.suppress(OSError):
                os.unlink(self._temporary, dir_fd=self._folder)
        finally:
            os.close(self._folder)

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()

    def __del__(self) -> None:
        # IOBase's finalizer would close(), and so rename a file that was never finished.
        if hasattr(self, "_settled"):
            self.discard()


def _open_parent(
    path: str | os.PathLike[str], root: str | os.PathLike[str] | None, error: ErrorFactory, *, create: bool
) -> tuple[int, Path, str]:
    """A descriptor of the folder ``path`` is in, reached from ``root`` one folder at a time, none of them followed
    if a link; the path to name in messages; and the file's name in that folder."""
    top, folders, name = _split_under(Path(path), None if root is None else Path(root), error)
    if create:
        os.makedirs(top, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = top
    try:
        for folder in folders:
            where = where / folder
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, dir_fd=fd)
            try:
                child = os.open(folder, _FOLDER_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                found = os.stat(folder, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(found.st_mode):
                    raise error(f"{where} is a symbolic link: refusing to follow it below the store's root") from None
                raise error(f"{where} is not a folder ({_kind(found)}): refusing to use it") from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd, where / name, name


def _split_under(path: Path, root: Path | None, error: ErrorFactory) -> tuple[Path, Sequence[str], str]:
    """The root, the folders from it to ``path``'s, and ``path``'s name; refused when ``path`` is not below root."""
    base = path.parent if root is None else root
    if ".." in path.parts or not path.name:
        # ".." after a link leads where the link does, not where the text seems to: never resolved by hand.
        raise error(f"{path} resolves outside the store's root {base}: it has a '..' component or no file name")
    if root is None:
        return base, (), path.name
    top, parts = Path(os.path.abspath(root)), Path(os.path.abspath(path)).parts
    if len(parts) <= len(top.parts) or parts[: len(top.parts)] != top.parts:
        raise error(f"{path} resolves outside the store's root {root}: refusing it")
    return top, parts[len(top.parts) : -1], parts[-1]


def _require_regular(where: Path, found: os.stat_result, error: ErrorFactory, verb: str) -> None:
    if stat.S_ISLNK(found.st_mode):
        raise error(f"{where} is a symbolic link: refusing to {verb} through it")
    if not stat.S_ISREG(found.st_mode):
        raise error(f"{where} is not a regular file ({_kind(found)}): refusing to {verb} it")


def _kind(found: os.stat_result) -> str:
    return next((name for test, name in _KINDS if test(found.st_mode)), "of an unknown kind")
