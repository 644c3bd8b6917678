"""Where a try runs, behind one protocol (:mod:`.base`): local execution (:mod:`.local`) and Kubernetes
(:mod:`.kubernetes`), named by :data:`~airflow_provider_torchelastic.core.choices.BACKENDS`.

Nothing here is imported when a DAG file is parsed: the operator asks for its backend when a task runs.
"""

from __future__ import annotations

import importlib

from airflow_provider_torchelastic.core.choices import BACKENDS, executions_expected
from airflow_provider_torchelastic.operators.backends.base import Attempt, Backend, Plan, TaskSpec

__all__ = ["Attempt", "Backend", "Plan", "TaskSpec", "backend_for"]


def backend_for(execution: str, task: TaskSpec) -> Backend:
    """The backend of ``execution`` (a key of ``BACKENDS``), for one try (or one dry run) of ``task``."""
    try:
        module_name, _, class_name = BACKENDS[execution].partition(":")
    except KeyError:
        raise ValueError(f"execution: expected {executions_expected()}, got {execution!r}") from None
    backend: Backend = getattr(importlib.import_module(module_name), class_name)(task)
    return backend
