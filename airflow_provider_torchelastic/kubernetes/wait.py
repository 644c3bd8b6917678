"""The one wait core: from a created job to its decision, with the deadline, wait failures and clean-up.

The worker (``deferrable=False``) and the trigger (``deferrable=True``) drive the same generators, which ask for I/O
and decide from the answers:

* :func:`wait_for_job` polls until the job ended, logs progress and the pods' logs, enforces the deadline
  (``execution_timeout``), turns a failure to observe the job into a recoverable failure, and deletes the job as
  ``on_finish_action``, the deadline or the failure say. It returns the :class:`~.wait_types.WaitDecision`.
* :func:`stop_job` is what a kill does: delete the job unless it has already finished (a finished job that
  ``on_finish_action="keep"`` kept stays, even when a stale trigger is cancelled long after).

The drivers (:func:`drive_sync`, :func:`drive_async`) carry out the requests against a :class:`JobSource`, a small
protocol that answers "what does the job look like now" (and reads logs, and deletes): a direct poll of the API
(:class:`~.client.SyncKube`, :class:`~.client.AsyncKube`) or the cached watch shared by many triggers
(:mod:`.watch`). So every deletion goes through one path, :data:`DeleteJob`, on both sides.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from airflow_provider_torchelastic.core import causes, image_pull, pod_creation
from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import deadline, kinds, queue_limits, wait_logs
from airflow_provider_torchelastic.kubernetes.requests import (
    AsyncJobSource,
    DeleteJob,
    EmitLog,
    FetchJob,
    JobSource,
    ReadEvents,
    ReadLog,
    ReadWorkloads,
    RenewLease,
    Request,
    Sleep,
)
from airflow_provider_torchelastic.kubernetes.status import is_suspended, parse_time
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

# The requests the generators yield, and the sources that answer them, are :mod:`~.requests`' to export.
__all__ = [
    "drive_async",
    "drive_sync",
    "stop_job",
    "until_first_pause",
    "wait_for_job",
]

# --- the generators: every decision about waiting, no I/O ---------------------------------------------------------


@dataclass(frozen=True)
class _FetchFailed:
    """The driver's answer to a :class:`~.requests.FetchJob` whose source failed (the API refused, or stayed
    unreachable through the retries): the job could not be observed."""

    error: str


@dataclass(kw_only=True)
class _WatchState:
    #: Where the job stood when a progress line was last logged (``WaitDecision.wait_state``): a change of phase or
    #: of running pods is logged at once.
    last_state: str = ""
    last_logged: float = 0.0
    #: How far the pods' logs were printed (:mod:`.wait_logs`).
    logs: wait_logs.PodLogs = field(default_factory=wait_logs.PodLogs)
    #: The last snapshot in which the job existed: what a job that vanished is judged by.
    last_seen: Snapshot | None = None
    #: What the Kueue limits remember between looks (:mod:`~.queue_limits`).
    queue: queue_limits.QueueWatch = field(default_factory=queue_limits.QueueWatch)
    #: Why the controller could not create the job's pods, as last read (:func:`_with_create_error`), and when to
    #: read it again.
    create_error: str = ""
    next_create_read: float = 0.0


def wait_for_job(
    ref: JobRef, policy: WaitPolicy, limits: queue_limits.QueueLimits | None = None
) -> Generator[Request, Any, WaitDecision]:
    """Poll until the job ends (or the deadline passes, or it cannot be observed); clean up; return the decision.

    ``limits``: the Kueue limits (:mod:`~.queue_limits`); the decision's verdict counts the preemptions seen."""
    kind = kinds.get(ref.kind)
    limits = limits or queue_limits.QueueLimits()
    state = _WatchState()
    while True:
        answer = yield FetchJob(ref)
        if isinstance(answer, _FetchFailed):
            yield from _delete(ref, "waiting for it failed")
            return _failed(
                ref,
                "waiting failed",
                f"waiting for {ref.kind} {ref.namespace}/{ref.name} failed ({answer.error}); the job was deleted so "
                "that it does not hold the cluster, and a retry starts a new one",
            )
        snapshot: Snapshot = answer
        if snapshot.job is not None:
            state.last_seen = snapshot
        elif state.last_seen is not None:
            snapshot = replace(snapshot, last_seen=state.last_seen)
        if policy.deadline is not None and snapshot.now >= policy.deadline:
            yield EmitLog(f"execution_timeout reached: deleting {ref.kind} {ref.namespace}/{ref.name}")
            yield from _delete(ref, "execution_timeout reached")
            return _failed(
                ref,
                "execution_timeout reached",
                f"execution_timeout reached while {ref.kind} {ref.namespace}/{ref.name} ran; the job was deleted",
            )
        snapshot = yield from _with_events(ref, kind, snapshot, policy, state)
        decision = kind.decide(ref, snapshot, policy)
        if snapshot.job is not None and not decision.phase.is_terminal:
            decision = yield from queue_limits.check(
                ref, snapshot.job, policy, limits, state.queue, snapshot.now, decision
            )
        if decision.verdict is not None and state.queue.preemptions:
            decision = replace(decision, verdict=replace(decision.verdict, preemptions=state.queue.preemptions))
        current = decision.wait_state
        if current != state.last_state or snapshot.now - state.last_logged >= policy.progress_interval:
            # On change, and as a heartbeat every progress_interval: a long quiet job still shows it is alive.
            yield EmitLog(decision.progress)
            state.last_state, state.last_logged = current, snapshot.now
        yield from wait_logs.print_logs(ref, kind, snapshot, policy, state.logs, final=decision.phase.is_terminal)
        if not decision.phase.is_terminal and policy.lease_seconds is not None and snapshot.job is not None:
            yield from _renew_lease(ref, snapshot.job, policy.lease_seconds, snapshot.now)
        if decision.phase.is_terminal:
            if decision.stop:
                # Ended by the wait, not by the job: kept, it would hold its pods (and GPUs) until something else
                # stops it, so it goes whatever on_finish_action says.
                yield EmitLog(f"Stopping {ref.kind} {ref.namespace}/{ref.name}: {decision.verdict_detail}")
                yield from _delete(ref, "the wait stopped it")
            elif policy.keeps(decision):
                kept = f"{ref.kind} {ref.namespace}/{ref.name}"
                yield EmitLog(f"Keeping {kept} (on_finish_action={policy.finish_action})")
            else:
                # A succeeded job's pods have ended: they hold nothing, and the result is in the decision already, so
                # nobody waits for this deletion (a driver that can, the worker's, detaches it). A failed job may
                # still have running pods: that deletion is waited for, as the deadline's and a stop's are.
                why = f"it ended (on_finish_action={policy.finish_action})"
                yield from _delete(ref, why, background=decision.phase is Phase.SUCCEEDED)
            return decision
        pause = policy.poll_interval
        for due in (policy.deadline, decision.wake_at):
            if due is not None:
                # Wake up for a deadline rather than up to one poll interval after it.
                pause = max(0.0, min(pause, due - snapshot.now))
        yield Sleep(pause)


def until_first_pause(flow: Generator[Request, Any, Any]) -> Generator[Request, Any, Any]:
    """``flow`` up to its first :class:`Sleep`: what it returns, or None when it asked to pause (it is then closed).

    The operator's last look before it defers: one pass of :func:`wait_for_job`, which decides a job that has
    already ended and otherwise leaves the waiting to the trigger.
    """
    answer: Any = None
    while True:
        try:
            request = flow.send(answer)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, Sleep):
            flow.close()
            return None
        answer = yield request


def stop_job(ref: JobRef) -> Generator[Request, Any, bool]:
    """A kill (a user marked the task failed, the worker got SIGTERM): delete the job unless it already finished.

    Returns whether a deletion was requested. When the job cannot be observed it is deleted: a kill means the task
    is over, and an unobserved job must not hold the cluster.
    """
    kind = kinds.get(ref.kind)
    answer = yield FetchJob(ref)
    if isinstance(answer, Snapshot) and answer.job is not None and kind.is_finished(answer.job):
        yield EmitLog(f"{ref.kind} {ref.namespace}/{ref.name} has finished: leaving it as on_finish_action left it")
        return False
    yield from _delete(ref, "the task was killed")
    return True


def _failed(ref: JobRef, state: str, detail: str) -> WaitDecision:
    return WaitDecision(
        phase=Phase.FAILED,
        progress=f"{ref.kind} {ref.name}: {state}",
        verdict=Verdict(succeeded=False, recoverable=True, detail=detail, cause=causes.INFRASTRUCTURE),
    )


def _with_events(
    ref: JobRef, kind: kinds.JobKind, snapshot: Snapshot, policy: WaitPolicy, state: _WatchState
) -> Generator[Request, Any, Snapshot]:
    """``snapshot`` with what events say that the objects do not: why pulls failed, why pods are not created."""
    snapshot = yield from _with_pull_errors(ref, kind, snapshot)
    return (yield from _with_create_error(ref, kind, snapshot, policy, state))


def _with_pull_errors(ref: JobRef, kind: kinds.JobKind, snapshot: Snapshot) -> Generator[Request, Any, Snapshot]:
    """``snapshot`` with why the last pull of each image failed that pods wait for in ``ImagePullBackOff``: kubelet
    1.20's back-off message does not say, and the decision needs it (a missing tag fails at once, a throttled
    registry is waited for). One events read per such image and poll, none while no pod backs off."""
    own_pod = kind.pod_selector(ref.name) is None
    pods = [snapshot.job] if own_pod and snapshot.job is not None else list(snapshot.pods)
    errors = {}
    for image, pod in image_pull.backed_off_images(pods).items():
        events = yield ReadEvents(pod, ref.namespace)
        errors[image] = image_pull.pull_error_of(events or [], image)
    return replace(snapshot, pull_errors=errors) if errors else snapshot


def _with_create_error(
    ref: JobRef, kind: kinds.JobKind, snapshot: Snapshot, policy: WaitPolicy, state: _WatchState
) -> Generator[Request, Any, Snapshot]:
    """``snapshot`` with why the job's controller could not create its pods, while a job whose controller makes its
    pods from templates has none, is not suspended, and is older than ``pending_grace_seconds``: the API server's
    refusal is then only an event on the job. Read paced as the Kueue Workloads are (a triggerer may hold many such
    jobs), and what was read holds until the next read."""
    job = snapshot.job
    if job is None or snapshot.pods or not kind.pod_templates(job) or is_suspended(job):
        state.create_error = ""  # its pods came, or it is held: what the controller said is over
        return snapshot
    created = parse_time((job.get("metadata") or {}).get("creationTimestamp"))
    if created is None or snapshot.now - created < policy.pending_grace_seconds:
        return snapshot
    if snapshot.now >= state.next_create_read:
        events = yield ReadEvents(ref.name, ref.namespace, kind=ref.kind)
        state.create_error = pod_creation.create_error_of(events or [])
        state.next_create_read = snapshot.now + queue_limits.read_pace(policy)
    return replace(snapshot, create_error=state.create_error) if state.create_error else snapshot


def _renew_lease(ref: JobRef, job: Mapping[str, Any], lease: float, now: float) -> Generator[Request, Any, None]:
    """Keep a job without a deadline off the sweep's list while this try waits for it. The job's own label says
    when the lease ends, so a renewal that failed (logged) is simply due again at the next poll."""
    if not deadline.lease_due(job, lease=lease, now=now):
        return
    answer = yield RenewLease(ref, now + lease)
    if isinstance(answer, str):
        yield EmitLog(f"Could not renew the lease of {ref.kind} {ref.namespace}/{ref.name}: {answer}; trying again")


def _delete(ref: JobRef, why: str, *, background: bool = False) -> Generator[Request, Any, None]:
    answer = yield DeleteJob(ref, background=background)
    if answer is None:  # detached by the driver, which reports how it went
        yield EmitLog(f"Deleting {ref.kind} {ref.namespace}/{ref.name} in the background ({why})")
    elif isinstance(answer, str):
        yield EmitLog(f"Could not delete {ref.kind} {ref.namespace}/{ref.name} ({why}): {answer}")
    else:
        yield EmitLog(f"Deleted {ref.kind} {ref.namespace}/{ref.name} ({why}; existed: {answer})")


# --- the drivers: I/O only ------------------------------------------------------------------------------------------


def _no_log_text(error: KubeError, *, log: Callable[[str], None]) -> str:
    # Logs are best effort: a pod being created or deleted answers 400/404; the next poll tries again.
    if error.status not in (400, 404) and not error.recoverable:
        log(f"could not read logs: {error}")
    return ""


def _no_events(error: KubeError, *, log: Callable[[str], None]) -> list[dict[str, Any]]:
    # Events only add detail to a decision already taken (a role without "list events" still gets the back-off).
    log(f"could not read the pod's events: {error}")
    return []


def _no_workloads(error: KubeError, *, log: Callable[[str], None]) -> list[dict[str, Any]]:
    # Kueue not installed (404) or no right to list Workloads (403): the check is skipped, the wait goes on.
    if not error.not_found:
        log(f"could not read the job's Kueue Workloads: {error}")
    return []


@dataclass(frozen=True)
class _Step:
    """One request of a flow as a call of the source: ``call`` (the source's method, bound to the request's
    arguments), whether it is retried, and the answer when it fails for good."""

    call: Callable[[], Any]
    retried: bool
    on_error: Callable[[KubeError], Any]


@dataclass(frozen=True)
class _Done:
    """The last step: the flow returned ``value``."""

    value: Any


def _steps(
    flow: Generator[Request, Any, Any],
    source: JobSource | AsyncJobSource,
    log: Callable[[str], None],
    detach: Callable[[DeleteJob], None] | None,
) -> Generator[_Step | Sleep | _Done, Any, None]:
    """``flow`` with what needs no I/O done (log lines, detached deletions): what is left for a driver is a
    :class:`_Step` (answered with its result) or a :class:`Sleep` (answered with None), until :class:`_Done`. Both
    drivers run this, so they differ only in whether they await."""
    answer: Any = None
    while True:
        try:
            request = flow.send(answer)
        except StopIteration as stop:
            yield _Done(stop.value)
            return
        answer = None
        if isinstance(request, EmitLog):
            log(request.line)
        elif isinstance(request, DeleteJob) and request.background and detach is not None:
            detach(request)
        elif isinstance(request, Sleep):
            yield request
        else:
            answer = yield _step(request, source, log)


def _step(
    request: FetchJob | ReadLog | ReadEvents | ReadWorkloads | DeleteJob | RenewLease,
    source: JobSource | AsyncJobSource,
    log: Callable[[str], None],
) -> _Step:
    if isinstance(request, FetchJob):
        return _Step(functools.partial(source.snapshot, request.ref), True, lambda e: _FetchFailed(str(e)))
    if isinstance(request, ReadLog):
        return _Step(functools.partial(source.read_log, request), False, functools.partial(_no_log_text, log=log))
    if isinstance(request, ReadEvents):
        events = functools.partial(source.events, request)
        return _Step(events, False, functools.partial(_no_events, log=log))
    if isinstance(request, DeleteJob):
        return _Step(functools.partial(source.delete_job, request.ref), True, str)
    if isinstance(request, RenewLease):
        # Not retried here: the lease stays due, and the next poll tries again.
        renew = functools.partial(source.label_job, request.ref, deadline.lease_labels(request.until))
        return _Step(renew, False, str)
    found = functools.partial(source.workloads, request.namespace, request.job_uid)
    return _Step(found, False, functools.partial(_no_workloads, log=log))


def drive_sync(
    flow: Generator[Request, Any, Any],
    source: JobSource,
    log: Callable[[str], None],
    *,
    sleep: Callable[[float], None] = time.sleep,
    detach: Callable[[DeleteJob], None] | None = None,
) -> Any:
    """Carry out a flow's requests with blocking calls; returns what the flow returns.

    ``detach``: starts a deletion that nobody waits for (:attr:`DeleteJob.background`) and returns at once."""
    steps = _steps(flow, source, log, detach)
    step = next(steps)
    while not isinstance(step, _Done):
        step = steps.send(_carry_out_sync(step, log, sleep))
    return step.value


def _carry_out_sync(step: _Step | Sleep, log: Callable[[str], None], sleep: Callable[[float], None]) -> Any:
    """One step with blocking calls: the source's call (retried where the step says so), or a sleep."""
    from airflow_provider_torchelastic.kubernetes.client import retry_sync

    if isinstance(step, Sleep):
        sleep(step.seconds)
        return None
    try:
        return retry_sync(step.call, log, sleep) if step.retried else step.call()
    except KubeError as e:
        return step.on_error(e)


async def drive_async(
    flow: Generator[Request, Any, Any],
    source: AsyncJobSource,
    log: Callable[[str], None],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    detach: Callable[[DeleteJob], None] | None = None,
) -> Any:
    """The same as :func:`drive_sync`, awaiting. A shared watch passes a ``sleep`` that wakes up early when the
    job changed (:mod:`~airflow_provider_torchelastic.kubernetes.watch`). The triggerer passes no ``detach``: a
    deletion started on the shared stream's client could outlive it (the stream closes with its last trigger)."""
    steps = _steps(flow, source, log, detach)
    step = next(steps)
    while not isinstance(step, _Done):
        step = steps.send(await _carry_out_async(step, log, sleep))
    return step.value


async def _carry_out_async(
    step: _Step | Sleep, log: Callable[[str], None], sleep: Callable[[float], Awaitable[None]]
) -> Any:
    """:func:`_carry_out_sync`, awaiting."""
    from airflow_provider_torchelastic.kubernetes.client import retry_async

    if isinstance(step, Sleep):
        await sleep(step.seconds)
        return None
    try:
        return await (retry_async(step.call, log) if step.retried else step.call())
    except KubeError as e:
        return step.on_error(e)
