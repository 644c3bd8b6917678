"""The payload of a try, with arguments too large for it spilled to artifact storage (issue 23, item 3).

The payload reaches the pods in a Secret, which holds at most 1 MiB; local execution applies the same limit, so that
a task behaves the same wherever it runs. Over it, and with ``[torch_elastic] artifact_storage`` (or
``result_storage``) set, the Airflow worker writes the arguments under the try's artifact location: tensors, arrays
and state dicts as safetensors files, the rest as one pickle (``arguments/arguments.pkl``). The payload then carries
the pickle's reference and sha256; each runner checks the sha256 before it unpickles anything, and the workers load
the tensors back before the function runs. Spilled arguments are kept with the try's other artifacts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import IO, Any, Final

from airflow_provider_torchelastic.core.artifact_ref import ArtifactRefError, pin_argument_refs
from airflow_provider_torchelastic.core.payload import dump_payload
from airflow_provider_torchelastic.core.run_context import TaskContext
from airflow_provider_torchelastic.core.safe_files import local_path, open_replacing
from airflow_provider_torchelastic.kubernetes.pod_template import MAX_SECRET_BYTES, PAYLOAD_KEY
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
from airflow_provider_torchelastic.settings import ArtifactStorage

__all__ = ["MAX_PAYLOAD_BYTES", "dump_try_payload"]

#: The largest payload that fits in the payload Secret (its key counts against the limit too).
MAX_PAYLOAD_BYTES: Final = MAX_SECRET_BYTES - len(PAYLOAD_KEY)
ARGUMENTS_FOLDER: Final = "arguments"


def dump_try_payload(
    fn: Callable[..., Any],
    args: Collection[Any],
    kwargs: Mapping[str, Any],
    *,
    storage: ArtifactStorage | None,
    task_context: TaskContext,
    open_write: Callable[[str], IO[bytes]] | None = None,
    trusted_roots: Sequence[str] = (),
    allow_pickles: bool = False,
) -> bytes:
    """The try's payload: as :func:`dump_payload` writes it, with the arguments spilled when it would be too large
    and the try has an artifact location (without one, a payload too large fails where it is submitted).

    ``open_write``: opens each spilled file's URL for writing; by default ``ObjectStoragePath`` with the artifact
    storage's connection (the dry run passes one that writes nothing).

    The artifact references in the arguments are pinned first (:func:`~.artifact_ref.pin_argument_refs`): only
    those under the artifact storage or ``trusted_roots``, pickled modules only with ``allow_pickles``; any other
    fails the try as a :class:`~.exceptions.ConfigurationError` naming where it was."""
    roots = ([storage.url] if storage is not None else []) + list(trusted_roots)
    try:
        args, kwargs = pin_argument_refs(tuple(args), dict(kwargs), roots=roots, allow_pickle=allow_pickles)
    except ArtifactRefError as e:
        raise ConfigurationError(f"the task's arguments: {e}") from None
    if storage is None or task_context.artifact_uri is None:
        return dump_payload(fn, args, kwargs)
    from airflow_provider_torchelastic.worker.artifacts import spill_arguments

    opener = open_write if open_write is not None else _writer(storage)
    spill = spill_arguments(f"{task_context.artifact_uri}/{ARGUMENTS_FOLDER}", open_write=opener)
    return dump_payload(fn, args, kwargs, max_bytes=MAX_PAYLOAD_BYTES, spill=spill)


def _writer(storage: ArtifactStorage) -> Callable[[str], IO[bytes]]:
    """Opens a URL for writing with Airflow's ``ObjectStoragePath`` and the artifact storage's connection; in a local
    store (a path or ``file://``), below the storage's root through no symbolic link (:func:`open_replacing`): the
    pods of earlier tries can write there, and a link one planted at ``.../{try}/artifacts/arguments`` would have
    this try write its arguments wherever the link points."""
    root = local_path(storage.url)

    def open_url(url: str) -> IO[bytes]:
        local = local_path(url)
        if local is not None:
            return open_replacing(local, root=root, error=_refused_spill)
        from airflow.sdk import ObjectStoragePath

        return ObjectStoragePath(url, conn_id=storage.conn_id).open("wb")  # type: ignore[no-any-return]

    return open_url


def _refused_spill(problem: str) -> ConfigurationError:
    return ConfigurationError(
        f"The task's arguments are too large for its payload, and cannot be spilled to the artifact storage: "
        f"{problem} (a retry will not help)"
    )
