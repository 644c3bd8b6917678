"""Run distributed PyTorch training (torch elastic / torchrun) as an Airflow task.

The public surface is defined here once. A DAG file imports this package at every parse, so it stays light: the
configuration types are plain dataclasses, and the operator (which needs Airflow) is imported on first use. Nothing
here imports torch or the kubernetes client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_provider_torchelastic.core.config import (
        CleanPodPolicy,
        Elastic,
        Master,
        PyTorch,
        RestartPolicy,
        RunPolicy,
        Worker,
    )
    from airflow_provider_torchelastic.errors import RecoverableError
    from airflow_provider_torchelastic.operators import TorchElasticOperator
    from airflow_provider_torchelastic.worker.metrics import report
    from airflow_provider_torchelastic.worker.program import set_result

from airflow_provider_torchelastic.core.version import __version__

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
                    "checkpoint_root": {
                        "description": "Root of every task's checkpoint location, an fsspec URL (s3://, gs://, "
                        "abfs://, file://) or a path on a volume mounted in the pods: a task instance's location is "
                        "{root}/{dag_id}/{run_id}/{task_id}/{map_index}, the same for every try and restart of it, "
                        "and the workers read it from context.current().checkpoint_uri. A task's checkpoint_uri "
                        "argument replaces it. Empty: no location unless the task names one. Checkpoints are kept: "
                        "clean up with a lifecycle rule or by deleting {root}/{dag_id}/{run_id}.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://ml-checkpoints/airflow",
                        "default": "",
                    },
                    "result_storage": {
                        "description": "Where rank 0's result goes when it is larger than a termination message "
                        "(4096 bytes), an fsspec URL or a path reachable from the pods and the Airflow workers: "
                        "{result_storage}/{dag_id}/{run_id}/{task_id}/{map_index}/{try_number}/result.json. The "
                        "Airflow side reads it back with ObjectStoragePath. Empty: artifact_storage (and "
                        "artifact_storage_conn_id); with neither, larger results fail the task.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://ml-results/airflow",
                        "default": "",
                    },
                    "result_storage_conn_id": {
                        "description": "The Airflow connection that ObjectStoragePath uses to read results from "
                        "result_storage (the pods use their own environment's credentials). Empty: the file "
                        "system's defaults (with result_storage empty too: artifact_storage_conn_id).",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "aws_default",
                        "default": "",
                    },
                    "result_storage_keep": {
                        "description": "Keep result files in result_storage after they were read (by default they "
                        "are deleted once the result is in XCom).",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                    "result_storage_max_bytes": {
                        "description": "The most bytes the Airflow side reads of one result in result_storage; a "
                        "bigger result fails the task (a retry will not help). Bounds the worker's memory.",
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "104857600",
                        "default": "1073741824",
                    },
                    "artifact_storage": {
                        "description": "Where the tensors, numpy arrays, state dicts and Modules in rank 0's value "
                        "go, as safetensors files (the XCom holds plain-JSON references to them), and arguments too "
                        "large for the payload: {artifact_storage}/{dag_id}/{run_id}/{task_id}/{map_index}/"
                        "{try_number}/artifacts/. An fsspec URL or a path reachable from the pods and the Airflow "
                        "workers. Kept: they are outputs (give the store a lifecycle rule). Empty: result_storage.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://ml-artifacts/airflow",
                        "default": "",
                    },
                    "artifact_storage_conn_id": {
                        "description": "The Airflow connection with which Airflow tasks read artifacts "
                        "(artifacts.load) and write spilled arguments (the pods use their own environment's "
                        "credentials). Empty: result_storage_conn_id.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "aws_default",
                        "default": "",
                    },
                    "report_interval": {
                        "description": "Seconds between two metrics lines of rank 0 (report() in the training "
                        "code): at most one progress line per interval reaches the task log, however often report() "
                        "is called; the last values are always printed when the training function ends. Rendered "
                        "into every pod (TORCHELASTIC_REPORT_INTERVAL) and set for local execution.",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "60",
                        "default": "15",
                    },
                    "deferrable": {
                        "description": "Whether Kubernetes tasks release their worker slot while the job runs.",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "False",
                        "default": "True",
                    },
                    "early_event_hold": {
                        "description": "Seconds after a deferral before its trigger may fire: Airflow 3.3 can fail a "
                        "resumed try whose trigger fired before the scheduler processed the deferral. 0 turns the "
                        "hold off.",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "0",
                        "default": "10",
                    },
                    "job_lease": {
                        "description": "Seconds the Kubernetes job of a task without execution_timeout outlives its "
                        "waiter's last renewal: the worker or trigger that waits renews it, and the sweep run at "
                        "every submission (or python -m airflow_provider_torchelastic.kubernetes.sweep) deletes a "
                        "job whose lease ran out. At least 300.",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "7200",
                        "default": "3600",
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
                    "ui_kubernetes_conn_id": {
                        "description": "The cncf.kubernetes connection through which the api-server's 'Training "
                        "jobs' pages list running jobs and read their pods and logs (the README gives the Role this "
                        "identity needs). Finished jobs come from Airflow's database and need no connection.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "kubernetes_default",
                        "default": "kubernetes_default",
                    },
                },
            }
        },
    }
