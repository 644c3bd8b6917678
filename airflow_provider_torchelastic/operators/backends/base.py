"""The one shape of every place a try can run: the :class:`Backend` protocol and what it is given.

The operator checks its arguments when the DAG is parsed, renders its templated ones before a run, and then hands a
backend a :class:`TaskSpec` (those arguments, frozen) and, for each try, an :class:`Attempt` (the try's identity,
run context, options and payload). The backend never sees the operator: it returns what the operator keeps (a
:class:`Plan` to show, a handle to stop) and the task's result, or raises the task's exception. Like torchx's
``Scheduler`` and the Kubeflow SDK's ``RuntimeBackend``, local execution is a backend like any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_torchelastic.core.config import TaskConfig
    from airflow_provider_torchelastic.core.naming import RunIdentity
    from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
    from airflow_provider_torchelastic.core.run_context import TaskContext
    from airflow_provider_torchelastic.operators.results import Log
    from airflow_provider_torchelastic.settings import Settings

__all__ = ["Attempt", "Backend", "Plan", "TaskSpec"]


@dataclass(frozen=True)
class TaskSpec:
    """What a backend reads of the task: the operator's checked arguments, templated ones rendered for this try (or
    for a dry run), and the task's logger. No defaults: the operator's (``arguments.DEFAULTS``) are the only ones."""

    dag_id: str
    task_id: str
    task_config: TaskConfig
    log: Log
    image: str | None
    namespace: str | None
    kubernetes_conn_id: str
    pod_options: PodOptions | None
    job_options: JobOptions | None
    poll_interval: float
    pending_grace_seconds: float
    image_pull_timeout: float
    on_finish_action: str
    scheduling_timeout: float | None
    stall_timeout: float | None
    termination_grace_period: float
    checkpoint_uri: str | None
    trusted_artifact_roots: tuple[str, ...]
    allow_pickled_artifacts: bool
    retry_resources: float | Callable[[int, str, Any], Any] | None
    max_preemptions: int | None
    execution_timeout: timedelta | None


@dataclass(frozen=True)
class Attempt:
    """One try (or a dry run's placeholder try): everything of it that every backend renders the same way.

    ``context`` is None in a dry run outside any run. ``payload`` is the cloudpickled training call with its
    arguments (spilled to artifact storage when over the limit), which every node's runner loads."""

    identity: RunIdentity
    task_context: TaskContext
    settings: Settings
    payload: bytes
    context: Context | None = None
    #: A dry run's: ``prepare`` touches no network, and nothing was or will be written.
    dry_run: bool = False


@dataclass(frozen=True)
class Plan:
    """What a backend will create for a try, in order, without having created any of it.

    ``objects`` are what it submits as they are (Kubernetes manifests with the payload; a local run's node commands
    and environment); ``shown`` is how a person sees them (the log, the rendered-template view, a dry run): no payload
    bytes, every secret value masked. ``execution`` names the backend."""

    execution: str
    objects: list[dict[str, Any]]
    shown: list[dict[str, Any]] = field(default_factory=list)
    #: The operator's ``rendered_job`` template field (what the rendered-template view shows), where there is one.
    rendered: str | None = None

    def __str__(self) -> str:
        return json.dumps(self.shown, indent=2, default=str)


class Backend(Protocol):
    """Where a try runs. One instance serves one try (or one dry run) of one task.

    ``prepare`` renders the try's plan and creates nothing (it may read: what the cluster serves, its limits); a dry
    run calls only it, with ``attempt.dry_run``, and then it touches no network either. ``submit`` creates what the
    plan names and returns the handle ``stop`` takes (the operator keeps it for ``on_kill``). ``wait`` returns rank
    0's result or raises the task's exception; a backend that can defer (``can_defer``) may instead raise Airflow's
    ``TaskDeferred``, after which the task resumes in ``resume`` with the trigger's event, on a fresh operator, in
    another process. ``stop`` ends what a handle names unless it has finished, and is safe to call from another
    thread while ``wait`` runs."""

    execution: ClassVar[str]
    can_defer: ClassVar[bool]
    #: The task it runs.
    task: TaskSpec
    #: The rendered-template view of what a resumed try had submitted, once ``resume`` read it back; else None.
    rendered: str | None

    def prepare(self, attempt: Attempt) -> Plan: ...

    def submit(self, attempt: Attempt, plan: Plan) -> object: ...

    def wait(self, attempt: Attempt, handle: object) -> Any: ...

    def resume(self, context: Context, event: Mapping[str, Any], settings: Settings) -> Any: ...

    def stop(self, handle: object) -> None: ...
