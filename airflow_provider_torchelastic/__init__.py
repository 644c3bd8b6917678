"""Run distributed PyTorch training (torch elastic / torchrun) as an Airflow task.

The public surface is defined here once. A DAG file imports this package at every parse, so it stays light: the
configuration types are plain dataclasses, and the operator (which needs Airflow) is imported on first use. Nothing
here imports torch or the kubernetes client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from airflow_provider_torchelastic.config import (
    CleanPodPolicy,
    Elastic,
    Master,
    PyTorch,
    RestartPolicy,
    RunPolicy,
    Worker,
)
from airflow_provider_torchelastic.errors import RecoverableError

if TYPE_CHECKING:
    from airflow_provider_torchelastic.operators import TorchElasticOperator

__version__ = "0.1.0"

__all__ = [
    "CleanPodPolicy",
    "Elastic",
    "Master",
    "PyTorch",
    "RecoverableError",
    "RestartPolicy",
    "RunPolicy",
    "TorchElasticOperator",
    "Worker",
]

# Names whose modules need Airflow: imported on first access, so the runner (and images without Airflow) can import
# this package.
_LAZY = {"TorchElasticOperator": "airflow_provider_torchelastic.operators"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def get_provider_info() -> dict[str, Any]:
    """Provider metadata for Airflow's discovery (entry point ``apache_airflow_provider``)."""
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
        "config": {
            "torch_elastic": {
                "description": "Defaults of TorchElasticOperator and @task.torch_elastic.",
                "options": {
                    "execution": {
                        "description": "Where tasks run by default: 'kubernetes' (a PyTorchJob or Pod) or 'local' "
                        "(runner subprocesses on the Airflow worker).",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "local",
                        "default": "kubernetes",
                    },
                    "image": {
                        "description": "The training image of tasks that name none themselves: used where neither "
                        "the operator's image, a Master/Worker image nor the pod template's 'pytorch' container names "
                        "one. Empty: every Kubernetes task must name its image. Read where DAGs are parsed (a "
                        "Kubernetes task without any image fails to parse) and where tasks run.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "registry.example.com/ml/torchelastic-runner:0.1.0",
                        "default": "",
                    },
                    "deferrable": {
                        "description": "Whether Kubernetes tasks release their worker slot while the job runs.",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "False",
                        "default": "True",
                    },
                    "dashboard_url_template": {
                        "description": "URL of a job in your Kubernetes dashboard, for the task's extra link; "
                        "{namespace}, {name} and {kind} are filled in. Empty: no link.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "https://dashboard.example.com/#/pytorchjob/{namespace}/{name}",
                        "default": "",
                    },
                    "logs_url_template": {
                        "description": "URL of a job's pod logs in your log system, for the task's extra link; "
                        "{namespace}, {name} and {kind} are filled in. Empty: no link.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "https://logs.example.com/?q=kubernetes.labels.training_kubeflow_org_job-name:{name}",
                        "default": "",
                    },
                },
            }
        },
    }
