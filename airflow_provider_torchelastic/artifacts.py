"""Models and tensors between tasks: load what a torch_elastic task returned.

Rank 0's tensors, numpy arrays, state dicts and Modules travel as artifacts in ``[torch_elastic] artifact_storage``;
the XCom holds plain-JSON references to them. Downstream::

    from airflow_provider_torchelastic import artifacts

    @task
    def evaluate(result):
        loaded = artifacts.load(result)                      # every reference loaded: tensors, arrays, state dicts
        model = artifacts.load(result["model"], into=Net())  # a Module's state dict loaded into an instance

Inside the workers of a downstream ``@task.torch_elastic`` nothing needs calling: the references in its arguments
are loaded before the function runs, on every rank. The implementation is
:mod:`airflow_provider_torchelastic.worker.artifacts`; this module adds the Airflow side's credentials (the
connection ``[torch_elastic] artifact_storage_conn_id``, else ``result_storage_conn_id``). torch, numpy and
safetensors are imported when an artifact is loaded, never when this module is.
"""

from __future__ import annotations

import os
from typing import Any

from airflow_provider_torchelastic.core.artifact_ref import ArtifactRefError
from airflow_provider_torchelastic.core.run_context import CONTEXT_ENV

# Standard library only at import (torch, numpy and safetensors are imported when an artifact is read).
from airflow_provider_torchelastic.worker.artifacts import ArtifactIntegrityError, PickledModule

__all__ = ["ArtifactIntegrityError", "ArtifactRefError", "PickledModule", "load", "pickled"]


def load(value: Any, *, into: Any = None, strict: bool = True, allow_pickle: bool = False) -> Any:
    """``value`` with every artifact reference in it loaded, each fetched on its own and verified against its
    sha256 before it is read (:class:`ArtifactIntegrityError` otherwise): tensors and arrays come back as
    themselves, a state dict as a dict of tensors, a Module as its state dict.

    ``into``: a Module to load the reference ``value`` (a Module's or a state dict's) into
    (``load_state_dict(strict=strict)``); returns that module. ``allow_pickle``: load modules that travelled whole
    (:func:`pickled`), which runs their pickle's code: only for artifacts you trust.

    On an Airflow worker, URLs other than local paths are opened with Airflow's ``ObjectStoragePath`` and the
    connection ``[torch_elastic] artifact_storage_conn_id`` (else ``result_storage_conn_id``); in the workers of a
    torch_elastic task, with fsspec and the workers' own credentials.
    """
    from airflow_provider_torchelastic.worker import artifacts

    return artifacts.load(value, into=into, strict=strict, allow_pickle=allow_pickle, locate=_airflow_locator())


def pickled(module: Any) -> PickledModule:
    """Mark a Module in rank 0's value to travel whole (``torch.save``), not as its state dict: opt-in, because
    loading it unpickles (see :func:`load`'s ``allow_pickle``)."""
    from airflow_provider_torchelastic.worker import artifacts

    return artifacts.pickled(module)


def _airflow_locator() -> Any:
    """Finds URLs with the artifact storage's connection, on an Airflow worker; None elsewhere (the workers of a
    torch_elastic task, or where Airflow is not installed): fsspec with the environment's credentials."""
    if os.environ.get(CONTEXT_ENV):
        return None
    try:
        from airflow.sdk import ObjectStoragePath
    except ImportError:
        return None
    from airflow_provider_torchelastic.settings import read_artifact_storage

    storage = read_artifact_storage()
    conn_id = storage.conn_id if storage is not None else None

    def locate(url: str) -> tuple[Any, str]:
        path = ObjectStoragePath(url if "://" in url else f"file://{url}", conn_id=conn_id)
        return path.fs, path.path

    return locate
