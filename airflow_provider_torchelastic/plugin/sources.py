"""The plugin's I/O: the provider's objects listed from Kubernetes (cached), log tails, and summaries from Airflow's
database. Decides nothing (:mod:`.views` does).

Cost per page view is bounded whatever the number of jobs: one list per kind and one pod list per namespace, kept
for ``LIST_TTL`` seconds and shared by every request; one log read per pod, kept for ``LOG_TTL`` seconds, only for
the job a person opened (and for the rank-0 pod of the running jobs of one list page, for their sparklines).
Every Kubernetes read goes through :class:`~airflow_provider_torchelastic.kubernetes.client.SyncKube`, the
provider's one client and error boundary (no retries: a page view shows what it got, and the next one reads again).
The kubernetes client and Airflow's ORM are imported on first use, never when the plugin is loaded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.client import SyncKube
from airflow_provider_torchelastic.plugin.views import SUMMARY_XCOM_KEY, Identity, LiveJob, group_live_jobs

__all__ = ["KubeJobs", "Summaries", "SummaryQuery", "active_job_namespaces"]

#: Seconds a namespace's lists are reused: every page view within it costs the API server nothing.
LIST_TTL: Final = 5.0
#: Seconds a pod's log tail is reused.
LOG_TTL: Final = 10.0
#: Lines and bytes of a pod's log tail: what the page shows, and a bound on what one read may cost.
LOG_TAIL_LINES: Final = 200
LOG_TAIL_BYTES: Final = 64 * 1024
#: Pods of one job whose logs the detail view reads (the first ones: the master, then workers by index).
LOG_PODS: Final = 8
#: The most summaries one request reads from the database (a bound on a page's database cost).
MAX_SUMMARIES: Final = 500
#: Seconds one API call of a page view may take (a task's calls may take longer).
_REQUEST_TIMEOUT: Final = 30
_MANAGED: Final = f"{LABEL_MANAGED_BY}={MANAGED_BY}"


@dataclass(frozen=True)
class _Listing:
    at: float
    jobs: tuple[LiveJob, ...]


class KubeJobs:
    """The provider's live jobs per namespace, through the ``[torch_elastic] ui_kubernetes_conn_id`` connection."""

    def __init__(self, conn_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.conn_id = conn_id
        self._clock = clock
        self._lock = threading.Lock()
        self._kube_client: SyncKube | None = None
        self._default_namespace: str | None = None
        self._listings: dict[str, _Listing] = {}
        self._logs: dict[tuple[str, str], tuple[float, str]] = {}
        #: API calls made (lists and log reads), for tests and for the bound above.
        self.calls = 0

    def _kube(self) -> SyncKube:
        if self._kube_client is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            hook = KubernetesHook(conn_id=self.conn_id)
            self._kube_client = SyncKube(hook.get_conn(), request_timeout=_REQUEST_TIMEOUT)
            self._default_namespace = hook.get_namespace() or "default"
        return self._kube_client

    @property
    def default_namespace(self) -> str:
        self._kube()
        return self._default_namespace or "default"

    def _list(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        kube = self._kube()
        self.calls += 1
        return kube.list_kind(kind, namespace, _MANAGED)

    def read_log_tail(self, namespace: str, pod: str) -> str:
        """The last lines of the pod's training container log, read now; raises :class:`KubeError`."""
        kube = self._kube()
        self.calls += 1
        # Without timestamps: the page shows the lines as the container wrote them.
        return kube.read_log(pod, namespace, None, LOG_TAIL_LINES, limit_bytes=LOG_TAIL_BYTES, timestamps=False)

    def jobs(self, namespace: str) -> tuple[LiveJob, ...]:
        """The namespace's jobs with their pods: one list per kind plus one pod list, cached ``LIST_TTL`` seconds.

        A kind whose API is not served (no training operator installed: 404) has no jobs.
        """
        with self._lock:
            cached = self._listings.get(namespace)
            if cached is not None and self._clock() - cached.at < LIST_TTL:
                return cached.jobs
            pods = self._list("Pod", namespace)
            objects: dict[str, list[dict[str, Any]]] = {}
            for kind in _kinds():
                if kind == "Pod":
                    # Pods of a kind that owns pods are that job's; the rest are single-pod jobs.
                    owned = _owned_pod_label_keys()
                    objects[kind] = [p for p in pods if not owned & set(p.get("metadata", {}).get("labels") or {})]
                    continue
                try:
                    objects[kind] = self._list(kind, namespace)
                except KubeError as e:
                    if e.status != 404:
                        raise
                    objects[kind] = []
            listing = _Listing(at=self._clock(), jobs=tuple(group_live_jobs(objects, pods)))
            self._listings[namespace] = listing
            # Forget the logs of pods that are gone, so the cache stays as small as what runs.
            alive = {(namespace, p.get("metadata", {}).get("name", "")) for p in pods}
            self._logs = {k: v for k, v in self._logs.items() if k[0] != namespace or k in alive}
            return listing.jobs

    def find(self, namespace: str, name: str) -> LiveJob | None:
        return next((job for job in self.jobs(namespace) if job.name == name), None)

    def log_tail(self, namespace: str, pod: str) -> str:
        """The last lines of the pod's training container log (cached ``LOG_TTL`` seconds); "" if unreadable."""
        key = (namespace, pod)
        with self._lock:
            cached = self._logs.get(key)
            if cached is not None and self._clock() - cached[0] < LOG_TTL:
                return cached[1]
        try:
            text = self.read_log_tail(namespace, pod)
        except KubeError:
            # A pod still starting (or deleted meanwhile) has no log yet: show none rather than fail the page.
            text = ""
        with self._lock:
            self._logs[key] = (self._clock(), text)
        return text

    def log_tails(self, job: LiveJob) -> dict[str, str]:
        names = [p.get("metadata", {}).get("name", "") for p in job.pods][:LOG_PODS]
        return {name: self.log_tail(job.namespace, name) for name in names if name}


def _kinds() -> Sequence[str]:
    return [kind.kind for kind in kinds.registered()]


def _owned_pod_label_keys() -> set[str]:
    """Label keys by which kinds that own pods select them (a pod with one belongs to such a job)."""
    keys: set[str] = set()
    for kind in _kinds():
        selector = kinds.get(kind).pod_selector("x")
        if selector is not None:
            keys.update(term.partition("=")[0] for term in selector.split(","))
    return keys


# --- Airflow's database ----------------------------------------------------------------------------------------

#: Task instance states in which a job of the task may still exist and run.
ACTIVE_STATES: Final = ("queued", "scheduled", "running", "deferred", "up_for_retry", "restarting", "up_for_reschedule")
JOB_NAMESPACE_XCOM: Final = "job_namespace"


def _xcom_of_task_instance() -> Any:
    """The join condition of an XCom row and its task instance (the same four keys in both tables)."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from sqlalchemy import and_

    return and_(
        TaskInstance.dag_id == XComModel.dag_id,
        TaskInstance.run_id == XComModel.run_id,
        TaskInstance.task_id == XComModel.task_id,
        TaskInstance.map_index == XComModel.map_index,
    )


def active_job_namespaces(dag_ids: Iterable[str] | None) -> set[str]:
    """Namespaces where tasks that have not ended submitted jobs (the operator pushes ``job_namespace`` first)."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = (
        select(XComModel.value)
        .join(TaskInstance, _xcom_of_task_instance())
        .where(XComModel.key == JOB_NAMESPACE_XCOM, TaskInstance.state.in_(ACTIVE_STATES))
        .limit(MAX_SUMMARIES)
    )
    if dag_ids is not None:
        query = query.where(XComModel.dag_id.in_(list(dag_ids)))
    with create_session() as session:
        values = session.scalars(query).all()
    return {str(v) for value in values if isinstance(v := XComModel.deserialize_value(_Row(value)), str) and v}


@dataclass(frozen=True)
class _Row:
    value: Any


@dataclass(frozen=True, kw_only=True)
class SummaryQuery:
    """Which summaries a page needs: filters the database applies, newest first, at most ``limit``."""

    dag_ids: frozenset[str]
    dag_id: str | None = None
    run_id: str | None = None
    task_id: str | None = None
    map_index: int | None = None
    phase: str | None = None
    limit: int = 50


class Summaries:
    """Job summaries saved by tasks (XCom ``torch_elastic_job``), with the task instance they belong to.

    Filters run in the database, on the summary's JSON fields too (``value['phase']``, ``value['name']``: SQLite's
    ``json_extract``, PostgreSQL's ``->>``), so a page reads only the summaries it shows.
    """

    def dag_ids(self) -> set[str]:
        """The DAGs that have summaries (what the auth manager is asked about)."""
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            return set(session.scalars(select(XComModel.dag_id).where(XComModel.key == SUMMARY_XCOM_KEY).distinct()))

    def latest(self, query: SummaryQuery) -> list[tuple[Identity, Any]]:
        from airflow.models.xcom import XComModel

        if not query.dag_ids:
            return []
        conditions: list[Any] = [XComModel.dag_id.in_(sorted(query.dag_ids))]
        for column, value in (
            (XComModel.dag_id, query.dag_id),
            (XComModel.run_id, query.run_id),
            (XComModel.task_id, query.task_id),
            (XComModel.map_index, query.map_index),
        ):
            if value is not None:
                conditions.append(column == value)
        if query.phase is not None:
            conditions.append(XComModel.value["phase"].as_string() == query.phase)
        return self._select(conditions, min(query.limit, MAX_SUMMARIES))

    def ended(self, names: Iterable[str]) -> set[str]:
        """Which of these job names have a summary (their task decided they ended, whatever Kubernetes still shows)."""
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        wanted = sorted(set(names))
        if not wanted:
            return set()
        name = XComModel.value["name"].as_string()
        statement = select(name).where(XComModel.key == SUMMARY_XCOM_KEY, name.in_(wanted))
        with create_session() as session:
            return {str(found) for found in session.scalars(statement) if found}

    def find(self, namespace: str | None, name: str) -> tuple[Identity, Any] | None:
        """The summary of the job ``namespace/name`` (``namespace`` None: a local run)."""
        from airflow.models.xcom import XComModel

        conditions = [XComModel.value["name"].as_string() == name]
        if namespace is None:
            conditions.append(XComModel.value["namespace"].as_string().is_(None))
        else:
            conditions.append(XComModel.value["namespace"].as_string() == namespace)
        found = self._select(conditions, 1)
        return found[0] if found else None

    def _select(self, conditions: Sequence[Any], limit: int) -> list[tuple[Identity, Any]]:
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        statement = (
            select(
                XComModel.dag_id,
                XComModel.task_id,
                XComModel.run_id,
                XComModel.map_index,
                XComModel.value,
                TaskInstance.try_number,
            )
            .outerjoin(TaskInstance, _xcom_of_task_instance())
            .where(XComModel.key == SUMMARY_XCOM_KEY, *conditions)
            .order_by(XComModel.timestamp.desc())
            .limit(limit)
        )
        with create_session() as session:
            rows = session.execute(statement).all()
        return [
            (
                Identity(
                    dag_id=row.dag_id,
                    task_id=row.task_id,
                    run_id=row.run_id,
                    map_index=row.map_index,
                    try_number=row.try_number,
                ),
                XComModel.deserialize_value(_Row(row.value)),
            )
            for row in rows
        ]
