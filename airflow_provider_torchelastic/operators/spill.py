"""The payload of a try, with arguments too large for it spilled to artifact storage (issue 23, item 3).

The payload reaches the pods in a Secret, which holds at most 1 MiB; local execution applies the same limit, so that
a task behaves the same wherever it runs. Over it, and with ``[torch_elastic] artifact_storage`` (or
``result_storage``) set, the Airflow worker writes the arguments under the try's artifact location: tensors, arrays
and state dicts as safetensors files, the rest as one pickle (``arguments/arguments.pkl``). The payload then carries
the pickle's reference and sha256; each runner checks the sha256 before it unpickles anything, and the workers load
the tensors back before the function runs. Spilled arguments are kept with the try's other artifacts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import IO, Any, Final

from airflow_provider_torchelastic.core.payload import dump_payload
from airflow_provider_torchelastic.core.run_context import TaskContext
from airflow_provider_torchelastic.kubernetes.pod_template import MAX_SECRET_BYTES, PAYLOAD_KEY
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
) -> bytes:
    """The try's payload: as :func:`dump_payload` writes it, with the arguments spilled when it would be too large
    and the try has an artifact location (without one, a payload too large fails where it is submitted).

    ``open_write``: opens each spilled file's URL for writing; by default ``ObjectStoragePath`` with the artifact
    storage's connection (the dry run passes one that writes nothing)."""
    if storage is None or task_context.artifact_uri is None:
        return dump_payload(fn, args, kwargs)
    from airflow_provider_torchelastic.worker.artifacts import spill_arguments

    opener = open_write if open_write is not None else _writer(storage.conn_id)
    spill = spill_arguments(f"{task_context.artifact_uri}/{ARGUMENTS_FOLDER}", open_write=opener)
    return dump_payload(fn, args, kwargs, max_bytes=MAX_PAYLOAD_BYTES, spill=spill)


def _writer(conn_id: str | None) -> Callable[[str], IO[bytes]]:
    """Opens a URL for writing with Airflow's ``ObjectStoragePath`` and the artifact storage's connection."""

    def open_url(url: str) -> IO[bytes]:
        from airflow.sdk import ObjectStoragePath

        path = ObjectStoragePath(url if "://" in url else f"file://{url}", conn_id=conn_id)
        if path.protocol in ("file", "local"):
            path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("wb")  # type: ignore[no-any-return]

    return open_url
