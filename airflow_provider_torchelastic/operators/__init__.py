"""``TorchElasticOperator`` and what its users name: its exceptions, its retry rule and its extra links.

The public path of all of them (DAG files import it, serialized DAGs and task logs name its classes); the code
lives in the modules beside this one:

- :mod:`.operator`: the operator (its arguments, its entry points, and rendering without a run);
- :mod:`.arguments`: the checks that run while the DAG file is parsed, for plain and mapped tasks;
- :mod:`.backends`: where a try runs, behind one protocol: local execution and Kubernetes (submitting, waiting or
  deferring, resuming), and the try every backend is given (its identity, run context and payload);
- :mod:`.results`: rank 0's value or the task's exception, and the job summary;
- :mod:`.links`, :mod:`.exceptions`.

Importing it (what a DAG file does at every parse) imports Airflow's SDK but neither torch nor the kubernetes
client: those are imported inside ``execute``. Nor does it import the Kubernetes backend's renderer, kinds and
decisions, the payload or results: building a Kubernetes task imports the renderer (the parse-time check renders
it once), a run the rest (issue 39: at most 50 ms over ``import airflow.sdk``, ``benchmarks/import_cost.py``).
"""

from __future__ import annotations

from airflow_provider_torchelastic.operators.exceptions import (
    CapacityTimeoutError,
    ConfigurationError,
    DeadlineExceededError,
    ImageTransientlyUnavailableError,
    ImageUnavailableError,
    InfrastructureError,
    NodeLostError,
    OutOfMemoryError,
    PreemptedError,
    StalledError,
    TrainingError,
    TrainingFailedError,
    TrainingRecoverableError,
    UserCodeError,
    UserCodeFailedError,
    UserCodeRecoverableError,
)

# ``name as name``: the extra links' classpaths, which serialized DAGs hold, though not in __all__.
from airflow_provider_torchelastic.operators.links import TorchElasticJobLink as TorchElasticJobLink
from airflow_provider_torchelastic.operators.links import TorchElasticLogsLink as TorchElasticLogsLink
from airflow_provider_torchelastic.operators.operator import TorchElasticOperator
from airflow_provider_torchelastic.operators.retry import UserExceptionRule

__all__ = [
    "CapacityTimeoutError",
    "ConfigurationError",
    "DeadlineExceededError",
    "ImageTransientlyUnavailableError",
    "ImageUnavailableError",
    "InfrastructureError",
    "NodeLostError",
    "StalledError",
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
