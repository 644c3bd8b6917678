"""What a finished training becomes: rank 0's value (from the termination message, the result file or result
storage) or the exception that says whether a retry can help, and the job summary the UI shows."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from airflow_provider_torchelastic.core.artifact_ref import ArtifactRef, ArtifactRefError, check_refs_under
from airflow_provider_torchelastic.core.encoding import as_authored
from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.core.run_context import TaskContext, artifact_location, result_location
from airflow_provider_torchelastic.core.safe_files import local_path, read_regular, remove_file
from airflow_provider_torchelastic.operators.exceptions import (
    ConfigurationError,
    InfrastructureError,
    class_for,
    error_for_verdict,
)
from airflow_provider_torchelastic.settings import ArtifactStorage, ResultStorage, Settings

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_torchelastic.core.launch import LaunchSpec
    from airflow_provider_torchelastic.core.naming import RunIdentity
    from airflow_provider_torchelastic.core.summary import JobSummary
    from airflow_provider_torchelastic.core.tap import MetricsTap
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, WaitDecision
    from airflow_provider_torchelastic.local.run import LocalRun

__all__ = [
    "ResultStorage",
    "checked_artifacts",
    "expected_result_ref",
    "finish",
    "job_summary",
    "local_summary",
    "push_job_summary",
    "read_stored_result",
    "result_or_raise",
    "result_url",
    "settle",
]


class Log(Protocol):
    """The task's logger, as far as results use it (Airflow's is a structlog logger, not a ``logging.Logger``)."""

    def info(self, msg: str, /, *args: Any) -> Any: ...
    def warning(self, msg: str, /, *args: Any) -> Any: ...
    def error(self, msg: str, /, *args: Any) -> Any: ...


def result_url(storage: ResultStorage | None, task_context: TaskContext) -> str | None:
    """Where this try's rank 0 writes a result too large for its result file, when result storage is configured."""
    return result_location(storage.url, task_context) if storage is not None else None


def expected_result_ref(ref: str, storage: ResultStorage | None, task_context: TaskContext | None) -> str:
    """``ref`` when it is the location this try's result belongs at (recomputed here from the try's own context and
    ``[torch_elastic] result_storage``), else :class:`ConfigurationError` naming both.

    The reference comes from the pod (its termination message), so it is the pod's to choose: anything else (a file
    on the Airflow worker, a link-local URL, another try's object) would be read with the platform's credentials
    and then deleted. A retry would get the same refusal.
    """
    expected = result_url(storage, task_context) if task_context is not None else None
    if expected is None or ref != expected:
        where = expected if expected is not None else "none (no [torch_elastic] result_storage for this try)"
        raise ConfigurationError(
            f"Training reported its result at {ref!r}, which is not where this try's result belongs (expected: "
            f"{where}); refusing to read it (a retry will not help)"
        )
    return expected


def read_stored_result(url: str, storage: ResultStorage | None) -> Any:
    """Rank 0's value written to result storage: JSON, read with Airflow's ``ObjectStoragePath`` (the connection
    ``[torch_elastic] result_storage_conn_id`` holds the credentials), then deleted unless
    ``[torch_elastic] result_storage_keep``. Never unpickled; at most ``[torch_elastic] result_storage_max_bytes``
    are read (beyond, :class:`ConfigurationError`: the same result is as large on a retry). ``url`` must already be
    checked (:func:`expected_result_ref`).

    In a local store (a path or ``file://``), which the pods write too, the file must be a regular file reached from
    the storage's root through no symbolic link (else :class:`ConfigurationError`): a planted link would make any
    file the Airflow worker can read the task's XCom."""
    from airflow.sdk import ObjectStoragePath

    from airflow_provider_torchelastic.core.outcome import decode_result
    from airflow_provider_torchelastic.settings import DEFAULT_RESULT_MAX_BYTES

    conn_id = storage.conn_id if storage is not None else None
    limit = storage.max_bytes if storage is not None else DEFAULT_RESULT_MAX_BYTES
    local = local_path(url)
    root = local_path(storage.url) if storage is not None else None
    # One byte more than allowed says it is too large without reading all of it.
    if local is not None:
        data = read_regular(local, root=root, limit=limit + 1, error=_refused_result)
    else:
        path = ObjectStoragePath(url, conn_id=conn_id)
        with path.open("rb") as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigurationError(
            f"Training succeeded but rank 0's result at {url} is larger than [torch_elastic] result_storage_max_bytes "
            f"({limit} bytes); raise the option or return a smaller value (a retry will not help)"
        )
    value = decode_result(data)
    if storage is None or not storage.keep:
        if local is not None:
            remove_file(local, root=root, error=_refused_result)
        else:
            path.unlink(missing_ok=True)
    return value


def _refused_result(problem: str) -> ConfigurationError:
    return ConfigurationError(
        f"Training succeeded but rank 0's result cannot be accepted from its local store: {problem} (a retry will "
        "not help)"
    )


def checked_artifacts(
    value: Any, storage: ArtifactStorage | None, task_context: TaskContext | None
) -> list[ArtifactRef]:
    """The artifact references in rank 0's value, each checked to lie under this try's artifact location
    (recomputed here from the try's own context and ``[torch_elastic] artifact_storage``), else
    :class:`ConfigurationError`: the value came from a pod, which must not point the next task at another try's
    objects, or at anything else the platform's credentials could read."""
    location = artifact_location(storage.url, task_context) if storage is not None and task_context else None
    try:
        return check_refs_under(value, location)
    except ArtifactRefError as e:
        raise ConfigurationError(
            f"Training succeeded but its value cannot be accepted: {e}; refusing it (a retry will not help)"
        ) from None


def settle(
    log: Log, verdict: Verdict, settings: Settings, *, last_metrics: str, task_context: TaskContext | None
) -> Any:
    """Rank 0's result, or the Airflow exception that says what failed and whether a retry can help.

    ``last_metrics`` (``MetricsTap.summary_line()``) ends the task's final log line: the last reported values.
    ``task_context``: the try's, from which the one location a result in result storage may be read from is
    recomputed (without it, none may); ``settings``: the try's, whose result and artifact storage are read."""
    return result_or_raise(
        log,
        verdict,
        settings.result_storage,
        last_metrics=last_metrics,
        task_context=task_context,
        artifacts=settings.artifact_storage,
    )


def result_or_raise(
    log: Log,
    verdict: Verdict,
    storage: ResultStorage | None,
    *,
    last_metrics: str = "",
    task_context: TaskContext | None = None,
    artifacts: ArtifactStorage | None = None,
) -> Any:
    """:func:`settle` with the storages named one by one.

    ``task_context``: the try's, from which the only acceptable result reference and artifact location are
    recomputed; without it a verdict that carries a reference fails. ``artifacts``: the try's artifact storage.
    """
    value = _value_or_raise(log, verdict, storage, task_context, last_metrics)
    found = checked_artifacts(value, artifacts, task_context)
    if found:
        total = sum(ref.bytes for ref in found)
        log.info("Rank 0's value holds %d artifact(s), %d bytes in all:", len(found), total)
        for ref in found:
            log.info("  %s (%s, %d bytes)", ref.url, ref.kind, ref.bytes)
    return value


def _value_or_raise(
    log: Log, verdict: Verdict, storage: ResultStorage | None, task_context: TaskContext | None, last_metrics: str
) -> Any:
    """Rank 0's value (read from the result storage when the verdict carries a reference), or the task's exception."""
    suffix = f"; {last_metrics}" if last_metrics else ""
    if verdict.succeeded and verdict.result_ref is not None:
        url = expected_result_ref(verdict.result_ref, storage, task_context)
        try:
            value = read_stored_result(url, storage)
        except ConfigurationError:  # too large, or not a regular file of the store: refused on a retry too
            raise
        except Exception as e:  # the store or its connection failed: the training is done, but its value is not
            raise InfrastructureError(
                f"Training succeeded but rank 0's result could not be read from {url} "
                f"(result storage, connection [torch_elastic] result_storage_conn_id): {type(e).__name__}: {e}"
            ) from e
        log.info("Training succeeded; rank 0's result read from %s%s", url, suffix)
        return value
    if verdict.succeeded:
        log.info("Training succeeded; rank 0's result: %r%s", verdict.result, suffix)
        return verdict.result
    if verdict.failure is not None and verdict.failure.traceback:
        log.error("Root cause, %s, traceback:\n%s", verdict.failure.summary(), as_authored(verdict.failure.traceback))
    if last_metrics:
        log.info("Training failed; %s", last_metrics)
    cls = class_for(verdict.cause, recoverable=verdict.recoverable)
    help_ = "a retry may help" if cls.recoverable else "a retry will not help"
    raise error_for_verdict(verdict, f"Training failed, {help_} ({cls.__name__}): {verdict.detail}")


def push_job_summary(
    log: Log,
    context: Context,
    summary: JobSummary,
    *,
    secrets: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Save the job summary (the UI's record of a finished job) as the XCom ``torch_elastic_job``, with ``secrets``
    and everything the task's masker knows redacted; ``extra`` adds keys (what ``retry_resources`` gave the try)."""
    from airflow_provider_torchelastic.core.summary import XCOM_KEY
    from airflow_provider_torchelastic.operators.masking import mask_summary

    try:
        # Log tails and messages come from the pods: nothing the task's masker knows may reach the UI through them.
        context["ti"].xcom_push(key=XCOM_KEY, value=mask_summary({**summary.to_dict(), **(extra or {})}, secrets))
    except Exception as e:  # the training's outcome stands; only the UI's record of it is missing
        log.warning("Could not save the job summary (XCom %r): %s", XCOM_KEY, e)


def finish(
    log: Log,
    context: Context,
    summary: JobSummary,
    read_value: Callable[[], Any],
    *,
    secrets: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """Rank 0's value (``read_value()``: the result, or the Airflow exception that says what failed), with the job
    summary saved first: listing the value's artifacts once it was accepted, or without them when it was not."""
    try:
        value = read_value()
    except BaseException:
        push_job_summary(log, context, summary, secrets=secrets, extra=extra)
        raise
    push_job_summary(log, context, summary.with_artifacts(value), secrets=secrets, extra=extra)
    return value


def local_summary(
    identity: RunIdentity, spec: LaunchSpec, run: LocalRun, verdict: Verdict, tap: MetricsTap, started: float
) -> JobSummary:
    """The job summary of a local run: its workers stand for the pods."""
    import socket

    from airflow_provider_torchelastic.core.naming import job_name
    from airflow_provider_torchelastic.core.summary import local_job_summary

    nproc = str(spec.nproc_per_node)
    return local_job_summary(
        # The name the try's job would have on Kubernetes: unique per try, and the same key for the UI.
        name=job_name(identity),
        reports=run.reports,
        succeeded=verdict.succeeded,
        root_cause=verdict.detail,
        created=started,
        finished=time.time(),
        nproc_per_node=int(nproc) if nproc.isdigit() else None,
        hostname=socket.gethostname(),
        tails=tap.tails(),
        series=tap.series,
    )


def job_summary(ref: JobRef, decision: WaitDecision, verdict: Verdict, context: Context, tap: MetricsTap) -> JobSummary:
    """The job summary of a Kubernetes job, from the wait's last decision and what the metrics tap kept."""
    from airflow_provider_torchelastic.core.summary import JobSummary, with_log_tails

    start = getattr(context["ti"], "start_date", None)
    created = decision.created or (start.timestamp() if start is not None else time.time())
    return JobSummary.build(
        kind=ref.kind,
        namespace=ref.namespace,
        name=ref.name,
        succeeded=verdict.succeeded,
        created=created,
        finished=time.time(),
        root_cause=verdict.detail,
        pods=with_log_tails(decision.pods, tap.tails()),
        series=tap.series,
    )
