"""Run distributed PyTorch training (torch elastic / torchrun) as an Airflow task.

The public surface is defined here once. A DAG file imports this package at every parse, so it stays light: the
configuration types are plain dataclasses, and the operator (which needs Airflow) is imported on first use. Nothing
here imports torch or the kubernetes client.

Each export reports this package (the operator: ``operators``) as its ``__module__`` (``core.public.publish``), so
that tracebacks, reprs, docs and by-reference pickles name a path that stays where the code behind it moves.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_provider_torchelastic.core.choices import Execution, OnFinishAction, TrainingJobKind
    from airflow_provider_torchelastic.core.config import (
        CleanPodPolicy,
        Elastic,
        Master,
        PyTorch,
        RestartPolicy,
        RunPolicy,
        Worker,
    )
    from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
    from airflow_provider_torchelastic.errors import RecoverableError
    from airflow_provider_torchelastic.operators import TorchElasticOperator
    from airflow_provider_torchelastic.worker.metrics import report
    from airflow_provider_torchelastic.worker.program import set_result

from airflow_provider_torchelastic.core.version import __version__

__all__ = [
    "CleanPodPolicy",
    "Elastic",
    "Execution",
    "JobOptions",
    "Master",
    "OnFinishAction",
    "PodOptions",
    "PyTorch",
    "RecoverableError",
    "RestartPolicy",
    "RunPolicy",
    "TorchElasticOperator",
    "TrainingJobKind",
    "Worker",
    "artifacts",
    "checkpoint",
    "context",
    "report",
    "set_result",
]

# Every name is imported on first access. The operator's module needs Airflow, so the runner (and images without
# Airflow) can import this package; the others are light, but a spawned worker imports this package on its way to
# its entrypoint, and needs none of them to start.
_LAZY = {
    "TorchElasticOperator": "airflow_provider_torchelastic.operators",
    **dict.fromkeys(
        ("CleanPodPolicy", "Elastic", "Master", "PyTorch", "RestartPolicy", "RunPolicy", "Worker"),
        "airflow_provider_torchelastic.core.config",
    ),
    **dict.fromkeys(("Execution", "OnFinishAction", "TrainingJobKind"), "airflow_provider_torchelastic.core.choices"),
    **dict.fromkeys(("JobOptions", "PodOptions"), "airflow_provider_torchelastic.core.pod_options"),
    "RecoverableError": "airflow_provider_torchelastic.errors",
    "report": "airflow_provider_torchelastic.worker.metrics",
    "set_result": "airflow_provider_torchelastic.worker.program",
}
# Modules for training functions (``context.current()``, ``checkpoint.save``) and for the tasks downstream of them
# (``artifacts.load``): imported on first access too.
_LAZY_MODULES = frozenset({"artifacts", "checkpoint", "context"})
# Submodules that importing the package used to import (and so bind as its attributes): still attributes of it.
_BOUND_MODULES = frozenset({"core", "errors", "metrics", "pod", "worker"})


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES or name in _BOUND_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _BOUND_MODULES)


def get_provider_info() -> dict[str, Any]:
    """Provider metadata for Airflow's discovery (entry point ``apache_airflow_provider``)."""
    from airflow_provider_torchelastic import options

    return {
        # Must equal the distribution name: a mismatch makes Airflow abort discovery of *every* provider.
        "package-name": "airflow-provider-torchelastic",
        "name": "Torch Elastic",
        "description": "Run distributed PyTorch training (torch elastic / torchrun) locally or as PyTorchJobs.",
        "versions": [__version__],
        "task-decorators": [
            {"name": "torch_elastic", "class-name": "airflow_provider_torchelastic.decorators.torch_elastic_task"}
        ],
        "triggers": [
            {
                "integration-name": "Torch Elastic",
                "python-modules": ["airflow_provider_torchelastic.triggers"],
            }
        ],
        "extra-links": [
            "airflow_provider_torchelastic.operators.TorchElasticJobLink",
            "airflow_provider_torchelastic.operators.TorchElasticLogsLink",
        ],
        # The option table, declared once in options.py (settings reads through it, the docs list it).
        "config": options.provider_config(),
    }
