"""``TorchElasticOperator`` and what its users name: its exceptions, its extra links and its parse-time checks.

The public path of all of them (DAG files import it, serialized DAGs and task logs name its classes); the code
lives in the modules beside this one:

- :mod:`.operator`: the operator (its arguments and entry points);
- :mod:`.arguments`: the checks that run while the DAG file is parsed, for plain and mapped tasks;
- :mod:`.dry_run`: ``render_manifests()`` without a run, and the try's identity and run context;
- :mod:`.on_kubernetes`: submitting, waiting or deferring, resuming;
- :mod:`.results`: rank 0's value or the task's exception, and the job summary;
- :mod:`.links`, :mod:`.exceptions`.

Importing it (what a DAG file does at every parse) imports Airflow's SDK but neither torch nor the kubernetes
client: those are imported inside ``execute``. Nor does it import the Kubernetes backend's renderer, kinds and
decisions, the payload or results: building a Kubernetes task imports the renderer (the parse-time check renders
it once), a run the rest (issue 39: at most 50 ms over ``import airflow.sdk``, ``benchmarks/import_cost.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# ``name as name``: re-exported for the code and tests that import them from this path, though not in __all__ (as
# before the split).
from airflow_provider_torchelastic.operators.arguments import CheckedArguments as CheckedArguments
from airflow_provider_torchelastic.operators.arguments import check_checkpoint_uri as check_checkpoint_uri
from airflow_provider_torchelastic.operators.arguments import check_mapped_arguments as check_mapped_arguments
from airflow_provider_torchelastic.operators.arguments import check_operator_arguments as check_operator_arguments
from airflow_provider_torchelastic.operators.exceptions import (
    CapacityTimeoutError,
    ConfigurationError,
    DeadlineExceededError,
    ImageUnavailableError,
    InfrastructureError,
    NodeLostError,
    OutOfMemoryError,
    PreemptedError,
    TrainingError,
    TrainingFailedError,
    TrainingRecoverableError,
    UserCodeError,
    UserCodeFailedError,
    UserCodeRecoverableError,
)
from airflow_provider_torchelastic.operators.links import XCOM_JOB_KIND as XCOM_JOB_KIND
from airflow_provider_torchelastic.operators.links import XCOM_JOB_NAME as XCOM_JOB_NAME
from airflow_provider_torchelastic.operators.links import XCOM_JOB_NAMESPACE as XCOM_JOB_NAMESPACE
from airflow_provider_torchelastic.operators.links import TorchElasticJobLink as TorchElasticJobLink
from airflow_provider_torchelastic.operators.links import TorchElasticLogsLink as TorchElasticLogsLink
from airflow_provider_torchelastic.operators.operator import TorchElasticOperator
from airflow_provider_torchelastic.operators.retry import UserExceptionRule
from airflow_provider_torchelastic.settings import EXECUTIONS as EXECUTIONS
from airflow_provider_torchelastic.settings import IMAGE_OPTION as IMAGE_OPTION
from airflow_provider_torchelastic.settings import SECTION as CONFIG_SECTION  # noqa: F401  (its name here)
from airflow_provider_torchelastic.settings import ResultStorage as ResultStorage

if TYPE_CHECKING:
    from airflow_provider_torchelastic.operators.dry_run import UNRENDERED_IMAGE as UNRENDERED_IMAGE
    from airflow_provider_torchelastic.operators.on_kubernetes import STATE_KEY as STATE_KEY
    from airflow_provider_torchelastic.operators.on_kubernetes import XCOM_MANIFESTS as XCOM_MANIFESTS
    from airflow_provider_torchelastic.operators.results import read_stored_result as read_stored_result

__all__ = [
    "CapacityTimeoutError",
    "ConfigurationError",
    "DeadlineExceededError",
    "ImageUnavailableError",
    "InfrastructureError",
    "NodeLostError",
    "OutOfMemoryError",
    "PreemptedError",
    "TorchElasticOperator",
    "TrainingError",
    "TrainingFailedError",
    "TrainingRecoverableError",
    "UserCodeError",
    "UserCodeFailedError",
    "UserCodeRecoverableError",
    "UserExceptionRule",
]

# Re-exported on first access: their modules are what a run needs (the dry run, the Kubernetes path, results), and
# importing them here would cost every DAG file's parse what only a run uses.
_LAZY = {
    "UNRENDERED_IMAGE": "airflow_provider_torchelastic.operators.dry_run",
    "STATE_KEY": "airflow_provider_torchelastic.operators.on_kubernetes",
    "XCOM_MANIFESTS": "airflow_provider_torchelastic.operators.on_kubernetes",
    "read_stored_result": "airflow_provider_torchelastic.operators.results",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
