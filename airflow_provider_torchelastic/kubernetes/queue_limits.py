"""Kueue limits on the wait: at most N preemptions, and an admitted Workload whose job never starts.

Two ways a queued job can keep a task waiting for nothing:

* **Preempted again and again.** Kueue preempts an admitted job by suspending it (its pods are deleted) and requeues
  it; the wait treats that as "queued", so a job preempted over and over restarts forever within its try
  (kueue#9807). With ``max_preemptions=N`` the try that sees the task instance's N-th preemption fails with the
  preemption cause instead of waiting again. A preemption is the job suspended again after this wait saw it run
  (not suspended); earlier tries' preemptions come from the task state store (:attr:`QueueLimits.preemptions_before`).
* **Admitted, yet suspended.** Kueue admits a Workload by un-suspending its job; when Kueue and the job's controller
  disagree on the job's API (a version skew, kueue#11931), the Workload is admitted and holds its quota while the job
  stays suspended, and the task looks queued until ``scheduling_timeout``. Once a job in a queue has been held longer
  than ``pending_grace_seconds``, the wait reads its Workloads (Kueue labels them with the job's uid), paced; one
  admitted longer than that grace fails the try with the configuration cause, naming the Workload.

Both end the job whatever ``on_finish_action`` says (``stop``): a suspended job left behind would be admitted and
run later with nobody waiting for it. Pure; :func:`check` and :func:`workload_check` are generators of the wait's
requests (:mod:`~.wait` drives them).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.outcome import Verdict
from airflow_provider_torchelastic.kubernetes.kinds.held import suspended_since
from airflow_provider_torchelastic.kubernetes.requests import EmitLog, ReadWorkloads, Request
from airflow_provider_torchelastic.kubernetes.status import parse_time, queue_name, true_condition
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, WaitDecision, WaitPolicy
from airflow_provider_torchelastic.kubernetes.workloads import JOB_UID_LABEL

__all__ = [
    "QueueLimits",
    "QueueWatch",
    "admitted_but_held",
    "check",
    "is_held",
    "note_preemption",
    "preemption_limit",
    "read_pace",
    "workload_check",
]

#: The longest pause between two reads of a held job's Workloads, or of a job's events while it has no pods
#: (:func:`read_pace`).
WORKLOAD_READ_MAX_INTERVAL: Final = 60.0


def read_pace(policy: WaitPolicy) -> float:
    """Seconds between two reads a quiet job's wait adds (its Workloads, its events): once per
    ``pending_grace_seconds``, at least ``poll_interval``, at most :data:`WORKLOAD_READ_MAX_INTERVAL`."""
    return min(max(policy.poll_interval, policy.pending_grace_seconds), WORKLOAD_READ_MAX_INTERVAL)


@dataclass(frozen=True, kw_only=True)
class QueueLimits:
    """What the wait enforces on a queued job besides :class:`~.wait_types.WaitPolicy` (the operator's arguments)."""

    #: The task instance's preemption at which the try fails instead of waiting again; None: never.
    max_preemptions: int | None = None
    #: Preemptions of this task instance in its earlier tries (the task state store's count).
    preemptions_before: int = 0

    def __post_init__(self) -> None:
        if self.max_preemptions is not None and self.max_preemptions < 1:
            raise ValueError(f"max_preemptions: expected an int >= 1 or None, got {self.max_preemptions!r}")


@dataclass(kw_only=True)
class QueueWatch:
    """What the wait remembers of a queued job between two looks (lost with the waiter: a triggerer restart
    forgets a preemption it saw, never counts one twice)."""

    #: Whether the job was held (suspended) at the last look; None before the first.
    held: bool | None = None
    #: Whether this wait saw the job admitted (not held).
    ran: bool = False
    #: Preemptions seen by this wait.
    preemptions: int = 0
    #: Unix time before which the Workloads are not read again.
    next_workload_read: float = 0.0


def is_held(job: Mapping[str, Any]) -> bool:
    """Whether the job is suspended: a PyTorchJob's ``runPolicy.suspend``, a TrainJob's ``suspend``, or its
    ``Suspended`` condition."""
    spec = job.get("spec") or {}
    return (
        bool((spec.get("runPolicy") or {}).get("suspend"))
        or bool(spec.get("suspend"))
        or true_condition(job, "Suspended") is not None
    )


def note_preemption(watch: QueueWatch, job: Mapping[str, Any]) -> bool:
    """Remember what this look at ``job`` shows; whether it shows a preemption (held again after it ran)."""
    held = is_held(job)
    preempted = held and watch.ran and watch.held is False
    watch.ran = watch.ran or not held
    watch.held = held
    watch.preemptions += preempted
    return preempted


def _failed(ref: JobRef, state: str, *, recoverable: bool, cause: str, reason: str, detail: str) -> WaitDecision:
    """A failed decision that stops the job; its verdict says why."""
    verdict = Verdict(succeeded=False, recoverable=recoverable, cause=cause, reason=reason, detail=detail)
    return WaitDecision(phase=Phase.FAILED, progress=f"{ref.kind} {ref.name}: {state}", verdict=verdict, stop=True)


def preemption_limit(ref: JobRef, limits: QueueLimits, watch: QueueWatch) -> WaitDecision | None:
    """The failed decision once a preemption just seen is the task instance's ``max_preemptions``-th, else None."""
    total = limits.preemptions_before + watch.preemptions
    if limits.max_preemptions is None or total < limits.max_preemptions:
        return None
    earlier = f" ({limits.preemptions_before} in earlier tries)" if limits.preemptions_before else ""
    return _failed(
        ref,
        f"failed (preempted {total} times)",
        recoverable=True,
        cause=causes.PREEMPTED,
        reason="Preempted",
        detail=f"{ref.kind} {ref.namespace}/{ref.name} was preempted (suspended by its queue after it ran): "
        f"preemption {total} of this task instance{earlier} reaches max_preemptions={limits.max_preemptions}, "
        "so the try fails instead of waiting to be admitted again; the job was deleted",
    )


def _held_since(job: Mapping[str, Any], now: float) -> float:
    return suspended_since(job) or parse_time((job.get("metadata") or {}).get("creationTimestamp")) or now


def _owned_by(workload: Mapping[str, Any], uid: str) -> bool:
    owners = (workload.get("metadata") or {}).get("ownerReferences") or []
    labels = (workload.get("metadata") or {}).get("labels") or {}
    return labels.get(JOB_UID_LABEL) == uid or any(owner.get("uid") == uid for owner in owners)


def admitted_but_held(
    ref: JobRef, job: Mapping[str, Any], workloads: Sequence[Mapping[str, Any]], grace: float, now: float
) -> WaitDecision | None:
    """The failed decision when one of the job's Workloads has been admitted for ``grace`` seconds while the job is
    still held; else None."""
    uid = str((job.get("metadata") or {}).get("uid") or "")
    for workload in workloads:
        admitted = true_condition(workload, "Admitted")
        if not uid or not _owned_by(workload, uid) or admitted is None:
            continue
        since = parse_time(admitted.get("lastTransitionTime")) or now
        if now - since < grace:
            continue
        name = (workload.get("metadata") or {}).get("name", "?")
        cluster_queue = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue")
        where = f" to ClusterQueue {cluster_queue}" if cluster_queue else ""
        return _failed(
            ref,
            "failed (admitted by Kueue, yet still suspended)",
            recoverable=False,
            cause=causes.CONFIGURATION,
            reason="AdmittedButSuspended",
            detail=f"Kueue Workload {ref.namespace}/{name} was admitted{where} {now - since:.0f} s ago, yet "
            f"{ref.kind} {ref.namespace}/{ref.name} is still suspended (longer than pending_grace_seconds="
            f"{grace:g}): Kueue and the job's controller disagree on the job, most likely a version skew "
            "between Kueue and the training operator or Trainer (kueue#11931); check that your Kueue version "
            f"supports this {ref.kind} API and its integration is enabled (`kubectl describe workload -n "
            f"{ref.namespace} {name}`). The job was deleted; a retry will not help until the versions match",
        )
    return None


def workload_check(
    ref: JobRef, job: Mapping[str, Any], policy: WaitPolicy, watch: QueueWatch, now: float
) -> Generator[ReadWorkloads, Any, WaitDecision | None]:
    """Read a held, queued job's Workloads when it has been held longer than ``pending_grace_seconds`` (paced), and
    decide :func:`admitted_but_held` from them; None when there is nothing to say."""
    grace = policy.pending_grace_seconds
    uid = (job.get("metadata") or {}).get("uid")
    if not uid or queue_name(job) is None or not is_held(job) or now < watch.next_workload_read:
        return None
    if now - _held_since(job, now) < grace:
        return None
    watch.next_workload_read = now + read_pace(policy)
    workloads = yield ReadWorkloads(ref.namespace, str(uid))
    return admitted_but_held(ref, job, workloads or [], grace, now)


def check(
    ref: JobRef,
    job: Mapping[str, Any],
    policy: WaitPolicy,
    limits: QueueLimits,
    watch: QueueWatch,
    now: float,
    decision: WaitDecision,
) -> Generator[Request, Any, WaitDecision]:
    """``decision`` (a job that has not ended), or the failure the Kueue limits decide instead: a preemption that
    reaches ``max_preemptions``, or an admitted Workload whose job stays suspended."""
    if note_preemption(watch, job):
        total = limits.preemptions_before + watch.preemptions
        yield EmitLog(
            f"{ref.kind} {ref.namespace}/{ref.name} was preempted (suspended again after it ran): preemption "
            f"{total} of this task instance (max_preemptions={limits.max_preemptions})"
        )
        limit = preemption_limit(ref, limits, watch)
        if limit is not None:
            return limit
    held = yield from workload_check(ref, job, policy, watch, now)
    return held if held is not None else decision
