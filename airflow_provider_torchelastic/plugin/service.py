"""The two questions the pages ask (which jobs; this job in detail), answered from Kubernetes and the database.

Glue between :mod:`.sources` (I/O) and :mod:`.views` (pure): reads, filters by what the user may see, shapes rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final, Protocol

from airflow_provider_torchelastic.core.metrics_format import (
    MetricSeries,
    format_metrics,
    parse_metrics_line,
    split_glued,
)
from airflow_provider_torchelastic.core.redaction import redact_text, sensitive_env_values
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.plugin import views
from airflow_provider_torchelastic.plugin.sources import LOG_PODS, KubeJobs, Summaries, SummaryQuery
from airflow_provider_torchelastic.plugin.views import Identity, LiveJob

__all__ = ["JobsService", "KubernetesUnavailable", "RunningMetrics", "Viewer", "mask"]


class KubernetesUnavailable(RuntimeError):
    """A live job could not be read from Kubernetes (the API maps it to 503)."""


class Viewer(Protocol):
    """What the user of one request may see (:class:`.access.UserAccess`; tests give a fake)."""

    def readable(self, dag_ids: set[str]) -> set[str]: ...
    def can_read(self, dag_id: str) -> bool: ...
    def can_read_logs(self, dag_id: str) -> bool: ...
    def sees_kubernetes_errors(self) -> bool: ...


#: What a user who may not read the UI's Kubernetes connection is told instead of Kubernetes' own message.
GENERIC_KUBE_ERROR: Final = "Kubernetes could not be read; the api-server's log says why"


def mask(text: str) -> str:
    """``text`` with every value registered as secret replaced by ``***``, by Airflow's secrets maskers: the task
    SDK's, which ``mask_secret`` and the SDK's connections and Variables register into, and the core's, which the
    api-server (where this runs) registers the connections and variables it reads into (:func:`..compat.redact`)."""
    from airflow_provider_torchelastic.compat import redact

    return str(redact(text))


#: Running jobs whose series are kept (the least recently updated go first): memory stays bounded.
MAX_TRACKED_JOBS: Final = 256
#: Running jobs of one list page whose rank-0 pod log is read for the sparkline (each read is cached LOG_TTL).
SPARKLINE_LOG_READS: Final = 20

log = logging.getLogger(__name__)


class RunningMetrics:
    """Metric series of running jobs, grown from the metrics lines of their log tails (``metrics.MetricSeries``,
    bounded per job). A line is taken once: lines carry the points since the previous one, at increasing steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[views.JobKey, tuple[MetricSeries, float]] = {}

    def feed(self, key: views.JobKey, text: str) -> MetricSeries:
        with self._lock:
            series, seen = self._series.pop(key, (MetricSeries(), float("-inf")))
            for line in text.splitlines():
                parsed = parse_metrics_line(line)
                if parsed is None or parsed.step is None or parsed.step <= seen:
                    continue
                series.extend(parsed)
                seen = parsed.step
            self._series[key] = (series, seen)  # re-inserted last: the dict's order is least recently fed first
            while len(self._series) > MAX_TRACKED_JOBS:
                self._series.pop(next(iter(self._series)))
            return series

    def get(self, key: views.JobKey) -> MetricSeries | None:
        with self._lock:
            found = self._series.get(key)
            return found[0] if found else None


def series_to_json(series: MetricSeries | None) -> dict[str, list[list[float]]]:
    if series is None:
        return {}
    return {name: [[step, value] for step, value in series.points(name)] for name in series.names}


def readable_log(text: str) -> str:
    """A log tail as a person reads it: metrics lines in the task log's words, not as JSON."""
    lines = []
    for line in text.splitlines():
        unfinished, rest = split_glued(line)
        if unfinished:  # another worker's unfinished line, which a metrics line followed
            lines.append(unfinished)
        parsed = parse_metrics_line(rest)
        lines.append(rest if parsed is None else f"metrics: {format_metrics(parsed.step, parsed.last)}")
    return "\n".join(lines)


class JobsService:
    def __init__(self, kube: KubeJobs, summaries: Summaries, *, base_path: str = "") -> None:
        self.kube = kube
        self.summaries = summaries
        self.base_path = base_path
        self.metrics = RunningMetrics()
        #: The pod whose log has a running job's metrics lines (rank 0's); bounded like the series.
        self._metrics_pod: dict[views.JobKey, str] = {}

    def _namespaces(self, viewer: Viewer, candidates: Mapping[str, set[str]]) -> list[str]:
        """The connection's namespace, and those where running tasks of DAGs the user may read have jobs: a
        ``job_namespace`` XCom of another DAG makes the UI query nothing."""
        readable = viewer.readable(set().union(*candidates.values())) if candidates else set()
        chosen = {self.kube.default_namespace} | {ns for ns, dag_ids in candidates.items() if dag_ids & readable}
        return sorted(chosen)

    def _kube_error(self, viewer: Viewer, namespace: str | None, error: Exception) -> str:
        """The page's line on why the running jobs of ``namespace`` (None: of every namespace, the connection itself
        failed) are missing; Kubernetes' own words only for those who may see them."""
        conn_id = self.kube.conn_id
        where = f"namespace {namespace}" if namespace is not None else "any namespace"
        log.warning("torch_elastic UI: running jobs of %s could not be read (%s): %s", where, conn_id, error)
        why = f"{error}" if viewer.sees_kubernetes_errors() else GENERIC_KUBE_ERROR
        jobs = f"Running jobs in namespace {namespace}" if namespace is not None else "Running jobs"
        return f"{jobs} are not shown, finished ones are: Kubernetes ({conn_id}) could not be read: {why}"

    def _live(self, viewer: Viewer) -> tuple[list[LiveJob], dict[str, str]]:
        """Running jobs, and why those of a namespace are missing (the others, and the finished ones, still show)."""
        jobs: list[LiveJob] = []
        errors: dict[str, str] = {}
        try:
            namespaces = self._namespaces(viewer, self.summaries.job_namespaces())
        except Exception as e:  # no connection: a page of finished jobs is still worth it
            return [], {"": self._kube_error(viewer, None, e)}
        for namespace in namespaces:
            try:
                jobs.extend(self.kube.jobs(namespace))
            except Exception as e:  # no permission there, API down: only this namespace's jobs are missing
                errors[namespace] = self._kube_error(viewer, namespace, e)
        return jobs, errors

    def list_jobs(
        self,
        viewer: Viewer,
        *,
        dag_id: str | None = None,
        phase: str | None = None,
        run_id: str | None = None,
        task_id: str | None = None,
        map_index: int | None = None,
        offset: int = 0,
        limit: int = 50,
    ) -> dict[str, Any]:
        """``{"jobs": [...], "kubernetes_error": None | why running jobs are missing, "kubernetes_errors":
        {namespace: why}}``, newest first. Jobs of DAGs the ``viewer`` may not read are not shown at all."""
        now = time.time()
        live_jobs, kube_errors = self._live(viewer)
        wanted = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index}
        live = [
            (job, row)
            for job in live_jobs
            if (row := views.job_row_from_live(job, now=now, base_path=self.base_path)) is not None
            and all(value is None or row[key] == value for key, value in wanted.items())
        ]
        allowed = viewer.readable({row["dag_id"] for _, row in live} | self.summaries.dag_ids())
        live = [(job, row) for job, row in live if row["dag_id"] in allowed]
        # A job whose own task saved its summary has ended, whatever its object (not deleted yet) still says.
        ended = self.summaries.ended((job.identity, job.key) for job, _ in live if job.identity is not None)
        live_rows = [row for job, row in live if job.key not in ended]
        query = SummaryQuery(
            dag_ids=frozenset(allowed),
            dag_id=dag_id,
            run_id=run_id,
            task_id=task_id,
            map_index=map_index,
            phase=phase,
            limit=offset + limit,
        )
        finished = [
            views.job_row_from_summary(summary, identity, base_path=self.base_path)
            for identity, summary in _readable_summaries(self.summaries.latest(query))
            if views.summary_belongs_to(summary, identity)
        ]
        page = views.merge_rows(live_rows, finished, phase=phase, offset=offset, limit=limit)
        for row in page:
            row["root_cause"] = mask(row["root_cause"]) if row.get("root_cause") else row.get("root_cause")
        # Sparklines of the page's running jobs, from the cached log tail of the pod that holds rank 0 (the one whose
        # log has metrics lines): at most SPARKLINE_LOG_READS log reads per page, each cached LOG_TTL seconds.
        by_key = {job.key: job for job in live_jobs}
        budget = SPARKLINE_LOG_READS
        for row in page:
            running = by_key.get((row["namespace"], row["name"]))
            if row["source"] == "summary" and row["sparkline"] is None:
                row["sparkline"] = views.sparkline(series_to_json(self.metrics.get((row["namespace"], row["name"]))))
            if row["source"] != "kubernetes" or running is None:
                continue
            series, budget = self._running_series(running, budget)
            row["sparkline"] = views.sparkline(series_to_json(series))
        kube_error = "; ".join(kube_errors.values()) or None
        return {"jobs": page, "kubernetes_error": kube_error, "kubernetes_errors": kube_errors}

    def _running_series(self, job: LiveJob, budget: int) -> tuple[MetricSeries | None, int]:
        """The job's series, grown from the log of its rank-0 pod (found once, then remembered)."""
        known = self._metrics_pod.get(job.key)
        names = [known] if known else [p.get("metadata", {}).get("name", "") for p in job.pods][:LOG_PODS]
        for name in names:
            if budget <= 0:
                break
            budget -= 1
            series = self.metrics.feed(
                job.key, self.kube.log_tail(job.namespace, name, kinds.get(job.kind).log_container)
            )
            if len(series):
                self._metrics_pod[job.key] = name
                if len(self._metrics_pod) > MAX_TRACKED_JOBS:
                    self._metrics_pod.pop(next(iter(self._metrics_pod)))
                break
        return self.metrics.get(job.key), budget

    def job(self, namespace: str, name: str, viewer: Viewer) -> dict[str, Any] | None:
        """The job in detail, or None when it does not exist, is no name Kubernetes could have, or the user may not
        read its DAG. Log tails only for users who may read the DAG's task logs, masked.

        A job's summary is found by the job's identity (its task instance try), never by its name alone: any task can
        push a summary naming any job. The name resolves to that identity through the summary rows of the DAGs the
        user may read (a finished job, whose object may be gone) or through the live object's annotations.
        """
        local = namespace == views.LOCAL_NAMESPACE
        if not views.is_object_name(name) or not (local or views.is_namespace(namespace)):
            return None
        finished = self._find_summary(namespace, name, viewer)
        if finished is not None:
            return self._summary_detail(namespace, name, *finished, viewer)
        if local:
            return None
        try:
            if namespace not in self._namespaces(viewer, self.summaries.job_namespaces()):
                return None
            job = self.kube.find(namespace, name)
        except Exception as e:  # no connection, no permission, API down: the API answers 503 and says why
            raise KubernetesUnavailable(f"{type(e).__name__}: {e}") from e
        if job is None or job.identity is None or not viewer.can_read(job.identity.dag_id):
            return None
        # Its task saved the summary while the object is not deleted yet, and rows naming the job crowded it out of
        # the name's lookup: the identity the object carries still finds the task's own verdict.
        own = self._own_summary(job.identity, namespace, name)
        if own is not None:
            return self._summary_detail(namespace, name, *own, viewer)
        logs = viewer.can_read_logs(job.identity.dag_id)
        try:
            tails = self.kube.log_tails(job) if logs else {}
        except Exception as e:
            raise KubernetesUnavailable(f"{type(e).__name__}: {e}") from e
        series = None
        for text in tails.values():
            series = self.metrics.feed(job.key, text) if text else series
        live = views.job_detail_from_live(
            job,
            now=time.time(),
            base_path=self.base_path,
            # Masked with the try's own sensitive values too, as the task masks its log: the api-server's masker
            # knows only what the api-server read, and a running job prints to this tail first.
            log_tails={pod: readable_log(redact_text(text, _secrets_of(job))) for pod, text in tails.items()},
            metrics=series_to_json(series or self.metrics.get(job.key)),
        )
        return None if live is None else _shown(live, logs=logs)

    def _summary_detail(
        self, namespace: str, name: str, identity: Identity, summary: dict[str, Any], viewer: Viewer
    ) -> dict[str, Any]:
        if not summary.get("metrics"):
            # The summary missed them (rank 0's pod ended before the task read its log): what this process saw of the
            # job while it ran is better than no chart.
            seen = series_to_json(self.metrics.get((namespace, name)))
            summary = {**summary, "metrics": seen} if seen else summary
        detail = views.job_detail_from_summary(summary, identity, base_path=self.base_path)
        return _shown(detail, logs=viewer.can_read_logs(identity.dag_id))

    def _find_summary(self, namespace: str, name: str, viewer: Viewer) -> tuple[Identity, dict[str, Any]] | None:
        """The summary of the job ``namespace/name`` saved by the job's own task, if the user may read its DAG: the
        name resolved to that task instance among the DAGs the user may read, then its row read by its keys."""
        readable = viewer.readable(self.summaries.dag_ids())
        local = namespace == views.LOCAL_NAMESPACE
        for identity in self.summaries.naming(None if local else namespace, name, readable):
            if views.is_job_of(name, identity) and viewer.can_read(identity.dag_id):
                found = self._own_summary(identity, namespace, name)
                if found is not None:
                    return found
        return None

    def _own_summary(self, identity: Identity, namespace: str, name: str) -> tuple[Identity, dict[str, Any]] | None:
        """The summary that ``identity``'s task instance saved, if it is the one of the job ``namespace/name`` (not
        that of another try, or one naming another job): one row, read by the task instance's keys."""
        query = SummaryQuery(
            dag_ids=frozenset({identity.dag_id}),
            dag_id=identity.dag_id,
            run_id=identity.run_id,
            task_id=identity.task_id,
            map_index=identity.map_index,
            limit=1,
        )
        for row, summary in _readable_summaries(self.summaries.latest(query)):
            named = (views.summary_namespace(summary), summary.get("name"))
            if named == (namespace, name) and views.summary_belongs_to(summary, row):
                return row, summary
        return None


def _readable_summaries(rows: Iterable[tuple[Identity, Any]]) -> Iterator[tuple[Identity, dict[str, Any]]]:
    """The rows that hold a job summary, read. Any DAG can push a value under the summaries' key: one that is no
    summary is logged and skipped, so that it hides itself, not the page (it is read before the filters that would
    hide another DAG's row)."""
    for identity, value in rows:
        try:
            summary = views.read_summary(value)
        except ValueError as e:
            log.warning(
                "torch_elastic UI: the %s XCom of %s is no job summary, not shown: %s",
                views.SUMMARY_XCOM_KEY,
                views.describe(identity),
                e,
            )
            continue
        yield identity, summary


def _secrets_of(job: LiveJob) -> tuple[str, ...]:
    """The values of the env entries with sensitive names in the job's and its pods' specs (plain values, which the
    task masks in its own log and summary; a value from a Secret is in no spec, and in no masker either)."""
    from airflow_provider_torchelastic.compat import is_sensitive_name

    return sensitive_env_values([job.obj, *job.pods], is_sensitive_name)


def _shown(detail: dict[str, Any], *, logs: bool) -> dict[str, Any]:
    """The detail as the user may see it: log tails only with TASK_LOGS, texts masked."""
    pods: Iterable[dict[str, Any]] = detail.get("pods") or []
    detail["pods"] = [
        {**pod, "message": mask(pod.get("message") or ""), "log_tail": mask(pod.get("log_tail") or "") if logs else ""}
        for pod in pods
    ]
    detail["logs_hidden"] = not logs
    if detail.get("root_cause"):
        detail["root_cause"] = mask(detail["root_cause"])
    return detail
