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

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from airflow_provider_torchelastic.core.naming import MANAGED_SELECTOR, TRAINING_CONTAINER
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.hooks import connect
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.client import SyncKube
from airflow_provider_torchelastic.kubernetes.requests import ReadLog
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef
from airflow_provider_torchelastic.plugin.views import (
    SUMMARY_XCOM_KEY,
    Identity,
    JobKey,
    LiveJob,
    describe,
    group_live_jobs,
    is_namespace,
    is_object_name,
)

__all__ = ["KubeJobs", "Summaries", "SummaryQuery", "active_job_namespaces", "check_name", "check_namespace"]

_log = logging.getLogger(__name__)

#: Seconds a namespace's lists are reused: every page view within it costs the API server nothing.
LIST_TTL: Final = 5.0
#: Seconds a pod's log tail is reused.
LOG_TTL: Final = 10.0
#: Lines and bytes of a pod's live log tail: what the page shows, and a bound on what one read may cost (the job
#: summary's own, smaller tails are :data:`~airflow_provider_torchelastic.core.summary.LOG_TAIL_LINES`).
PAGE_LOG_LINES: Final = 200
PAGE_LOG_BYTES: Final = 64 * 1024
#: Pods of one job whose logs the detail view reads (the first ones: the master, then workers by index).
LOG_PODS: Final = 8
#: The most summaries one request reads from the database (a bound on a page's database cost).
MAX_SUMMARIES: Final = 500
#: Namespaces whose lists (and locks) are kept, and pods whose log tails are: the least recently used go first.
MAX_NAMESPACES: Final = 64
MAX_CACHED_LOGS: Final = 1024
#: Summary rows whose keys one detail view reads to resolve a job's name to its task instance (newest first, in the
#: DAGs the user may read). Keys only, no values: a bound on cost, not a page. Rows of DAGs the user may not read are
#: filtered out before it, and a live job is resolved by the identity its object carries, whatever rows name it.
MAX_NAME_MATCHES: Final = 1000
#: Seconds one API call of a page view may take (a task's calls may take longer).
_REQUEST_TIMEOUT: Final = 30

K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class _Listing:
    at: float
    jobs: tuple[LiveJob, ...]


class _Lru(Generic[K, V]):
    """A dict that forgets its least recently used entries beyond ``size``: what an api-server keeps stays bounded
    whatever the namespaces and pods it is asked about. Not thread-safe (the caller holds a lock)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def drop(self, keep: Callable[[K], bool]) -> None:
        for key in [key for key in self._items if not keep(key)]:
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)


def check_namespace(namespace: str) -> str:
    """``namespace`` if Kubernetes could have it; ValueError before any API path is built with it."""
    if not is_namespace(namespace):
        raise ValueError(f"namespace: expected a DNS-1123 label (lowercase letters, digits, '-'), got {namespace!r}")
    return namespace


def check_name(name: str) -> str:
    if not is_object_name(name):
        raise ValueError(f"name: expected a DNS-1123 subdomain (a pod or job name), got {name!r}")
    return name


class KubeJobs:
    """The provider's live jobs per namespace, through the ``[torch_elastic] ui_kubernetes_conn_id`` connection.

    One lock per namespace is held while that namespace is listed (concurrent page views share one list); the
    caches' own lock is held only to read or write them, never across a call to the API server.
    """

    def __init__(self, conn_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.conn_id = conn_id
        self._clock = clock
        self._guard = threading.Lock()
        self._client_lock = threading.Lock()
        self._kube_client: SyncKube | None = None
        self._default_namespace: str | None = None
        self._listings: _Lru[str, _Listing] = _Lru(MAX_NAMESPACES)
        self._namespace_locks: _Lru[str, threading.Lock] = _Lru(MAX_NAMESPACES)
        self._logs: _Lru[tuple[str, str], tuple[float, str]] = _Lru(MAX_CACHED_LOGS)
        #: API calls made (lists and log reads), for tests and for the bound above.
        self.calls = 0

    def _kube(self) -> SyncKube:
        with self._client_lock:
            if self._kube_client is None:
                cluster = connect(self.conn_id)
                self._kube_client = cluster.sync_kube(request_timeout=_REQUEST_TIMEOUT)
                self._default_namespace = cluster.namespace
            return self._kube_client

    @property
    def default_namespace(self) -> str:
        self._kube()
        return self._default_namespace or "default"

    def _list(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        kube = self._kube()
        with self._guard:
            self.calls += 1
        return kube.list_kind(kind, check_namespace(namespace), MANAGED_SELECTOR)

    def _owners(self, kind: str, name: str, namespace: str) -> list[dict[str, Any]]:
        """What is between one job and its pods (a TrainJob's JobSet and Jobs): a list per query, per job."""
        kube = self._kube()
        with self._guard:
            self.calls += len(kinds.get(kind).intermediates)
        ref = JobRef(kind=kind, name=name, namespace=namespace)
        return [owner for query in kinds.get(kind).intermediates for owner in kube.owners(query, ref)]

    def read_log_tail(self, namespace: str, pod: str, container: str = TRAINING_CONTAINER) -> str:
        """The last lines of the pod's training container log, read now; raises :class:`KubeError`."""
        check_namespace(namespace)
        check_name(pod)
        kube = self._kube()
        with self._guard:
            self.calls += 1
        # Without timestamps: the page shows the lines as the container wrote them.
        read = ReadLog(pod, namespace, None, PAGE_LOG_LINES, container, limit_bytes=PAGE_LOG_BYTES, timestamps=False)
        return kube.read_log(read)

    def _lock_of(self, namespace: str) -> threading.Lock:
        with self._guard:
            lock = self._namespace_locks.get(namespace)
            if lock is None:
                lock = threading.Lock()
                self._namespace_locks.put(namespace, lock)
            return lock

    def _cached(self, namespace: str) -> tuple[LiveJob, ...] | None:
        with self._guard:
            cached = self._listings.get(namespace)
        return cached.jobs if cached is not None and self._clock() - cached.at < LIST_TTL else None

    def jobs(self, namespace: str) -> tuple[LiveJob, ...]:
        """The namespace's jobs with their pods: one list per kind plus one pod list, cached ``LIST_TTL`` seconds.

        A kind whose API is not served (no training operator installed: 404) has no jobs. ValueError, and no call,
        for a namespace Kubernetes cannot have.
        """
        check_namespace(namespace)
        cached = self._cached(namespace)
        if cached is not None:
            return cached
        with self._lock_of(namespace):
            # Another page view may have listed it while this one waited.
            cached = self._cached(namespace)
            if cached is not None:
                return cached
            pods = self._list("Pod", namespace)
            objects: dict[str, list[dict[str, Any]]] = {}
            for kind in _kinds():
                if kind == "Pod":
                    # Pods of a kind that owns pods are that job's; the rest are single-pod jobs.
                    objects[kind] = [p for p in pods if kinds.owner_of_pod(p) is None]
                    continue
                try:
                    objects[kind] = self._list(kind, namespace)
                except KubeError as e:
                    why = kinds.get(kind).unlisted_because(e)
                    if why is None:
                        raise
                    if why == kinds.DENIED:  # the other kinds' jobs still show, and the api-server's log says why
                        _log.warning("The UI may not list %s in %s (%s); see deploy/rbac-ui.yaml", kind, namespace, e)
                    objects[kind] = []
            owners = {
                (kind, name): self._owners(kind, name, namespace)
                for kind, items in objects.items()
                if kinds.get(kind).intermediates
                for name in (item.get("metadata", {}).get("name", "") for item in items)
            }
            listing = _Listing(at=self._clock(), jobs=tuple(group_live_jobs(objects, pods, owners)))
            # Forget the logs of pods that are gone, so the cache stays as small as what runs.
            alive = {(namespace, p.get("metadata", {}).get("name", "")) for p in pods}
            with self._guard:
                self._listings.put(namespace, listing)
                self._logs.drop(lambda key: key[0] != namespace or key in alive)
            return listing.jobs

    def find(self, namespace: str, name: str) -> LiveJob | None:
        return next((job for job in self.jobs(namespace) if job.name == name), None)

    def log_tail(self, namespace: str, pod: str, container: str = TRAINING_CONTAINER) -> str:
        """The last lines of the pod's training container log (cached ``LOG_TTL`` seconds); "" if unreadable, and
        without a read for a name Kubernetes cannot have. ``container``: the job kind's ``log_container``."""
        if not (is_namespace(namespace) and is_object_name(pod)):
            return ""
        key = (namespace, pod)
        with self._guard:
            cached = self._logs.get(key)
        if cached is not None and self._clock() - cached[0] < LOG_TTL:
            return cached[1]
        try:
            text = self.read_log_tail(namespace, pod, container)
        except KubeError:
            # A pod still starting (or deleted meanwhile) has no log yet: show none rather than fail the page.
            text = ""
        with self._guard:
            self._logs.put(key, (self._clock(), text))
        return text

    def log_tails(self, job: LiveJob) -> dict[str, str]:
        names = [p.get("metadata", {}).get("name", "") for p in job.pods][:LOG_PODS]
        container = kinds.get(job.kind).log_container
        return {name: self.log_tail(job.namespace, name, container) for name in names if is_object_name(name)}


def _kinds() -> Sequence[str]:
    return [kind.kind for kind in kinds.registered()]


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


def active_job_namespaces(dag_ids: Iterable[str] | None = None) -> dict[str, set[str]]:
    """``{namespace: {dag_id, ...}}`` where tasks that have not ended submitted jobs (the operator pushes
    ``job_namespace`` first), with the DAGs that did: any task can push that XCom, so a namespace is queried for a
    user only when one of its DAGs is one the user may read. Values that are no namespace name are left out."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = (
        select(XComModel.dag_id, XComModel.value)
        .join(TaskInstance, _xcom_of_task_instance())
        .where(XComModel.key == JOB_NAMESPACE_XCOM, TaskInstance.state.in_(ACTIVE_STATES))
        .limit(MAX_SUMMARIES)
    )
    if dag_ids is not None:
        query = query.where(XComModel.dag_id.in_(list(dag_ids)))
    with create_session() as session:
        rows = session.execute(query).all()
    namespaces: dict[str, set[str]] = {}
    for row in rows:
        value = _xcom_value(row.value, f"the {JOB_NAMESPACE_XCOM} XCom of DAG {row.dag_id}")
        if is_namespace(value):
            namespaces.setdefault(value, set()).add(row.dag_id)
    return namespaces


@dataclass(frozen=True)
class _Row:
    value: Any


#: An XCom row whose value Airflow could not read back.
_UNREADABLE: Final = object()


def _xcom_value(stored: Any, where: str) -> Any:
    """An XCom row's value as Airflow reads it back, or :data:`_UNREADABLE` (logged). Any task can push a value that
    Airflow's decoder refuses (a class name off its allow list raises ImportError; a value nested 2000 deep,
    RecursionError), and one such row must hide itself, not every page that lists rows."""
    from airflow.models.xcom import XComModel

    try:
        return XComModel.deserialize_value(_Row(stored))
    except Exception as e:  # the decoder's errors are Airflow's and open-ended; the row is what is at fault
        _log.warning("torch_elastic UI: %s cannot be read, not shown: %s: %s", where, type(e).__name__, e)
        return _UNREADABLE


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

    def job_namespaces(self) -> dict[str, set[str]]:
        """:func:`active_job_namespaces`: the namespaces of running tasks' jobs, with their DAGs."""
        return active_job_namespaces()

    def ended(self, jobs: Iterable[tuple[Identity, JobKey]]) -> set[JobKey]:
        """Which of these live jobs have a summary saved by their own task instance (their task decided they ended,
        whatever Kubernetes still shows). A summary of another task naming the same job hides nothing."""
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select, tuple_

        wanted = {(i.dag_id, i.task_id, i.run_id, i.map_index, *key) for i, key in jobs}
        if not wanted:
            return set()
        # The task instance's columns (indexed), not the summaries' JSON: only the rows of these tasks are read.
        row_keys = sorted({(dag_id, task_id, run_id) for dag_id, task_id, run_id, *_ in wanted})
        columns = (XComModel.dag_id, XComModel.task_id, XComModel.run_id)
        statement = select(
            *columns,
            XComModel.map_index,
            XComModel.value["namespace"].as_string(),
            XComModel.value["name"].as_string(),
        ).where(XComModel.key == SUMMARY_XCOM_KEY, tuple_(*columns).in_(row_keys))
        with create_session() as session:
            found = {tuple(row) for row in session.execute(statement)}
        return {(namespace, name) for *_, namespace, name in found & wanted}

    def naming(self, namespace: str | None, name: str, dag_ids: Collection[str]) -> list[Identity]:
        """The task instances, among those of ``dag_ids``, whose summary names the job ``namespace/name``
        (``namespace`` None: a local run), newest first, with their current try.

        Any task can push a summary naming any job: the DAGs are filtered in the query, before its limit, so rows of
        DAGs the user may not read cannot crowd out the job's own. Only keys are read; the caller keeps the task
        instance that could have run a job of that name (:func:`views.is_job_of`) and reads its summary by its keys
        (:meth:`latest`).
        """
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        if not dag_ids:
            return []
        named = XComModel.value["namespace"].as_string()
        statement = (
            select(XComModel.dag_id, XComModel.task_id, XComModel.run_id, XComModel.map_index, TaskInstance.try_number)
            .outerjoin(TaskInstance, _xcom_of_task_instance())
            .where(
                XComModel.key == SUMMARY_XCOM_KEY,
                XComModel.dag_id.in_(sorted(dag_ids)),
                XComModel.value["name"].as_string() == name,
                named.is_(None) if namespace is None else named == namespace,
            )
            .order_by(XComModel.timestamp.desc())
            .limit(MAX_NAME_MATCHES)
        )
        with create_session() as session:
            return [_identity_of(row) for row in session.execute(statement)]

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
        found = []
        for row in rows:
            identity = _identity_of(row)
            value = _xcom_value(row.value, f"the {SUMMARY_XCOM_KEY} XCom of {describe(identity)}")
            if value is not _UNREADABLE:
                found.append((identity, value))
        return found


def _identity_of(row: Any) -> Identity:
    """The task instance try of an XCom row joined with its task instance (no try where the instance is gone)."""
    return Identity(
        dag_id=row.dag_id, task_id=row.task_id, run_id=row.run_id, map_index=row.map_index, try_number=row.try_number
    )
