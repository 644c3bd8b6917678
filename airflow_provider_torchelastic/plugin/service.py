"""The two questions the pages ask (which jobs; this job in detail), answered from Kubernetes and the database.

Glue between :mod:`.sources` (I/O) and :mod:`.views` (pure): reads, filters by what the user may see, shapes rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from airflow_provider_torchelastic.core.metrics_format import MetricSeries, format_metrics, parse_metrics_line
from airflow_provider_torchelastic.plugin import views
from airflow_provider_torchelastic.plugin.sources import (
    LOG_PODS,
    KubeJobs,
    Summaries,
    SummaryQuery,
    active_job_namespaces,
)
from airflow_provider_torchelastic.plugin.views import Identity, LiveJob

__all__ = ["JobsService", "KubernetesUnavailable", "RunningMetrics"]


class KubernetesUnavailable(RuntimeError):
    """A live job could not be read from Kubernetes (the API maps it to 503)."""


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
        parsed = parse_metrics_line(line)
        lines.append(line if parsed is None else f"metrics: {format_metrics(parsed.step, parsed.last)}")
    return "\n".join(lines)


class JobsService:
    def __init__(self, kube: KubeJobs, summaries: Summaries, *, base_path: str = "") -> None:
        self.kube = kube
        self.summaries = summaries
        self.base_path = base_path
        self.metrics = RunningMetrics()
        #: The pod whose log has a running job's metrics lines (rank 0's); bounded like the series.
        self._metrics_pod: dict[views.JobKey, str] = {}

    def _namespaces(self) -> set[str]:
        return {self.kube.default_namespace, *active_job_namespaces(None)}

    def _live(self) -> tuple[list[LiveJob], str | None]:
        """Running jobs, and why there are none when Kubernetes cannot be read (the finished ones still show)."""
        jobs: list[LiveJob] = []
        try:
            for namespace in sorted(self._namespaces()):
                jobs.extend(self.kube.jobs(namespace))
        except Exception as e:  # no connection, no permission, API down: a page of finished jobs is still worth it
            error = f"running jobs could not be read from Kubernetes ({self.kube.conn_id}): {e}"
            log.warning("%s", error)
            return [], error
        return jobs, None

    def list_jobs(
        self,
        readable: Callable[[set[str]], set[str]],
        *,
        dag_id: str | None = None,
        phase: str | None = None,
        run_id: str | None = None,
        task_id: str | None = None,
        map_index: int | None = None,
        offset: int = 0,
        limit: int = 50,
    ) -> dict[str, Any]:
        """``{"jobs": [...], "kubernetes_error": None | why running jobs are missing}``, newest first.

        ``readable(dag_ids)`` says which DAGs the user may read; jobs of others are not shown at all.
        """
        now = time.time()
        live_jobs, kube_error = self._live()
        wanted = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index}
        live_rows = [
            row
            for job in live_jobs
            if (row := views.job_row_from_live(job, now=now, base_path=self.base_path)) is not None
            and all(value is None or row[key] == value for key, value in wanted.items())
        ]
        allowed = readable({row["dag_id"] for row in live_rows} | self.summaries.dag_ids())
        # A job whose task saved its summary has ended, whatever its object (not deleted yet) still says.
        ended = self.summaries.ended(row["name"] for row in live_rows)
        live_rows = [row for row in live_rows if row["dag_id"] in allowed and row["name"] not in ended]
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
            for identity, value in self.summaries.latest(query)
            if (summary := views.summary_from_xcom(value)) is not None
        ]
        page = views.merge_rows(live_rows, finished, phase=phase, offset=offset, limit=limit)
        # Sparklines of the page's running jobs, from the cached log tail of the pod that holds rank 0 (the one whose
        # log has metrics lines): at most SPARKLINE_LOG_READS log reads per page, each cached LOG_TTL seconds.
        by_key = {job.key: job for job in live_jobs}
        budget = SPARKLINE_LOG_READS
        for row in page:
            live = by_key.get((row["namespace"], row["name"]))
            if row["source"] == "summary" and row["sparkline"] is None:
                row["sparkline"] = views.sparkline(series_to_json(self.metrics.get((row["namespace"], row["name"]))))
            if row["source"] != "kubernetes" or live is None:
                continue
            series, budget = self._running_series(live, budget)
            row["sparkline"] = views.sparkline(series_to_json(series))
        return {"jobs": page, "kubernetes_error": kube_error}

    def _running_series(self, job: LiveJob, budget: int) -> tuple[MetricSeries | None, int]:
        """The job's series, grown from the log of its rank-0 pod (found once, then remembered)."""
        known = self._metrics_pod.get(job.key)
        names = [known] if known else [p.get("metadata", {}).get("name", "") for p in job.pods][:LOG_PODS]
        for name in names:
            if budget <= 0:
                break
            budget -= 1
            series = self.metrics.feed(job.key, self.kube.log_tail(job.namespace, name))
            if len(series):
                self._metrics_pod[job.key] = name
                if len(self._metrics_pod) > MAX_TRACKED_JOBS:
                    self._metrics_pod.pop(next(iter(self._metrics_pod)))
                break
        return self.metrics.get(job.key), budget

    def job(self, namespace: str, name: str, can_read: Callable[[str], bool]) -> dict[str, Any] | None:
        """The job in detail, or None when it does not exist or the user may not read its DAG."""
        finished = self._find_summary(namespace, name)
        if finished is not None:
            identity, summary = finished
            if not can_read(identity.dag_id):
                return None
            if not summary.get("metrics"):
                # The summary missed them (rank 0's pod ended before the task read its log): what this process saw
                # of the job while it ran is better than no chart.
                seen = series_to_json(self.metrics.get((namespace, name)))
                summary = {**summary, "metrics": seen} if seen else summary
            return views.job_detail_from_summary(summary, identity, base_path=self.base_path)
        if namespace == views.LOCAL_NAMESPACE:
            return None
        try:
            job = self.kube.find(namespace, name)
            if job is None or job.identity is None or not can_read(job.identity.dag_id):
                return None
            tails = self.kube.log_tails(job)
        except Exception as e:  # no connection, no permission, API down: the API answers 503 and says why
            raise KubernetesUnavailable(f"{type(e).__name__}: {e}") from e
        series = None
        for text in tails.values():
            series = self.metrics.feed(job.key, text) if text else series
        return views.job_detail_from_live(
            job,
            now=time.time(),
            base_path=self.base_path,
            log_tails={pod: readable_log(text) for pod, text in tails.items()},
            metrics=series_to_json(series or self.metrics.get(job.key)),
        )

    def _find_summary(self, namespace: str, name: str) -> tuple[Identity, dict[str, Any]] | None:
        found = self.summaries.find(None if namespace == views.LOCAL_NAMESPACE else namespace, name)
        if found is None:
            return None
        identity, value = found
        summary = views.summary_from_xcom(value)
        return (identity, summary) if summary is not None else None
