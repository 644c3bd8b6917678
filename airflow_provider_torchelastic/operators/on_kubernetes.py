"""The operator on Kubernetes: render the try's objects, submit them (:mod:`..kubernetes.submit`), then wait here
or defer to the trigger, and turn the wait's decision into the task's result.

The Airflow side of the backend: the hook, XCom, the task state store, deferral and the task's exceptions.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn

from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.core.redaction import redacting
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.hooks import async_hook, connect, connection_of
from airflow_provider_torchelastic.kubernetes import kinds, submit, sweep
from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection
from airflow_provider_torchelastic.kubernetes.queue_limits import QueueLimits
from airflow_provider_torchelastic.kubernetes.render import elide_payload, summarize_for_ui, task_context_for
from airflow_provider_torchelastic.kubernetes.status import JobRef, WaitDecision, WaitPolicy
from airflow_provider_torchelastic.operators import results, retries
from airflow_provider_torchelastic.operators.dry_run import identity_of, render_objects, task_context_of
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError, InfrastructureError
from airflow_provider_torchelastic.operators.links import XCOM_JOB_KIND, XCOM_JOB_NAME, XCOM_JOB_NAMESPACE
from airflow_provider_torchelastic.operators.masking import mask_manifests, sensitive_values

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_torchelastic.core.tap import MetricsTap
    from airflow_provider_torchelastic.hooks import Cluster
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.kubernetes.worker_wait import BackgroundDeletes
    from airflow_provider_torchelastic.operators.operator import TorchElasticOperator
    from airflow_provider_torchelastic.settings import Settings

__all__ = ["STATE_KEY", "XCOM_MANIFESTS", "execute_on_kubernetes", "resume", "stop"]

#: task_state_store key of the job this try created; survives a worker crash so the same try re-attaches.
STATE_KEY: Final = "torchelastic_job"
#: XCom key of the submitted manifests (payload elided), pushed before deferring for the resumed operator.
XCOM_MANIFESTS: Final = "manifests"


def _check_one_cluster_source(conn_id: str, hook: Any) -> None:
    """Refuse a connection that names two ways to reach a cluster, before anything is created.

    The hook refuses the pair itself, but only when it first connects and with an AirflowException, which Airflow
    retries although every try fails the same way.
    """
    _refuse_two_sources(connection_of(conn_id, hook))


def _refuse_two_sources(connection: ClusterConnection) -> None:
    try:
        connection.check_one_source()
    except ValueError as e:  # the same connection fails every try the same way: no retries
        raise ConfigurationError(str(e)) from e


#: What each connection's cluster serves, by kind: ``(time read, served)``; asked again after this many seconds.
_SERVED_TTL: Final = 300.0
_served_cache: dict[tuple[str, str], tuple[float, bool]] = {}


def _served(kube: SyncKube, conn_id: str, kind: kinds.JobKind) -> bool:
    """Whether the cluster serves ``kind`` (API discovery of its group version), cached per connection: ``auto``
    asks it for each multi-node task, and an answer outlives a try by minutes. A discovery that fails counts as not
    served: the submit of the kind chosen instead says what is missing."""
    key, now = (conn_id, kind.kind), time.monotonic()
    cached = _served_cache.get(key)
    if cached is not None and now - cached[0] < _SERVED_TTL:
        return cached[1]
    try:
        served = kind.plural in (kube.served_resources(kind.group, kind.version) or [])
    except KubeError:
        return False  # not cached: the next task asks again
    _served_cache[key] = (now, served)
    return served


def _submit_error(ref: JobRef, error: KubeError) -> Exception:
    """The task's exception for a failed submission (:func:`..kubernetes.submit.refusal` says which)."""
    refused = submit.refusal(ref, error)
    return InfrastructureError(refused.message) if refused.recoverable else ConfigurationError(refused.message)


def _deadline(op: TorchElasticOperator, context: Context) -> float | None:
    """``execution_timeout`` as a Unix time, anchored on the try's start (stable across re-deferrals)."""
    if op.execution_timeout is None:
        return None
    start = getattr(context["ti"], "start_date", None)
    started = start.timestamp() if start is not None else time.time()
    return started + op.execution_timeout.total_seconds()


def _submit(
    op: TorchElasticOperator,
    kube: SyncKube,
    ref: JobRef,
    secret: dict[str, Any],
    workload: dict[str, Any],
    context: Context,
    *,
    lease: float,
) -> JobRef:
    """Create the payload Secret and the job, or re-attach to the job this try already created; returns the job.

    The try's token lives in the task state store, next to the job it names: a worker that crashed and runs the
    same try again finds both, and re-attaches only to what carries that token (or the uid it recorded).
    """
    store = context.get("task_state_store")
    try_number = context["ti"].try_number
    saved = store.get(STATE_KEY) if store is not None else None
    remembered = submit.remembered_try(saved, try_number)
    token = remembered.token if remembered is not None else submit.new_token()
    earlier = submit.earlier_try(saved, try_number)
    if earlier is not None:
        try:
            submit.stop_earlier_try(kube, earlier, info=op.log.info, warning=op.log.warning)
        except KubeError as e:  # this try's own job matters more: say so, and go on
            op.log.warning("Could not stop the job of try %d: %s", earlier.try_number, e)

    # The backstop for jobs that outlived their try (sweep's docstring says why this one): this try's job carries
    # its deadline, or without one a lease its waiter renews, and each submission deletes the namespace's jobs that
    # still run well past theirs.
    deadline = _deadline(op, context)
    workload = sweep.with_deadline(workload, deadline if deadline is not None else time.time() + lease)
    try:
        sweep.sweep_namespace(kube, ref.namespace, info=op.log.info, warning=op.log.warning)
    except KubeError as e:  # a Role without list, say: this try's own job matters more
        op.log.warning("Could not sweep %s for jobs past their task's deadline: %s", ref.namespace, e)

    remember = None
    if store is not None:

        def remember(job: JobRef, uid: str | None) -> None:
            store.set(STATE_KEY, submit.state_record(job, try_number, token=token, uid=uid))

    try:
        answer = submit.create_or_reattach(
            kube,
            ref,
            secret,
            workload,
            token=token,
            remembered=remembered.ref if remembered is not None else None,
            remembered_uid=remembered.uid if remembered is not None else None,
            remember=remember,
            info=op.log.info,
            warning=op.log.warning,
        )
    except KubeError as e:
        error = _submit_error(ref, e)
        # The payload Secret may exist already: leave nothing behind (a retry creates everything anew).
        op._stop(ref, kube)
        raise error from e
    if isinstance(answer, submit.Refusal):
        # Someone else's object holds this try's name: left as it is (it is not this try's to delete).
        raise ConfigurationError(answer.message)
    return answer


def execute_on_kubernetes(op: TorchElasticOperator, context: Context, payload: bytes, settings: Settings) -> Any:
    """Submit the try's job (or re-attach to it), then defer or wait for it; returns rank 0's result."""
    from airflow_provider_torchelastic.core.tap import MetricsTap
    from airflow_provider_torchelastic.kubernetes.worker_wait import BackgroundDeletes

    cluster = connect(op.kubernetes_conn_id, namespace=op.namespace)
    _refuse_two_sources(cluster.connection)
    kube = cluster.sync_kube()
    manifests = _render_try(op, context, cluster, kube, payload, settings)
    secret, workload = manifests
    ref = JobRef(kind=workload["kind"], name=workload["metadata"]["name"], namespace=cluster.namespace)
    # What the log, the XCom and the rendered-template view show: no payload bytes, no secret.
    secrets = sensitive_values(manifests)
    elided = _show_manifests(op, manifests, secrets)
    ref = _submit(op, kube, ref, secret, workload, context, lease=settings.job_lease)
    op._job = ref
    submit.warn_if_it_may_queue_forever(
        workload, bounded=bool(op.scheduling_timeout or op.execution_timeout), warning=op.log.warning
    )
    _push_job(context, ref, elided)
    # Rank 0's metrics lines (in its pod's log) become progress lines; the tap keeps them for the job summary.
    tap = MetricsTap(op.log.info)
    log = redacting(tap, secrets)  # the pods' log lines and messages, before the tap keeps them for the summary
    policy = _policy(op, context, settings)
    deletes = BackgroundDeletes(kube, log)
    decision = _wait_or_look(op, context, cluster.connection, ref, policy, kube, log, settings, deletes)
    if decision is None:
        _defer(op, cluster.connection, ref, policy, context, settings, secrets)
    op._job = None
    if settings.deferrable:
        op.log.info("%s %s/%s had ended before the task deferred: finished here", ref.kind, ref.namespace, ref.name)
    try:
        return _result_of(op, ref, decision, context, tap, settings, secrets)
    finally:
        # The succeeded job's deletion ran while the result was read; the process ends right after the task (see
        # BackgroundDeletes), so it is given a bounded moment more here, and otherwise left to the sweep.
        if not deletes.join(_DETACHED_DELETE_SECONDS):
            op.log.warning(
                "Still deleting %s %s/%s: if it is cut short, the sweep deletes it", ref.kind, ref.namespace, ref.name
            )


def _render_try(
    op: TorchElasticOperator,
    context: Context,
    cluster: Cluster,
    kube: SyncKube,
    payload: bytes,
    settings: Settings,
) -> list[dict[str, Any]]:
    """The try's objects, ``[payload Secret, job]``, of the kind the cluster runs it as (with more memory after an
    OOM when ``retry_resources`` asks for it)."""
    try:
        identity = identity_of(op, context)
        task_context = task_context_of(identity, context, op.checkpoint_uri, settings)
        kind, why = kinds.choose(
            op.task_config, settings.job_kind, functools.partial(_served, kube, op.kubernetes_conn_id)
        )
        op.log.info("Job kind: %s (%s)", kind.kind, why)
        manifests = render_objects(
            op, identity, cluster.namespace, payload, settings, task_context=task_context, kind=kind
        )
        if op.retry_resources is not None:
            manifests = _with_retry_resources(op, context, manifests, cluster.hook, cluster.namespace)
    except (ValueError, TypeError) as e:
        # A setting only known at run time (templated image, the connection's namespace, the payload's size)
        # is wrong: the same try would fail the same way, so do not spend retries on it.
        raise ConfigurationError(f"Cannot build the Kubernetes objects for this task: {e}") from e
    return manifests


def _show_manifests(
    op: TorchElasticOperator, manifests: list[dict[str, Any]], secrets: Sequence[str]
) -> list[dict[str, Any]]:
    """The manifests as the log, the XCom and the rendered-template view show them: payload elided, secrets
    masked."""
    elided = mask_manifests([elide_payload(manifest) for manifest in manifests], secrets)
    op.rendered_job = summarize_for_ui(elided)
    op.log.info("Manifests to submit (payload elided, secrets masked):\n%s", json.dumps(elided, indent=2))
    return elided


def _push_job(context: Context, ref: JobRef, elided: list[dict[str, Any]]) -> None:
    """The XComs that name the job (for the extra links, the UI and the resumed operator) and its manifests."""
    ti = context["ti"]
    ti.xcom_push(key=XCOM_JOB_NAME, value=ref.name)
    ti.xcom_push(key=XCOM_JOB_NAMESPACE, value=ref.namespace)
    ti.xcom_push(key=XCOM_JOB_KIND, value=ref.kind)
    ti.xcom_push(key=XCOM_MANIFESTS, value=elided)


def _wait_or_look(
    op: TorchElasticOperator,
    context: Context,
    connection: ClusterConnection,
    ref: JobRef,
    policy: WaitPolicy,
    kube: SyncKube,
    log: Callable[[str], None],
    settings: Settings,
    deletes: BackgroundDeletes,
) -> WaitDecision | None:
    """Wait here for the job's end (``deferrable=False``), or take one look before deferring (None: it has not
    ended)."""
    # The wait core enforces execution_timeout, deletes the job when it cannot be observed, and applies
    # on_finish_action; anything else that ends the wait (SIGTERM, a bug) must not leave the job running.
    try:
        if settings.deferrable:
            return _look_before_deferring(ref, policy, kube, log, _limits(op, context))
        return _wait_here(op, connection, ref, policy, kube, log, _limits(op, context), deletes)
    except BaseException:
        op.log.warning("Waiting for %s %s/%s was interrupted", ref.kind, ref.namespace, ref.name)
        op._stop(ref, kube)
        op._job = None
        raise


#: How long the end of a task waits for a deletion nobody else waits for (a succeeded job's) that is still running.
_DETACHED_DELETE_SECONDS: Final = 10.0


def _wait_here(
    op: TorchElasticOperator,
    connection: ClusterConnection,
    ref: JobRef,
    policy: WaitPolicy,
    kube: SyncKube,
    log: Callable[[str], None],
    limits: QueueLimits,
    deletes: BackgroundDeletes,
) -> WaitDecision:
    """``deferrable=False``: the wait core, woken by a watch of the job in a private event loop (the triggerer's
    list+watch, :mod:`..kubernetes.worker_wait`); where that cannot start, polled as before with the same core."""
    from airflow_provider_torchelastic.kubernetes.wait import drive_sync, wait_for_job
    from airflow_provider_torchelastic.kubernetes.worker_wait import WatchNotStarted, wait_watching

    # The extras as resolved for the submit: the async hook would otherwise read the connection from inside the
    # loop. No connection: no extras, so that the hook falls back to in-cluster / the default kubeconfig.
    resolved = dataclasses.replace(connection, extras=connection.extras if connection.extras is not None else {})
    flow = wait_for_job(ref, policy, limits)
    try:
        decision: WaitDecision = wait_watching(flow, ref, async_hook(resolved).get_conn, kube, log, detach=deletes)
    except WatchNotStarted as e:
        op.log.info(
            "Polling %s %s/%s every %g s (no watch: %s)", ref.kind, ref.namespace, ref.name, policy.poll_interval, e
        )
        decision = drive_sync(flow, kube, log, detach=deletes)
    return decision


def _look_before_deferring(
    ref: JobRef, policy: WaitPolicy, kube: SyncKube, log: Callable[[str], None], limits: QueueLimits
) -> WaitDecision | None:
    """One pass of the wait core before deferring: the decision when the job has already ended, else None.

    A job that ended before the deferral was recorded (a fast one, or one a re-run of the same try re-attached to)
    is finished here, in the worker: a trigger firing at once is what can lose the try (see
    :func:`..triggers.event_hold`). The pass is the wait's own first step (its progress line, its logs, its
    clean-up), so a job that ended is decided exactly as the trigger would have decided it.
    """
    from airflow_provider_torchelastic.kubernetes.wait import drive_sync, until_first_pause, wait_for_job

    decision: WaitDecision | None = drive_sync(until_first_pause(wait_for_job(ref, policy, limits)), kube, log)
    return decision


def _limits(op: TorchElasticOperator, context: Context) -> QueueLimits:
    """The Kueue limits of this try: ``max_preemptions`` over the task instance's tries (the state store's count)."""
    if op.max_preemptions is None:
        return QueueLimits()
    return QueueLimits(max_preemptions=op.max_preemptions, preemptions_before=retries.preemptions_before(context))


def _limit_ranges(kubernetes_hook: Any, namespace: str, op: TorchElasticOperator) -> list[dict[str, Any]] | None:
    """The namespace's LimitRanges (their maxima cap ``retry_resources``); None when they cannot be read."""
    try:
        response = kubernetes_hook.core_v1_client.list_namespaced_limit_range(namespace, _preload_content=False)
        return list(json.loads(response.data).get("items") or [])
    except Exception as e:  # no right to list them: [torch_elastic] retry_memory_max caps instead
        op.log.warning("Could not read the LimitRanges of %s (retry_memory_max caps retry_resources): %s", namespace, e)
        return None


def _with_retry_resources(
    op: TorchElasticOperator, context: Context, manifests: list[dict[str, Any]], kubernetes_hook: Any, namespace: str
) -> list[dict[str, Any]]:
    """``manifests`` with the training containers' resources ``retry_resources`` gives this try (after an OOM)."""
    from airflow_provider_torchelastic.kubernetes.training_resources import (
        training_resources,
        with_training_resources,
    )
    from airflow_provider_torchelastic.settings import read_retry_memory_max

    escalation = retries.resources_for_try(
        op.retry_resources,
        training_resources(manifests[-1]),
        context,
        read_limit_ranges=lambda: _limit_ranges(kubernetes_hook, namespace, op),
        default_cap=read_retry_memory_max,
    )
    if escalation is None:
        return manifests
    op.log.info("%s", escalation.line)
    return [*manifests[:-1], with_training_resources(manifests[-1], escalation.resources)]


def _policy(op: TorchElasticOperator, context: Context, settings: Settings) -> WaitPolicy:
    deadline = _deadline(op, context)
    return WaitPolicy(
        poll_interval=op.poll_interval,
        pending_grace_seconds=op.pending_grace_seconds,
        image_pull_timeout=op.image_pull_timeout,
        deadline=deadline,
        finish_action=op.on_finish_action,
        scheduling_timeout=op.scheduling_timeout,
        lease_seconds=settings.job_lease if deadline is None else None,
    )


def _defer(
    op: TorchElasticOperator,
    connection: ClusterConnection,
    ref: JobRef,
    policy: WaitPolicy,
    context: Context,
    settings: Settings,
    secrets: Sequence[str],
) -> NoReturn:
    from airflow_provider_torchelastic.triggers import TorchElasticJobTrigger, WatchArgs

    # The connection travels as resolved here (the triggerer needs none); without one, the triggerer resolves
    # in-cluster or the default kubeconfig itself.
    args = WatchArgs.for_wait(
        ref,
        connection,
        policy,
        _limits(op, context),
        deferred_at=time.time(),
        early_event_hold=settings.early_event_hold,
        mask=tuple(secrets),
    )
    # The trigger enforces the deadline (and deletes the job); Airflow's own timeout is only a backstop after it.
    backstop = None
    if args.deadline is not None:
        backstop = datetime.timedelta(seconds=max(0.0, args.deadline - time.time()) + max(60.0, 2 * op.poll_interval))
    op.log.info("Deferring: the triggerer waits for %s %s/%s", ref.kind, ref.namespace, ref.name)
    trigger = TorchElasticJobTrigger.for_job(args)
    op.defer(trigger=trigger, method_name="execute_complete", timeout=backstop)


def resume(op: TorchElasticOperator, context: Context, event: dict[str, Any], settings: Settings) -> Any:
    """The body of ``TorchElasticOperator.execute_complete`` (its docstring says what it promises)."""
    from airflow_provider_torchelastic.triggers import WaitFailed, event_from_payload

    ti = context["ti"]
    ref = JobRef(
        kind=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_KIND, map_indexes=ti.map_index),
        name=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAME, map_indexes=ti.map_index),
        namespace=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAMESPACE, map_indexes=ti.map_index),
    )
    manifests = ti.xcom_pull(task_ids=ti.task_id, key=XCOM_MANIFESTS, map_indexes=ti.map_index)
    if manifests:
        op.rendered_job = summarize_for_ui(manifests)
    outcome = event_from_payload(event)
    if isinstance(outcome, WaitFailed):
        # The trigger could not even start waiting: do not leave the job holding the cluster.
        op._stop(ref)
        raise InfrastructureError(f"Waiting for {ref.kind} {ref.namespace}/{ref.name} failed: {outcome.message}")
    from airflow_provider_torchelastic.core.tap import MetricsTap

    decision = outcome.decision
    # The trigger's tap (when it drove the wait with one) sent what it kept along with the decision.
    tap = MetricsTap.from_json(decision.metrics, op.log.info)
    return _result_of(op, ref, decision, context, tap, settings)


def _result_of(
    op: TorchElasticOperator,
    ref: JobRef,
    decision: WaitDecision,
    context: Context,
    tap: MetricsTap,
    settings: Settings,
    secrets: Sequence[str] = (),
) -> Any:
    verdict = decision.verdict or Verdict(succeeded=False, detail=decision.progress)
    op.log.info("%s %s/%s ended: %s", ref.kind, ref.namespace, ref.name, decision.progress)
    summary = results.job_summary(ref, decision, verdict, context, tap)
    # Recomputed from the try itself, never taken from the job: the one location its result may be read from, and
    # the one its artifacts may lie under.
    wanted = verdict.result_ref is not None or settings.artifact_storage is not None
    task_context = task_context_for(identity_of(op, context)) if wanted else None
    if op.retry_resources is not None or op.max_preemptions is not None:
        # For the next try: how this one ended (an OOM raises the memory) and the preemptions it saw.
        cause = "" if verdict.succeeded else verdict.cause
        retries.record_try(context, cause=cause, preemptions=verdict.preemptions, log=op.log.warning)
    return results.finish(
        op.log,
        context,
        summary,
        lambda: op.result_or_raise(
            verdict, last_metrics=tap.summary_line(), settings=settings, task_context=task_context
        ),
        secrets=secrets,
        extra=retries.summary_of(context) if op.retry_resources is not None else None,
    )


def stop(op: TorchElasticOperator, ref: JobRef, kube: SyncKube | None = None) -> None:
    """Delete the job unless it has finished: the one way the worker ends a job it no longer waits for."""
    from airflow_provider_torchelastic.kubernetes.wait import drive_sync, stop_job

    drive_sync(stop_job(ref), kube or connect(op.kubernetes_conn_id).sync_kube(), op.log.info)
