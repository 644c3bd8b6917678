"""What the UI shows, as plain JSON dicts, from what Kubernetes and Airflow's database say. Pure: no I/O.

Two sources make one list of jobs:

- **live** jobs: the provider's objects listed from Kubernetes (one list per kind and one pod list per namespace),
  read with the same per-kind decisions (:mod:`kinds`) that the task's wait uses, so the page never says
  something the task would not;
- **finished** jobs: the summary (``torch_elastic_job`` XCom) the task saved when its job ended, which outlives a
  deleted job and covers local executions.

A job that is in both is shown from its summary: that is the task's own verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import quote

from airflow_provider_torchelastic.core.naming import (
    ANNOTATION_DAG_ID,
    ANNOTATION_RUN_ID,
    ANNOTATION_TASK_ID,
    DNS_1123_LABEL,
    DNS_1123_SUBDOMAIN,
    LABEL_MAP_INDEX,
    LABEL_TRY_NUMBER,
    TaskInstanceRef,
    is_job_name_of,
)
from airflow_provider_torchelastic.core.stall import forensics_location
from airflow_provider_torchelastic.core.summary import XCOM_KEY, JobSummary, pod_summaries
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.status import parse_time
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitPolicy

__all__ = [
    "LOCAL_NAMESPACE",
    "PHASES",
    "JobKey",
    "LiveJob",
    "describe",
    "group_live_jobs",
    "is_job_of",
    "is_namespace",
    "is_object_name",
    "job_detail_from_live",
    "job_detail_from_summary",
    "job_row_from_live",
    "job_row_from_summary",
    "merge_rows",
    "read_summary",
    "summary_belongs_to",
    "summary_from_xcom",
    "ti_url",
]

#: The XCom key under which the operator saves a job's summary when it ends.
SUMMARY_XCOM_KEY: Final = XCOM_KEY
PHASES: Final = tuple(phase.value for phase in Phase)
#: The ``namespace`` of a local execution in URLs (it has none; a DNS label cannot start with "_").
LOCAL_NAMESPACE: Final = "_local"
#: Points per metric in the list's sparklines (the detail view gets the summary's downsampled series whole).
SPARKLINE_POINTS: Final = 60

JobKey = tuple[str, str]  # (namespace, name)


def is_namespace(text: object) -> bool:
    """Whether ``text`` is a namespace name Kubernetes could have (``_local`` is not one). A URL's segment that is
    neither this nor :func:`is_object_name` never reaches an API path: ``..`` would climb to a cluster-wide list."""
    return isinstance(text, str) and DNS_1123_LABEL.match(text) is not None


def is_object_name(text: object) -> bool:
    """Whether ``text`` is a pod or job name Kubernetes could have."""
    return isinstance(text, str) and DNS_1123_SUBDOMAIN.match(text) is not None


@dataclass(frozen=True, kw_only=True)
class Identity(TaskInstanceRef):
    """The task instance try a job belongs to, as its labels or an XCom row claim it: unchecked, and without a try
    where none is known (:func:`is_job_of` checks the claim)."""

    try_number: int | None = None


@dataclass(frozen=True, kw_only=True)
class LiveJob:
    """A job object of a registered kind and its pods, as listed from Kubernetes."""

    kind: str
    obj: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]] = field(default_factory=tuple)

    @property
    def namespace(self) -> str:
        return str(self.obj.get("metadata", {}).get("namespace", ""))

    @property
    def name(self) -> str:
        return str(self.obj.get("metadata", {}).get("name", ""))

    @property
    def key(self) -> JobKey:
        return self.namespace, self.name

    @property
    def identity(self) -> Identity | None:
        """From the unabridged annotations (labels may be truncated); None for an object missing them."""
        metadata = self.obj.get("metadata", {})
        annotations = metadata.get("annotations") or {}
        labels = metadata.get("labels") or {}
        keys = (ANNOTATION_DAG_ID, ANNOTATION_TASK_ID, ANNOTATION_RUN_ID)
        dag_id, task_id, run_id = (annotations.get(key) for key in keys)
        if not (dag_id and task_id and run_id):
            return None
        return Identity(
            dag_id=dag_id,
            task_id=task_id,
            run_id=run_id,
            map_index=_int(labels.get(LABEL_MAP_INDEX), -1),
            try_number=_int(labels.get(LABEL_TRY_NUMBER), None),
        )


def describe(identity: Identity) -> str:
    """The task instance try, for a log line: ``dag/run/task[map index] try n``."""
    mapped = f"[{identity.map_index}]" if identity.map_index >= 0 else ""
    return f"{identity.dag_id}/{identity.run_id}/{identity.task_id}{mapped} try {identity.try_number}"


def _int(value: Any, default: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def group_live_jobs(
    objects: Mapping[str, Sequence[Mapping[str, Any]]],
    pods: Sequence[Mapping[str, Any]],
    owners: Mapping[tuple[str, str], Sequence[Mapping[str, Any]]] | None = None,
) -> list[LiveJob]:
    """Jobs of each kind (``{kind: [objects]}``) with their pods, picked from one pod list of the namespace by the
    kind's own answer (:meth:`kinds.JobKind.pods_of`), in the kind's order.

    ``owners``: by ``(kind, name)``, the objects between such a job and its pods (a TrainJob's JobSet and Jobs).
    A pod with the labels but another controller (or none) is not the job's: its logs and its state stay out of the
    job's row and of its log view.
    """
    jobs: list[LiveJob] = []
    for kind, items in objects.items():
        descriptor = kinds.get(kind)
        for obj in items:
            name = obj.get("metadata", {}).get("name", "")
            mine = descriptor.pods_of(name).pick(obj, pods, (owners or {}).get((kind, name), ()))
            jobs.append(LiveJob(kind=kind, obj=obj, pods=tuple(sorted(mine, key=descriptor.pod_order))))
    return jobs


def ti_url(identity: Identity, base_path: str = "") -> str:
    """The task instance's page in Airflow's UI (a path: the pages and the API share the api-server's origin)."""
    parts = (identity.dag_id, identity.run_id, identity.task_id)
    dag, run, task = (quote(part, safe="") for part in parts)
    url = f"{base_path.rstrip('/')}/dags/{dag}/runs/{run}/tasks/{task}"
    return f"{url}/mapped/{identity.map_index}" if identity.map_index >= 0 else url


# --- live jobs ----------------------------------------------------------------------------------------------------


def _decide(job: LiveJob, now: float) -> tuple[Phase, str | None]:
    """The job's phase and, when it failed, why: the task's own decision over this snapshot."""
    ref = JobRef(kind=job.kind, name=job.name, namespace=job.namespace)
    decision = kinds.get(job.kind).decide(ref, Snapshot(job=job.obj, pods=job.pods, now=now), WaitPolicy())
    cause = decision.verdict.detail if decision.verdict is not None and not decision.verdict.succeeded else None
    return decision.phase, cause


def _pods_total(job: LiveJob) -> int:
    counted = kinds.get(job.kind).replica_count(job.obj)
    return counted if counted is not None else max(1, len(job.pods))


def _pods_running(pods: Iterable[Mapping[str, Any]]) -> int:
    return sum(1 for pod in pods if pod.get("status", {}).get("phase") == "Running")


def job_row_from_live(
    job: LiveJob, *, now: float, base_path: str = "", metrics: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """A row of the jobs list for a job read from Kubernetes; None when it carries no task identity."""
    identity = job.identity
    if identity is None:
        return None
    phase, cause = _decide(job, now)
    created = parse_time(job.obj.get("metadata", {}).get("creationTimestamp"))
    return {
        **_identity_fields(identity, base_path),
        "kind": job.kind,
        "namespace": job.namespace,
        "name": job.name,
        "phase": phase.value,
        "pods_running": _pods_running(job.pods),
        "pods_total": _pods_total(job),
        "created": created,
        "elapsed_seconds": None if created is None else max(0.0, now - created),
        "root_cause": cause,
        "source": "kubernetes",
        "sparkline": sparkline(metrics or {}),
    }


def job_detail_from_live(
    job: LiveJob,
    *,
    now: float,
    base_path: str = "",
    log_tails: Mapping[str, str] | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    row = job_row_from_live(job, now=now, base_path=base_path, metrics=metrics)
    if row is None:
        return None
    tails = log_tails or {}
    # The same reading of pod objects as the summary the task saves when the job ends.
    pods = [{**pod.to_dict(), "log_tail": tails.get(pod.name, "")} for pod in pod_summaries(job.pods)]
    return {**row, "pods": pods, **_metrics_fields(metrics or {})}


# --- finished jobs (summaries) --------------------------------------------------------------------------------


def read_summary(value: Any) -> dict[str, Any]:
    """The summary document from an XCom value (JSON text or the decoded object), as strict JSON; ``ValueError``
    saying why when it is not one (any DAG can push an XCom under this key)."""
    return JobSummary.from_json(value).to_dict()


def summary_from_xcom(value: Any) -> dict[str, Any] | None:
    """The summary document from an XCom value (JSON text or the decoded object); None if it is not one."""
    try:
        return read_summary(value)
    except ValueError:
        return None


def is_job_of(name: object, identity: Identity) -> bool:
    """Whether ``name`` is the job the XCom row ``identity``'s task instance would have run: the job's name holds a
    hash of the task instance try (``naming.job_name``, or a kind's cut of it, ``naming.fit_job_name``), so a task
    cannot pass its row off as another DAG's job.

    The row's try or the one before (a summary outlives the start of the next try until that try clears its XComs).
    """
    if identity.try_number is None:
        return False
    for try_number in {identity.try_number, identity.try_number - 1}:
        try:
            claimed = identity.try_of(try_number)
        except (TypeError, ValueError):
            continue
        if is_job_name_of(name, claimed):
            return True
    return False


def summary_belongs_to(summary: Mapping[str, Any], identity: Identity) -> bool:
    """Whether the summary names the job its own XCom row's task would have run (:func:`is_job_of`)."""
    return is_job_of(summary.get("name"), identity)


def summary_namespace(summary: Mapping[str, Any]) -> str:
    return str(summary.get("namespace") or LOCAL_NAMESPACE)


def _identity_fields(identity: Identity, base_path: str) -> dict[str, Any]:
    return {
        "dag_id": identity.dag_id,
        "task_id": identity.task_id,
        "run_id": identity.run_id,
        "map_index": identity.map_index,
        "try_number": identity.try_number,
        "ti_url": ti_url(identity, base_path),
    }


def job_row_from_summary(summary: Mapping[str, Any], identity: Identity, *, base_path: str = "") -> dict[str, Any]:
    pods = summary.get("pods") or []
    phase = summary.get("phase") if summary.get("phase") in PHASES else Phase.FAILED.value
    return {
        **_identity_fields(identity, base_path),
        "kind": summary.get("kind", ""),
        "namespace": summary_namespace(summary),
        "name": summary.get("name", ""),
        "phase": phase,
        # Ended: nothing runs any more.
        "pods_running": 0,
        "pods_total": len(pods),
        "created": summary.get("created"),
        "elapsed_seconds": summary.get("elapsed_seconds"),
        "root_cause": summary.get("root_cause") if phase == Phase.FAILED.value else None,
        "source": "summary",
        "sparkline": sparkline(summary.get("metrics") or {}),
    }


def job_detail_from_summary(summary: Mapping[str, Any], identity: Identity, *, base_path: str = "") -> dict[str, Any]:
    row = job_row_from_summary(summary, identity, base_path=base_path)
    pods = [dict(pod) for pod in summary.get("pods") or [] if isinstance(pod, Mapping)]
    return {
        **row,
        "pods": pods,
        **_metrics_fields(summary.get("metrics") or {}, summary.get("last_metrics") or {}),
        # Rank 0's tensors, state dicts and Modules: the try's outputs, kept in artifact storage.
        "artifacts": [dict(entry) for entry in summary.get("artifacts") or [] if isinstance(entry, Mapping)],
        "artifacts_omitted": summary.get("artifacts_omitted") or 0,
        # Where a stalled or stopped try's stacks and traces were kept (a URL in the try's storage), as its root
        # cause says, or None.
        "forensics": forensics_location(row["root_cause"] or ""),
    }


# --- metrics ------------------------------------------------------------------------------------------------------


def _points(values: Any) -> list[list[float]]:
    points = []
    for point in values or []:
        if isinstance(point, list | tuple) and len(point) == 2:
            step, value = point
            if isinstance(step, int | float) and isinstance(value, int | float):
                points.append([step, value])
    return points


def _metrics_fields(metrics: Mapping[str, Any], last: Mapping[str, Any] | None = None) -> dict[str, Any]:
    series = {str(name): _points(values) for name, values in metrics.items()}
    if last is None:
        last = {name: points[-1][1] for name, points in series.items() if points}
    return {"metrics": series, "last_metrics": dict(last)}


def _decimate(points: list[list[float]], count: int) -> list[list[float]]:
    if len(points) <= count:
        return points
    stride = (len(points) - 1) / (count - 1)
    return [points[round(i * stride)] for i in range(count)]


def sparkline(metrics: Mapping[str, Any], name: str = "loss") -> dict[str, Any] | None:
    """The list's small chart: ``name`` if reported, else the first metric by name that is a loss (Lightning's
    ``train_loss``, a tracker's ``train/loss``), else the first by name; at most ``SPARKLINE_POINTS`` points."""
    if not metrics:
        return None
    chosen = name if name in metrics else min(metrics, key=lambda metric: ("loss" not in metric.lower(), metric))
    points = _points(metrics[chosen])
    return {"metric": chosen, "points": _decimate(points, SPARKLINE_POINTS)} if points else None


# --- one list from both sources ------------------------------------------------------------------------------


def merge_rows(
    live: Iterable[Mapping[str, Any]],
    finished: Iterable[Mapping[str, Any]],
    *,
    phase: str | None = None,
    offset: int = 0,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Rows newest first, a job in both sources shown once from its summary, filtered by phase, then one page."""
    by_key: dict[JobKey, dict[str, Any]] = {}
    for row in live:
        by_key[(row["namespace"], row["name"])] = dict(row)
    for row in finished:
        by_key[(row["namespace"], row["name"])] = dict(row)
    rows = [row for row in by_key.values() if phase is None or row["phase"] == phase]
    rows.sort(key=lambda row: (-(row.get("created") or 0.0), row["namespace"], row["name"]))
    return rows[offset : offset + limit]
