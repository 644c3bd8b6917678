"""The Kubernetes backend: render the try's objects, submit them (:mod:`...kubernetes.submit`), then wait here or
defer to the trigger, and turn the wait's decision into the task's result.

The Airflow side of :mod:`...kubernetes`: the hook, XCom, the task state store, deferral and the task's exceptions.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, NoReturn

from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.core.redaction import redacting
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.hooks import async_hook
from airflow_provider_torchelastic.kubernetes import kinds, submit, sweep
from airflow_provider_torchelastic.kubernetes import render as kubernetes_render
from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection
from airflow_provider_torchelastic.kubernetes.queue_limits import QueueLimits
from airflow_provider_torchelastic.kubernetes.render import elide_payload, summarize_for_ui, task_context_for
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, WaitDecision, WaitPolicy
from airflow_provider_torchelastic.operators import results, retries
from airflow_provider_torchelastic.operators.backends.attempt import identity_of
from airflow_provider_torchelastic.operators.backends.base import Attempt, Plan, TaskSpec
from airflow_provider_torchelastic.operators.backends.cluster import cluster_client, task_cluster
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError, InfrastructureError
from airflow_provider_torchelastic.operators.links import XCOM_JOB_KIND, XCOM_JOB_NAME, XCOM_JOB_NAMESPACE
from airflow_provider_torchelastic.operators.masking import mask_manifests, sensitive_values
from airflow_provider_torchelastic.operators.results import result_url

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_torchelastic.core.tap import MetricsTap
    from airflow_provider_torchelastic.hooks import Cluster
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.kubernetes.worker_wait import BackgroundDeletes
    from airflow_provider_torchelastic.settings import Settings

__all__ = ["STATE_KEY", "XCOM_MANIFESTS", "KubernetesBackend"]

#: task_state_store key of the job this try created; survives a worker crash so the same try re-attaches.
STATE_KEY: Final = "torchelastic_job"
#: XCom key of the submitted manifests (payload elided), pushed before deferring for the resumed operator.
XCOM_MANIFESTS: Final = "manifests"


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


def _deadline(task: TaskSpec, context: Context) -> float | None:
    """``execution_timeout`` as a Unix time, anchored on the try's start (stable across re-deferrals)."""
    if task.execution_timeout is None:
        return None
    start = getattr(context["ti"], "start_date", None)
    started = start.timestamp() if start is not None else time.time()
    return started + task.execution_timeout.total_seconds()


def _submit(
    task: TaskSpec,
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
            submit.stop_earlier_try(kube, earlier, info=task.log.info, warning=task.log.warning)
        except KubeError as e:  # this try's own job matters more: say so, and go on
            task.log.warning("Could not stop the job of try %d: %s", earlier.try_number, e)

    # The backstop for jobs that outlived their try (sweep's docstring says why this one): this try's job carries
    # its deadline, or without one a lease its waiter renews, and each submission deletes the namespace's jobs that
    # still run well past theirs.
    deadline = _deadline(task, context)
    workload = sweep.with_deadline(workload, deadline if deadline is not None else time.time() + lease)
    try:
        sweep.sweep_namespace(kube, ref.namespace, info=task.log.info, warning=task.log.warning)
    except KubeError as e:  # a Role without list, say: this try's own job matters more
        task.log.warning("Could not sweep %s for jobs past their task's deadline: %s", ref.namespace, e)

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
            info=task.log.info,
            warning=task.log.warning,
        )
    except KubeError as e:
        error = _submit_error(ref, e)
        # The payload Secret may exist already: leave nothing behind (a retry creates everything anew).
        stop(task, ref, kube)
        raise error from e
    if isinstance(answer, submit.Refusal):
        # Nothing of this try was created: a pod template the API server refuses, or someone else's object holding
        # this try's name (left as it is: not this try's to delete).
        raise ConfigurationError(answer.message)
    return answer


def render_objects(
    task: TaskSpec, attempt: Attempt, namespace: str, kind: kinds.JobKind | None = None
) -> list[dict[str, Any]]:
    """The manifests of one try. Where neither the replicas, the task nor the pod template names an image,
    ``[torch_elastic] image`` does.

    ``kind``: the one the submit chose (:func:`kinds.choose`); without it, the one ``job_kind`` fixes, else (``auto``
    with several nodes, which only the cluster decides) a PyTorchJob.
    """
    settings, task_context = attempt.settings, attempt.task_context
    if kind is None:
        kind = kinds.choose(task.task_config, settings.job_kind)[0]
    return kubernetes_render.render_manifests(
        task.task_config,
        identity=attempt.identity,
        namespace=namespace,
        image=task.image,
        payload=attempt.payload,
        pod_options=task.pod_options,
        job_options=task.job_options,
        default_image=settings.image,
        renderer=kind.render,
        task_context=task_context,
        result_url=result_url(settings.result_storage, task_context),
        report_interval=settings.report_interval,
        stall_timeout=task.stall_timeout,
        grace_period=task.termination_grace_period,
    )


class KubernetesBackend:
    """A try as a Pod (one node), a PyTorchJob or a TrainJob, waited on here or by the triggerer (deferrable)."""

    execution: ClassVar[str] = "kubernetes"
    can_defer: ClassVar[bool] = True

    def __init__(self, task: TaskSpec) -> None:
        self.task = task
        # A run's cluster, connected once by prepare() and used by submit() and wait(); a dry run has none.
        self._cluster: Cluster | None = None
        self._kube: SyncKube | None = None
        #: The rendered-template view of the manifests a resumed try submitted (from XCom).
        self.rendered: str | None = None
        #: The values prepare() found sensitive: masked in every line the pods' logs and messages make.
        self._secrets: tuple[str, ...] = ()

    def prepare(self, attempt: Attempt) -> Plan:
        """The try's objects, ``[payload Secret, job]``; a run's of the kind the cluster runs it as, a dry run's
        (no network) of the kind ``job_kind`` fixes, else a PyTorchJob."""
        if attempt.dry_run:
            namespace = self.task.namespace if self.task.namespace is not None else "default"
            manifests = render_objects(self.task, attempt, namespace)
        else:
            cluster = self._cluster = task_cluster(self.task.kubernetes_conn_id, self.task.namespace)
            self._kube = cluster_client(cluster)
            manifests = _render_try(self.task, attempt, cluster, self._kube)
        # What the log, the XCom and the rendered-template view show: no payload bytes, no secret.
        secrets = self._secrets = sensitive_values(manifests)
        shown = mask_manifests([elide_payload(manifest) for manifest in manifests], secrets)
        return Plan(self.execution, manifests, shown, rendered=summarize_for_ui(shown))

    def submit(self, attempt: Attempt, plan: Plan) -> JobRef:
        """Create the payload Secret and the job, or re-attach to the job this try already created."""
        assert self._kube is not None and self._cluster is not None and attempt.context is not None, "prepare() first"
        secret, workload = plan.objects
        self.task.log.info("Manifests to submit (payload elided, secrets masked):\n%s", plan)
        ref = JobRef(kind=workload["kind"], name=workload["metadata"]["name"], namespace=self._cluster.namespace)
        ref = _submit(self.task, self._kube, ref, secret, workload, attempt.context, lease=attempt.settings.job_lease)
        submit.warn_if_it_may_queue_forever(
            workload,
            bounded=bool(self.task.scheduling_timeout or self.task.execution_timeout),
            warning=self.task.log.warning,
        )
        _push_job(attempt.context, ref, plan.shown)
        return ref

    def wait(self, attempt: Attempt, handle: object) -> Any:
        """Wait here for the job, or defer to the trigger (``TaskDeferred``); rank 0's result once it ended."""
        from airflow_provider_torchelastic.core.tap import MetricsTap
        from airflow_provider_torchelastic.kubernetes.worker_wait import BackgroundDeletes

        assert isinstance(handle, JobRef) and self._kube is not None and self._cluster is not None
        assert attempt.context is not None
        task, ref, kube, context, settings = self.task, handle, self._kube, attempt.context, attempt.settings
        secrets = self._secrets
        # Rank 0's metrics lines (in its pod's log) become progress lines; the tap keeps them for the job summary.
        tap = MetricsTap(task.log.info)
        log = redacting(tap, secrets)  # the pods' log lines and messages, before the tap keeps them for the summary
        policy = _policy(task, context, settings)
        deletes = BackgroundDeletes(kube, log)
        decision = _wait_or_look(task, context, self._cluster.connection, ref, policy, kube, log, settings, deletes)
        if decision is None:
            _defer(task, self._cluster.connection, ref, policy, context, settings, secrets)
        if settings.deferrable:
            task.log.info("%s %s/%s had ended before the task deferred: finished here", *_named(ref))
        try:
            return _result_of(task, ref, decision, context, tap, settings, secrets)
        finally:
            # The succeeded job's deletion ran while the result was read; the process ends right after the task (see
            # BackgroundDeletes), so it is given a bounded moment more here, and otherwise left to the sweep.
            if not deletes.join(_DETACHED_DELETE_SECONDS):
                task.log.warning("Still deleting %s %s/%s: if it is cut short, the sweep deletes it", *_named(ref))

    def resume(self, context: Context, event: Mapping[str, Any], settings: Settings) -> Any:
        """After the trigger fired, on a fresh operator: everything comes from the event and XCom."""
        self.rendered = _submitted_view(context)
        return _resume(self.task, context, event, settings)

    def stop(self, handle: object) -> None:
        """The task is killed: delete the job unless it has finished."""
        assert isinstance(handle, JobRef)
        self.task.log.info("Task killed: stopping %s %s/%s", *_named(handle))
        stop(self.task, handle, self._kube)


def _named(ref: JobRef) -> tuple[str, str, str]:
    return ref.kind, ref.namespace, ref.name


def _render_try(task: TaskSpec, attempt: Attempt, cluster: Cluster, kube: SyncKube) -> list[dict[str, Any]]:
    """The try's objects, ``[payload Secret, job]``, of the kind the cluster runs it as (with more memory after an
    OOM when ``retry_resources`` asks for it)."""
    assert attempt.context is not None
    try:
        kind, why = kinds.choose(
            task.task_config, attempt.settings.job_kind, functools.partial(_served, kube, task.kubernetes_conn_id)
        )
        task.log.info("Job kind: %s (%s)", kind.kind, why)
        manifests = render_objects(task, attempt, cluster.namespace, kind)
        if task.retry_resources is not None:
            manifests = _with_retry_resources(task, attempt.context, manifests, cluster.hook, cluster.namespace)
    except (ValueError, TypeError) as e:
        # A setting only known at run time (templated image, the connection's namespace, the payload's size)
        # is wrong: the same try would fail the same way, so do not spend retries on it.
        raise ConfigurationError(f"Cannot build the Kubernetes objects for this task: {e}") from e
    return manifests


def _push_job(context: Context, ref: JobRef, elided: list[dict[str, Any]]) -> None:
    """The XComs that name the job (for the extra links, the UI and the resumed operator) and its manifests."""
    ti = context["ti"]
    ti.xcom_push(key=XCOM_JOB_NAME, value=ref.name)
    ti.xcom_push(key=XCOM_JOB_NAMESPACE, value=ref.namespace)
    ti.xcom_push(key=XCOM_JOB_KIND, value=ref.kind)
    ti.xcom_push(key=XCOM_MANIFESTS, value=elided)


def _wait_or_look(
    task: TaskSpec,
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
            return _look_before_deferring(ref, policy, kube, log, _limits(task, context))
        return _wait_here(task, connection, ref, policy, kube, log, _limits(task, context), deletes)
    except BaseException:
        task.log.warning("Waiting for %s %s/%s was interrupted", ref.kind, ref.namespace, ref.name)
        stop(task, ref, kube)
        raise


#: How long the end of a task waits for a deletion nobody else waits for (a succeeded job's) that is still running.
_DETACHED_DELETE_SECONDS: Final = 10.0


def _wait_here(
    task: TaskSpec,
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
        task.log.info(
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


def _limits(task: TaskSpec, context: Context) -> QueueLimits:
    """The Kueue limits of this try: ``max_preemptions`` over the task instance's tries (the state store's count)."""
    if task.max_preemptions is None:
        return QueueLimits()
    return QueueLimits(max_preemptions=task.max_preemptions, preemptions_before=retries.preemptions_before(context))


def _limit_ranges(kubernetes_hook: Any, namespace: str, task: TaskSpec) -> list[dict[str, Any]] | None:
    """The namespace's LimitRanges (their maxima cap ``retry_resources``); None when they cannot be read."""
    try:
        response = kubernetes_hook.core_v1_client.list_namespaced_limit_range(namespace, _preload_content=False)
        return list(json.loads(response.data).get("items") or [])
    except Exception as e:  # no right to list them: [torch_elastic] retry_memory_max caps instead
        task.log.warning(
            "Could not read the LimitRanges of %s (retry_memory_max caps retry_resources): %s", namespace, e
        )
        return None


def _with_retry_resources(
    task: TaskSpec, context: Context, manifests: list[dict[str, Any]], kubernetes_hook: Any, namespace: str
) -> list[dict[str, Any]]:
    """``manifests`` with the training containers' resources ``retry_resources`` gives this try (after an OOM)."""
    from airflow_provider_torchelastic.kubernetes.training_resources import (
        training_resources,
        with_training_resources,
    )
    from airflow_provider_torchelastic.settings import read_retry_memory_max

    escalation = retries.resources_for_try(
        task.retry_resources,
        training_resources(manifests[-1]),
        context,
        read_limit_ranges=lambda: _limit_ranges(kubernetes_hook, namespace, task),
        default_cap=read_retry_memory_max,
    )
    if escalation is None:
        return manifests
    task.log.info("%s", escalation.line)
    return [*manifests[:-1], with_training_resources(manifests[-1], escalation.resources)]


def _policy(task: TaskSpec, context: Context, settings: Settings) -> WaitPolicy:
    deadline = _deadline(task, context)
    return WaitPolicy(
        poll_interval=task.poll_interval,
        pending_grace_seconds=task.pending_grace_seconds,
        image_pull_timeout=task.image_pull_timeout,
        deadline=deadline,
        finish_action=task.on_finish_action,
        scheduling_timeout=task.scheduling_timeout,
        lease_seconds=settings.job_lease if deadline is None else None,
    )


def _defer(
    task: TaskSpec,
    connection: ClusterConnection,
    ref: JobRef,
    policy: WaitPolicy,
    context: Context,
    settings: Settings,
    secrets: Sequence[str],
) -> NoReturn:
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_provider_torchelastic.triggers import TorchElasticJobTrigger, WatchArgs

    # The connection travels as resolved here (the triggerer needs none); without one, the triggerer resolves
    # in-cluster or the default kubeconfig itself.
    args = WatchArgs.for_wait(
        ref,
        connection,
        policy,
        _limits(task, context),
        deferred_at=time.time(),
        early_event_hold=settings.early_event_hold,
        mask=tuple(secrets),
    )
    # The trigger enforces the deadline (and deletes the job); Airflow's own timeout is only a backstop after it.
    backstop = None
    if args.deadline is not None:
        backstop = datetime.timedelta(seconds=max(0.0, args.deadline - time.time()) + max(60.0, 2 * task.poll_interval))
    task.log.info("Deferring: the triggerer waits for %s %s/%s", ref.kind, ref.namespace, ref.name)
    raise TaskDeferred(trigger=TorchElasticJobTrigger.for_job(args), method_name="execute_complete", timeout=backstop)


def _submitted_view(context: Context) -> str | None:
    """The rendered-template view of the manifests the deferred try submitted (kept in XCom for the resume)."""
    ti = context["ti"]
    manifests = ti.xcom_pull(task_ids=ti.task_id, key=XCOM_MANIFESTS, map_indexes=ti.map_index)
    return summarize_for_ui(manifests) if manifests else None


def _resume(task: TaskSpec, context: Context, event: Mapping[str, Any], settings: Settings) -> Any:
    """The body of ``TorchElasticOperator.execute_complete`` (its docstring says what it promises)."""
    from airflow_provider_torchelastic.triggers import WaitFailed, event_from_payload

    ti = context["ti"]
    ref = JobRef(
        kind=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_KIND, map_indexes=ti.map_index),
        name=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAME, map_indexes=ti.map_index),
        namespace=ti.xcom_pull(task_ids=ti.task_id, key=XCOM_JOB_NAMESPACE, map_indexes=ti.map_index),
    )
    outcome = event_from_payload(dict(event))
    if isinstance(outcome, WaitFailed):
        # The trigger could not even start waiting: do not leave the job holding the cluster. A stop that fails too
        # is logged, not raised: the trigger's error is the task's (and a retry reattaches to a job left running).
        try:
            stop(task, ref)
        except Exception as e:
            task.log.warning("Could not stop %s %s/%s: %s: %s", *_named(ref), type(e).__name__, e)
        raise InfrastructureError(f"Waiting for {ref.kind} {ref.namespace}/{ref.name} failed: {outcome.message}")
    from airflow_provider_torchelastic.core.tap import MetricsTap

    decision = outcome.decision
    # The trigger's tap (when it drove the wait with one) sent what it kept along with the decision.
    tap = MetricsTap.from_json(decision.metrics, task.log.info)
    return _result_of(task, ref, decision, context, tap, settings)


def _result_of(
    task: TaskSpec,
    ref: JobRef,
    decision: WaitDecision,
    context: Context,
    tap: MetricsTap,
    settings: Settings,
    secrets: Sequence[str] = (),
) -> Any:
    verdict = decision.verdict or Verdict(succeeded=False, detail=decision.progress)
    task.log.info("%s %s/%s ended: %s", ref.kind, ref.namespace, ref.name, decision.progress)
    summary = results.job_summary(ref, decision, verdict, context, tap)
    # Recomputed from the try itself, never taken from the job: the one location its result may be read from, and
    # the one its artifacts may lie under.
    wanted = verdict.result_ref is not None or settings.artifact_storage is not None
    task_context = task_context_for(identity_of(context)) if wanted else None
    if task.retry_resources is not None or task.max_preemptions is not None:
        # For the next try: how this one ended (an OOM raises the memory) and the preemptions it saw.
        cause = "" if verdict.succeeded else verdict.cause
        retries.record_try(context, cause=cause, preemptions=verdict.preemptions, log=task.log.warning)
    return results.finish(
        task.log,
        context,
        summary,
        lambda: results.settle(task.log, verdict, settings, last_metrics=tap.summary_line(), task_context=task_context),
        secrets=secrets,
        extra=retries.summary_of(context) if task.retry_resources is not None else None,
    )


def stop(task: TaskSpec, ref: JobRef, kube: SyncKube | None = None) -> None:
    """Delete the job unless it has finished: the one way the worker ends a job it no longer waits for. Without the
    try's client (on_kill after a resume, a trigger that could not wait), the task's cluster is connected as a submit
    connects it, so a missing connection is the same typed error."""
    from airflow_provider_torchelastic.kubernetes.wait import drive_sync, stop_job

    drive_sync(stop_job(ref), kube or cluster_client(task_cluster(task.kubernetes_conn_id, None)), task.log.info)
