"""The operator's fixed choices as str enums: ``execution``, ``job_kind`` and ``on_finish_action``.

Each member is its string (a ``StrEnum``), so ``execution=Execution.LOCAL`` and ``execution="local"`` are the same
argument, compare equal, and serialize as the plain string wherever the operator keeps them (a serialized DAG, a
trigger's kwargs). The checks normalize to that string: nothing downstream ever sees an enum.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from airflow_provider_torchelastic.core.public import publish

__all__ = [
    "BACKENDS",
    "EXECUTIONS",
    "FINISH_ACTIONS",
    "FINISH_ACTION_ALIASES",
    "JOB_KIND_CHOICES",
    "Execution",
    "TrainingJobKind",
    "OnFinishAction",
    "executions_expected",
    "finish_action_of",
]


class Execution(enum.StrEnum):
    """Where a task runs: ``KUBERNETES`` (a PyTorchJob, TrainJob or Pod) or ``LOCAL`` (runner subprocesses on the
    Airflow worker). ``None`` for the operator's argument means ``[torch_elastic] execution``."""

    KUBERNETES = "kubernetes"
    LOCAL = "local"


class TrainingJobKind(enum.StrEnum):
    """What runs a multi-node task on Kubernetes: ``AUTO`` asks the cluster (a TrainJob where Kubeflow Trainer v2 is
    served, else a PyTorchJob); ``PYTORCHJOB`` and ``TRAINJOB`` fix the kind, and are checked at parse time."""

    AUTO = "auto"
    PYTORCHJOB = "pytorchjob"
    TRAINJOB = "trainjob"


class OnFinishAction(enum.StrEnum):
    """What happens to the Kubernetes job once it ended: ``DELETE_SUCCEEDED`` (the default: a failed job stays, to be
    looked at), ``DELETE`` or ``KEEP``. KubernetesPodOperator's spellings (``delete_succeeded_pod``, ``delete_pod``,
    ``keep_pod``, or its own ``OnFinishAction``) are accepted for the same three."""

    DELETE_SUCCEEDED = "delete_succeeded"
    DELETE = "delete"
    KEEP = "keep"


EXECUTIONS: Final = tuple(e.value for e in Execution)
#: Where a task can run: each execution and the backend that runs it, as ``module:class`` (imported only when a task
#: runs, never when a DAG is parsed). Adding a backend is a module implementing ``operators.backends.base.Backend``
#: and an entry here; the checks of ``execution`` and of ``[torch_elastic] execution`` read this table.
BACKENDS: Final[dict[str, str]] = {
    Execution.KUBERNETES.value: "airflow_provider_torchelastic.operators.backends.kubernetes:KubernetesBackend",
    Execution.LOCAL.value: "airflow_provider_torchelastic.operators.backends.local:LocalBackend",
}


def executions_expected() -> str:
    """The executions a check accepts, as its message names them: ``'kubernetes' or 'local'``."""
    return " or ".join(map(repr, BACKENDS))


JOB_KIND_CHOICES: Final = tuple(k.value for k in TrainingJobKind)
FINISH_ACTIONS: Final = tuple(a.value for a in OnFinishAction)
#: KubernetesPodOperator's ``on_finish_action`` values, so that a task moved from it keeps its argument.
FINISH_ACTION_ALIASES: Final[Mapping[str, str]] = {
    "delete_succeeded_pod": OnFinishAction.DELETE_SUCCEEDED.value,
    "delete_pod": OnFinishAction.DELETE.value,
    "keep_pod": OnFinishAction.KEEP.value,
}


def finish_action_of(value: object) -> str | None:
    """``value`` as one of :data:`FINISH_ACTIONS` (an alias mapped, an enum as its string); None when it is none."""
    if not isinstance(value, str):
        return None
    text = str(value.value) if isinstance(value, enum.Enum) else value
    text = FINISH_ACTION_ALIASES.get(text, text)
    return text if text in FINISH_ACTIONS else None


# Exported at the package root, and shown (and pickled by reference) by that path.
publish(Execution, TrainingJobKind, OnFinishAction)
