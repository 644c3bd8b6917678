"""The ``[torch_elastic]`` Airflow options, declared once: name, type, default, description and example.

Airflow's discovery (``get_provider_info()``), the reads in :mod:`airflow_provider_torchelastic.settings` (which
refuse a name declared nowhere here) and the docs' configuration reference are all this table;
tests/unit/test_options.py checks that every option read is declared here and every option declared is read.

Standard library only, and nothing is read here: Airflow imports the provider info in every process it starts, and a
DAG file reaches this module through settings at every parse.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

__all__ = ["DECLARED", "OPTIONS", "SECTION", "TYPES", "Option", "provider_config"]

SECTION: Final = "torch_elastic"
#: The types Airflow's provider info schema knows (each default and example is a string that parses as its type).
TYPES: Final = ("string", "boolean", "integer", "float")


@dataclass(frozen=True, kw_only=True)
class Option:
    """One option of the section, as Airflow's provider info declares it."""

    name: str
    #: One of :data:`TYPES`.
    type: str
    #: What Airflow returns when nothing sets the option, as written in a config file ("False", "1073741824").
    default: str
    version_added: str
    description: str
    example: str

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            expected = ", ".join(map(repr, TYPES))
            raise ValueError(f"[{SECTION}] {self.name}: type expected one of {expected}, got {self.type!r}")


OPTIONS: Final = (
    Option(
        name="execution",
        type="string",
        default="kubernetes",
        version_added="0.1.0",
        description="Where tasks run by default: 'kubernetes' (a PyTorchJob or Pod) or 'local' "
        "(runner subprocesses on the Airflow worker).",
        example="local",
    ),
    Option(
        name="image",
        type="string",
        default="",
        version_added="0.1.0",
        description="The training image of tasks that name none themselves: used where neither "
        "the operator's image, a Master/Worker image nor the pod template's 'pytorch' container names "
        "one. Empty: every Kubernetes task must name its image. Read where DAGs are parsed (a "
        "Kubernetes task without any image fails to parse) and where tasks run.",
        example="registry.example.com/ml/torchelastic-runner:0.1.0",
    ),
    Option(
        name="job_kind",
        type="string",
        default="auto",
        version_added="0.1.0",
        description="What runs a Kubernetes task of several nodes: 'auto' (a TrainJob where the cluster serves "
        "it and the task fits one, else a PyTorchJob), 'pytorchjob' (always a PyTorchJob) or 'trainjob' (always a "
        "TrainJob; what a TrainJob cannot run fails the DAG's parse). A task of one node runs as a Pod whatever "
        "this says, and a task's job_kind argument replaces it. Read where DAGs are parsed and where tasks run.",
        example="trainjob",
    ),
    Option(
        name="checkpoint_root",
        type="string",
        default="",
        version_added="0.1.0",
        description="Root of every task's checkpoint location, an fsspec URL (s3://, gs://, "
        "abfs://, file://) or a path on a volume mounted in the pods: a task instance's location is "
        "{root}/{dag_id}/{run_id}/{task_id}/{map_index}, the same for every try and restart of it, "
        "and the workers read it from context.current().checkpoint_uri. A task's checkpoint_uri "
        "argument replaces it. Empty: no location unless the task names one. Checkpoints are kept: "
        "clean up with a lifecycle rule or by deleting {root}/{dag_id}/{run_id}.",
        example="s3://ml-checkpoints/airflow",
    ),
    Option(
        name="result_storage",
        type="string",
        default="",
        version_added="0.1.0",
        description="Where rank 0's result goes when it is larger than a termination message "
        "(4096 bytes), an fsspec URL or a path reachable from the pods and the Airflow workers: "
        "{result_storage}/{dag_id}/{run_id}/{task_id}/{map_index}/{try_number}/result.json. The "
        "Airflow side reads it back with ObjectStoragePath. Empty: artifact_storage (and "
        "artifact_storage_conn_id); with neither, larger results fail the task.",
        example="s3://ml-results/airflow",
    ),
    Option(
        name="result_storage_conn_id",
        type="string",
        default="",
        version_added="0.1.0",
        description="The Airflow connection that ObjectStoragePath uses to read results from "
        "result_storage (the pods use their own environment's credentials). Empty: the file "
        "system's defaults (with result_storage empty too: artifact_storage_conn_id).",
        example="aws_default",
    ),
    Option(
        name="result_storage_keep",
        type="boolean",
        default="False",
        version_added="0.1.0",
        description="Keep result files in result_storage after they were read (by default they "
        "are deleted once the result is in XCom).",
        example="True",
    ),
    Option(
        name="result_storage_max_bytes",
        type="integer",
        default="1073741824",
        version_added="0.1.0",
        description="The most bytes the Airflow side reads of one result in result_storage; a "
        "bigger result fails the task (a retry will not help). Bounds the worker's memory.",
        example="104857600",
    ),
    Option(
        name="artifact_storage",
        type="string",
        default="",
        version_added="0.1.0",
        description="Where the tensors, numpy arrays, state dicts and Modules in rank 0's value "
        "go, as safetensors files (the XCom holds plain-JSON references to them), and arguments too "
        "large for the payload: {artifact_storage}/{dag_id}/{run_id}/{task_id}/{map_index}/"
        "{try_number}/artifacts/. An fsspec URL or a path reachable from the pods and the Airflow "
        "workers. Kept: they are outputs (give the store a lifecycle rule). Empty: result_storage.",
        example="s3://ml-artifacts/airflow",
    ),
    Option(
        name="artifact_storage_conn_id",
        type="string",
        default="",
        version_added="0.1.0",
        description="The Airflow connection with which Airflow tasks read artifacts "
        "(artifacts.load) and write spilled arguments (the pods use their own environment's "
        "credentials). Empty: result_storage_conn_id.",
        example="aws_default",
    ),
    Option(
        name="report_interval",
        type="float",
        default="15",
        version_added="0.1.0",
        description="Seconds between two metrics lines of rank 0 (report() in the training "
        "code): at most one progress line per interval reaches the task log, however often report() "
        "is called; the last values are always printed when the training function ends. Rendered "
        "into every pod (TORCHELASTIC_REPORT_INTERVAL) and set for local execution.",
        example="60",
    ),
    Option(
        name="retry_memory_max",
        type="string",
        default="64Gi",
        version_added="0.1.0",
        description="The most memory retry_resources= gives a training container after an OOM (a Kubernetes "
        "quantity): a factor or callable asking for more is cut to this. Where the task's namespace has a "
        "LimitRange with a Container max.memory, that maximum caps it instead.",
        example="256Gi",
    ),
    Option(
        name="deferrable",
        type="boolean",
        default="True",
        version_added="0.1.0",
        description="Whether Kubernetes tasks release their worker slot while the job runs.",
        example="False",
    ),
    Option(
        name="early_event_hold",
        type="float",
        default="10",
        version_added="0.1.0",
        description="Seconds after a deferral before its trigger may fire: Airflow 3.3 can fail a "
        "resumed try whose trigger fired before the scheduler processed the deferral. 0 turns the "
        "hold off.",
        example="0",
    ),
    Option(
        name="job_lease",
        type="float",
        default="3600",
        version_added="0.1.0",
        description="Seconds the Kubernetes job of a task without execution_timeout outlives its "
        "waiter's last renewal: the worker or trigger that waits renews it, and the sweep run at "
        "every submission (or the torchelastic-sweep command) deletes a "
        "job whose lease ran out. At least 300.",
        example="7200",
    ),
    Option(
        name="dashboard_url_template",
        type="string",
        default="",
        version_added="0.1.0",
        description="URL of a job in your Kubernetes dashboard, for the task's extra link; "
        "{namespace}, {name} and {kind} are filled in. Empty: no link.",
        example="https://dashboard.example.com/#/pytorchjob/{namespace}/{name}",
    ),
    Option(
        name="logs_url_template",
        type="string",
        default="",
        version_added="0.1.0",
        description="URL of a job's pod logs in your log system, for the task's extra link; "
        "{namespace}, {name} and {kind} are filled in. Empty: no link.",
        example="https://logs.example.com/?q=kubernetes.labels.training_kubeflow_org_job-name:{name}",
    ),
    Option(
        name="ui_kubernetes_conn_id",
        type="string",
        default="kubernetes_default",
        version_added="0.1.0",
        description="The cncf.kubernetes connection through which the api-server's 'Training "
        "jobs' pages list running jobs and read their pods and logs (the README gives the Role this "
        "identity needs). Finished jobs come from Airflow's database and need no connection.",
        example="kubernetes_default",
    ),
)

#: The options by name: what settings looks a name up in before it reads the option.
DECLARED: Final = MappingProxyType({option.name: option for option in OPTIONS})


def provider_config() -> dict[str, Any]:
    """The ``config`` of ``get_provider_info()``: the section and its options as Airflow's provider info schema
    wants them (Airflow reads each default from here when nothing sets the option)."""
    return {
        SECTION: {
            "description": "Defaults of TorchElasticOperator and @task.torch_elastic.",
            "options": {
                option.name: {
                    "description": option.description,
                    "version_added": option.version_added,
                    "type": option.type,
                    "example": option.example,
                    "default": option.default,
                }
                for option in OPTIONS
            },
        }
    }
