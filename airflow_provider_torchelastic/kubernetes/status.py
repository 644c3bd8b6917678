"""Pure decisions over what the API server says about a job: where it stands and, once it ended, its verdict.

One decision function per kind of job (``decide_pod``, ``decide_pytorchjob``); :mod:`~.kinds` says which kind
uses which, and :mod:`wait` drives them. Objects are the API's own JSON (camelCase dicts). No I/O, no Airflow, no
kubernetes.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from functools import cached_property
from typing import Any, Final

from airflow_provider_torchelastic.core.outcome import NodeReport, Verdict, WorkerFailure, decide_run, decode_outcome
from airflow_provider_torchelastic.core.summary import PodSummary, pod_summaries, training_container_status

__all__ = [
    "FINISH_ACTIONS",
    "JobRef",
    "LogCursor",
    "Phase",
    "Snapshot",
    "WaitDecision",
    "WaitPolicy",
    "decide_pod",
    "decide_pytorchjob",
    "job_gone",
    "new_log_lines",
    "pod_finished",
    "pytorchjob_finished",
]

#: What happens to the job once it ended: delete it, keep it, or delete it only when it succeeded (the default:
#: a failed job's pods and events stay for debugging; the PyTorchJob's ttl / cleanPodPolicy still apply).
FINISH_ACTIONS: Final = ("delete_succeeded", "delete", "keep")

#: Container waiting reasons that will not resolve by themselves: fail fast (after ``pending_grace_seconds``) instead
#: of waiting for a timeout. Waiting for capacity is not among them: that is bounded by ``scheduling_timeout``.
STUCK_WAITING_REASONS: Final = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
)
#: ``PodScheduled=False`` reasons that mean "waiting for capacity": no node fits yet (an autoscaler may add one), or
#: a queue (Kueue's pod integration) holds the pod back with a scheduling gate until it is admitted.
CAPACITY_REASONS: Final = frozenset({"Unschedulable", "SchedulingGated"})
#: The label that puts a job (or a pod) in a Kueue LocalQueue.
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"


class Phase(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


@dataclass(frozen=True, kw_only=True)
class JobRef:
    """Which object to wait for; ``kind`` names a registered job kind (:mod:`~.kinds`), e.g. ``PyTorchJob``."""

    kind: str
    name: str
    namespace: str


@dataclass(frozen=True, kw_only=True)
class WaitPolicy:
    #: Seconds between polls of the job and its pods.
    poll_interval: float = 10.0
    #: How long a pod may stay stuck (image pull failing, unschedulable, bad config) before the task fails.
    pending_grace_seconds: float = 120.0
    #: Stream the training container's log of at most this many pods into the task log (0: none).
    log_pods: int = 8
    #: Seconds between progress lines while nothing changes.
    progress_interval: float = 60.0
    #: Unix time by which the task must end (its ``execution_timeout``): the wait deletes the job then and fails.
    #: Airflow does not enforce ``execution_timeout`` while a task is deferred, so the wait does, on both paths.
    deadline: float | None = None
    #: What the wait does with the job once it ended: one of :data:`FINISH_ACTIONS`.
    finish_action: str = "delete_succeeded"
    #: Seconds a job may wait for capacity (pods Unschedulable before the job can start, a suspended or queued job)
    #: before the task fails as recoverable; None: as long as the deadline allows.
    scheduling_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.finish_action not in FINISH_ACTIONS:
            raise ValueError(
                f"on_finish_action: expected one of {', '.join(map(repr, FINISH_ACTIONS))}, got {self.finish_action!r}"
            )

    def keeps(self, decision: WaitDecision) -> bool:
        """Whether the ended job stays (for debugging) rather than being deleted."""
        succeeded = decision.phase is Phase.SUCCEEDED
        return self.finish_action == "keep" or (self.finish_action == "delete_succeeded" and not succeeded)


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The API server's answer: the job (``None`` once it is gone) and its pods."""

    job: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]] = ()
    #: Unix time of the observation (a parameter, so that decisions are testable with a fake clock).
    now: float = 0.0
    #: Once the job is gone (``job`` is None): what the wait saw last while it existed, so that a job the training
    #: operator deleted right after it failed (``ttlSecondsAfterFinished: 0``) is judged by what it showed then.
    last_seen: Snapshot | None = None


@dataclass(frozen=True, kw_only=True)
class WaitDecision:
    phase: Phase
    #: One line for the task log: job phase, pods ready/total, elapsed time.
    progress: str
    #: Where the job stands: the progress line without its elapsed time (the job's state, its pods running, waiting
    #: for capacity). The wait logs a progress line at once when this changes. None: the line has no clock (a job
    #: that is gone, a wait that gave up), so all of it says where the job stands.
    state: str | None = None
    verdict: Verdict | None = None
    #: Once the job ended: its pods as the last snapshot showed them, and when the job was created (Unix time), for
    #: the job summary the task saves (:mod:`airflow_provider_torchelastic.core.summary`).
    pods: tuple[PodSummary, ...] = ()
    created: float | None = None
    #: What the log's metrics tap kept (``MetricsTap.to_json()``), set by whoever drove the wait with one.
    metrics: Mapping[str, Any] | None = None
    #: The job has not ended by itself but must not go on (the provider enforced ``active_deadline_seconds``): the
    #: wait deletes it whatever ``on_finish_action`` says, or it would keep its pods. Not part of the event.
    stop: bool = False
    #: Unix time by which the wait must look again whatever happens (a deadline is due then). Not part of the event.
    wake_at: float | None = None

    @property
    def verdict_detail(self) -> str:
        return self.verdict.detail if self.verdict is not None else self.progress

    @property
    def wait_state(self) -> str:
        """What the wait compares from one poll to the next: :attr:`state`, or the whole line when it has no clock."""
        return self.progress if self.state is None else self.state

    def to_event(self) -> dict[str, Any]:
        """JSON-safe form for a trigger event (the trigger and ``execute_complete`` share this one format)."""
        return {
            "phase": self.phase.value,
            "progress": self.progress,
            "state": self.state,
            "verdict": _verdict_to_dict(self.verdict),
            "pods": [pod.to_dict() for pod in self.pods],
            "created": self.created,
            "metrics": None if self.metrics is None else dict(self.metrics),
        }

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> WaitDecision:
        created = event.get("created")
        state = event.get("state")  # absent from events written before it existed
        return cls(
            phase=Phase(event["phase"]),
            progress=str(event.get("progress", "")),
            state=None if state is None else str(state),
            verdict=_verdict_from_dict(event.get("verdict")),
            pods=tuple(PodSummary.from_dict(pod) for pod in event.get("pods") or ()),
            created=float(created) if isinstance(created, int | float) else None,
            metrics=event.get("metrics"),
        )


def _verdict_to_dict(verdict: Verdict | None) -> dict[str, Any] | None:
    return None if verdict is None else asdict(verdict)


def _verdict_from_dict(data: Mapping[str, Any] | None) -> Verdict | None:
    if data is None:
        return None
    failure = data.get("failure")
    return Verdict(**{**data, "failure": WorkerFailure(**failure) if failure else None})


# --- reading Kubernetes objects -----------------------------------------------------------------------------------


def parse_time(value: str | None) -> float | None:
    """RFC 3339 ``2026-11-29T17:40:19Z`` -> Unix time (the API server always writes UTC with ``Z``)."""
    if not value:
        return None
    try:
        return float(calendar.timegm(time.strptime(value[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def pod_report(pod: Mapping[str, Any]) -> NodeReport | None:
    """What an ended pod says: the training container's exit code, reason and outcome document."""
    status = pod.get("status", {})
    container = training_container_status(pod)
    terminated = container.get("state", {}).get("terminated") or container.get("lastState", {}).get("terminated")
    name = pod.get("metadata", {}).get("name", "?")
    if terminated:
        reason = terminated.get("reason", "") if terminated.get("reason") not in ("Error", "Completed") else ""
        return NodeReport(
            name=name,
            exit_code=terminated.get("exitCode"),
            outcome=decode_outcome(terminated.get("message")),
            # An evicted pod's container ends with a plain "Error" (SIGTERM, 143): the pod's own reason says why.
            reason=reason or (status.get("reason", "") if status.get("phase") == "Failed" else ""),
            # Whole seconds: it only orders pods that ended without a report; reports carry their own times.
            finished_at=parse_time(terminated.get("finishedAt")),
        )
    if status.get("phase") == "Failed":
        # Evicted or lost before the container ran to an exit code.
        return NodeReport(name=name, exit_code=None, outcome=None, reason=status.get("reason", "") or "Failed")
    return None


def _stuck_reason(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) if the pod waits on something that will not fix itself (a wrong image, a missing Secret)."""
    status = pod.get("status", {})
    if status.get("phase") not in (None, "Pending"):
        return None
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = container.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING_REASONS:
            return waiting["reason"], waiting.get("message", "")
    return None


@dataclass(frozen=True, kw_only=True)
class CapacityWait:
    """A pod that waits for capacity: not scheduled yet because no node fits, or held back by a queue."""

    pod: str
    reason: str
    message: str
    #: Unix time since when it waits.
    since: float


def capacity_wait(pod: Mapping[str, Any], default_since: float) -> CapacityWait | None:
    status = pod.get("status", {})
    if status.get("phase") not in (None, "Pending"):
        return None
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") != "True"
            and condition.get("reason") in CAPACITY_REASONS
        ):
            metadata = pod.get("metadata", {})
            since = parse_time(metadata.get("creationTimestamp")) or default_since
            return CapacityWait(
                pod=metadata.get("name", "?"),
                reason=condition["reason"],
                message=condition.get("message", ""),
                since=since,
            )
    return None


def queue_name(job: Mapping[str, Any]) -> str | None:
    """The Kueue LocalQueue a job (or pod) was submitted to, if any."""
    return (job.get("metadata", {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL)


def is_suspended(job: Mapping[str, Any]) -> bool:
    """Whether the job is held back (created suspended for a queue, or preempted): ``spec.runPolicy.suspend``."""
    return bool((job.get("spec", {}).get("runPolicy") or {}).get("suspend")) or _condition(job, "Suspended") is not None


def _condition(job: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            found: Mapping[str, Any] = condition
            return found
    return None


def _total_replicas(job: Mapping[str, Any]) -> int:
    specs = job.get("spec", {}).get("pytorchReplicaSpecs", {})
    return sum(int(spec.get("replicas", 1)) for spec in specs.values()) or 1


_ELAPSED: Final = "; elapsed "


def _format_elapsed(seconds: float) -> str:
    seconds = max(0, int(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


# --- the decisions, one per kind of job (kinds maps kinds to them) ---------------------------------------------


def job_gone(ref: JobRef) -> WaitDecision:
    """The job was deleted before it finished (by someone else: we delete only after deciding)."""
    return WaitDecision(
        phase=Phase.FAILED,
        progress=f"{ref.kind} {ref.namespace}/{ref.name} is gone",
        verdict=Verdict(
            succeeded=False,
            recoverable=True,
            detail=f"{ref.kind} {ref.namespace}/{ref.name} was deleted before it finished (outside Airflow?)",
        ),
    )


@dataclass(frozen=True, kw_only=True)
class _Observed:
    """What every kind's decision starts from: the job's pods, their reports, and the progress line's parts."""

    ref: JobRef
    job: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]]
    total: int
    now: float

    @property
    def created(self) -> float:
        return parse_time(self.job.get("metadata", {}).get("creationTimestamp")) or self.now

    @property
    def running(self) -> int:
        return sum(1 for pod in self.pods if pod.get("status", {}).get("phase") == "Running")

    @cached_property  # read by the decision and by every progress line of it
    def waiting_for_capacity(self) -> list[CapacityWait]:
        return [wait for pod in self.pods if (wait := capacity_wait(pod, self.created)) is not None]

    def decision(
        self,
        phase: Phase,
        state: str,
        *,
        verdict: Verdict | None = None,
        stop: bool = False,
        wake_at: float | None = None,
    ) -> WaitDecision:
        """A decision whose progress line says ``state``, the pods, and the elapsed time: the line and its parts."""
        waiting = len(self.waiting_for_capacity)
        capacity = f", {waiting} waiting for capacity" if waiting else ""
        where = f"{self.ref.kind} {self.ref.name}: {state}; pods running {self.running}/{self.total}{capacity}"
        elapsed = _format_elapsed(self.now - self.created)
        return WaitDecision(
            phase=phase,
            progress=f"{where}{_ELAPSED}{elapsed}",
            state=where,
            verdict=verdict,
            stop=stop,
            wake_at=wake_at,
        )

    def reports(self) -> list[NodeReport]:
        return [report for pod in self.pods if (report := pod_report(pod)) is not None]


def _stuck_decision(seen: _Observed, policy: WaitPolicy) -> WaitDecision | None:
    """Pods stuck on something that never resolves by itself fail fast, with Kubernetes' own words."""
    for pod in seen.pods:
        stuck = _stuck_reason(pod)
        if stuck is None:
            continue
        since = parse_time(pod.get("metadata", {}).get("creationTimestamp")) or seen.created
        if seen.now - since >= policy.pending_grace_seconds:
            reason, message = stuck
            name = pod.get("metadata", {}).get("name", "?")
            return seen.decision(
                Phase.FAILED,
                f"failed ({reason})",
                verdict=Verdict(
                    succeeded=False,
                    recoverable=False,
                    node=name,
                    detail=f"pod {name} stuck in {reason} for more than {policy.pending_grace_seconds:.0f} s: "
                    f"{message}".rstrip(": "),
                ),
            )
    return None


def _out_of_patience(seen: _Observed, policy: WaitPolicy, since: float, what: str, node: str | None) -> WaitDecision:
    """The decision while waiting for capacity: pending, or failed (recoverable) once scheduling_timeout passed."""
    waited = seen.now - since
    if policy.scheduling_timeout is not None and waited >= policy.scheduling_timeout:
        return seen.decision(
            Phase.FAILED,
            f"failed (waited {waited:.0f} s for capacity)",
            verdict=Verdict(
                succeeded=False,
                recoverable=True,
                node=node,
                detail=f"waited {waited:.0f} s for capacity, longer than scheduling_timeout="
                f"{policy.scheduling_timeout:g}: {what}; capacity may free up, so a retry may help",
            ),
        )
    return seen.decision(Phase.PENDING, f"waiting for capacity: {what}")


def _describe(wait: CapacityWait) -> str:
    gated = " (held by a queue until admitted)" if wait.reason == "SchedulingGated" else ""
    return f"pod {wait.pod} is {wait.reason}{gated}: {wait.message}".rstrip(": ")


def pod_finished(pod: Mapping[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def _with_pods(decision: WaitDecision, snapshot: Snapshot, pods: Sequence[Mapping[str, Any]]) -> WaitDecision:
    """A decision that ends the wait carries the pods and the creation time, for the job summary."""
    if not decision.phase.is_terminal or snapshot.job is None:
        return decision
    created = parse_time(snapshot.job.get("metadata", {}).get("creationTimestamp"))
    return replace(decision, pods=pod_summaries(pods), created=created)


def decide_pod(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """A single Pod (one node): it is its own only pod."""
    decision = _decide_pod(ref, snapshot, policy)
    return _with_pods(decision, snapshot, [snapshot.job] if snapshot.job is not None else [])


def _decide_pod(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    job = snapshot.job
    if job is None:
        return job_gone(ref)
    seen = _Observed(ref=ref, job=job, pods=[job], total=1, now=snapshot.now)
    stuck = _stuck_decision(seen, policy)
    if stuck is not None:
        return stuck
    phase = job.get("status", {}).get("phase", "Pending")
    if pod_finished(job):
        reports = seen.reports()
        verdict = decide_run(reports) if reports else Verdict(succeeded=False, detail=f"pod ended {phase}")
        return seen.decision(_phase_of(verdict), phase, verdict=verdict)
    waits = seen.waiting_for_capacity
    if waits:
        return _out_of_patience(seen, policy, waits[0].since, _describe(waits[0]), waits[0].pod)
    return seen.decision(Phase.RUNNING if phase == "Running" else Phase.PENDING, phase)


def pytorchjob_finished(job: Mapping[str, Any]) -> bool:
    return _condition(job, "Succeeded") is not None or _condition(job, "Failed") is not None


def _min_nodes(job: Mapping[str, Any], total: int) -> int:
    """How many pods the job needs running to make progress: elastic ``minReplicas``, else all of them."""
    elastic = job.get("spec", {}).get("elasticPolicy") or {}
    minimum = elastic.get("minReplicas")
    return int(minimum) if isinstance(minimum, int) and 0 < minimum <= total else total


def decide_pytorchjob(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """A Kubeflow PyTorchJob: its conditions, and the reports of its pods."""
    return _with_pods(_decide_pytorchjob(ref, snapshot, policy), snapshot, snapshot.pods)


def _decide_pytorchjob(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    job = snapshot.job
    if job is None:
        return _vanished(ref, snapshot)
    seen = _Observed(ref=ref, job=job, pods=list(snapshot.pods), total=_total_replicas(job), now=snapshot.now)
    stuck = _stuck_decision(seen, policy)
    if stuck is not None:
        return stuck
    reports = seen.reports()

    failed = _condition(job, "Failed")
    deadline = active_deadline(job)
    if failed is None and _condition(job, "Succeeded") is None and deadline is not None:
        # The training operator checks activeDeadlineSeconds only when an event makes it reconcile the job
        # (kubeflow/trainer v1.9 common/job.go: its timed re-check goes to a no-op queue), so a quiet job runs past
        # it. The wait enforces it itself, from the same start time, and stops the job.
        seconds, expires = deadline
        if seen.now >= expires:
            return seen.decision(
                Phase.FAILED,
                "failed (past run_policy.active_deadline_seconds)",
                verdict=Verdict(
                    succeeded=False,
                    detail=f"{ref.kind} {ref.namespace}/{ref.name}: {_DEADLINE_PREFIX}={seconds} (counted from "
                    "its start time) and was stopped by the provider; a retry would run into the same limit",
                ),
                stop=True,
            )
    if failed is not None:
        # The job fails as soon as one replica does; its peers end a moment later, and the earliest failure (the
        # root cause) may be on a pod that has not ended yet. Give the pods that still run a moment to report.
        failed_at = parse_time(failed.get("lastTransitionTime")) or seen.now
        if seen.running and seen.now - failed_at < _FAILED_SETTLE_SECONDS:
            return seen.decision(Phase.RUNNING, "Failed, waiting for its pods to report")
        verdict = decide_run(reports)
        by_condition = _failed_condition_verdict(job, failed)
        if verdict.failure is None:
            # No worker reported an exception: the job's own condition says why (deadline, backoff limit), and
            # pods stopped because of it (exit 143) are consequences, not causes.
            if verdict.succeeded or not verdict.node or by_condition.detail.startswith(_DEADLINE_PREFIX):
                verdict = by_condition
        elif _says_more(failed):
            # The root cause, and what the training operator did about it (restarts up to the backoff limit).
            verdict = replace(verdict, detail=f"{verdict.detail}; {by_condition.detail}")
        if _condition(job, "Succeeded") is not None:
            # Both at once: the operator checks success and failure in one pass (elastic success does not return
            # before the failure check, and replica types come in random order). The verdict is the pods', never
            # the order the operator happened to write: any rank that failed fails the task.
            verdict = replace(verdict, detail=f"{verdict.detail}; {_BOTH_CONDITIONS}")
        return seen.decision(Phase.FAILED, "Failed", verdict=verdict)

    if _condition(job, "Succeeded") is not None:
        # An elastic PyTorchJob is Succeeded as soon as *one* worker succeeds; rank 0 may be on another pod that
        # is still at its exit barrier. Wait for the pod that reports rank 0's result. Pods that never got
        # capacity (an elastic job that ran on fewer nodes) will not end: they are not waited for.
        holders = [r for r in reports if r.outcome is not None and r.outcome.holds_rank0]
        started = len(seen.pods) - len(seen.waiting_for_capacity)
        if holders or len(reports) >= started:
            verdict = decide_run(reports)
            return seen.decision(_phase_of(verdict), "Succeeded", verdict=verdict)
        return seen.decision(Phase.RUNNING, "Succeeded, waiting for rank 0's pod")

    queue = queue_name(job)
    if is_suspended(job):
        # Queued (created suspended, e.g. by Kueue) or preempted (suspended while running; its pods are deleted and
        # come back when it is resumed): waiting for capacity, not a failure.
        suspended = _condition(job, "Suspended")
        since = parse_time(suspended.get("lastTransitionTime")) if suspended else None
        what = f"{ref.kind} {ref.name} is suspended" + (f" (queued in Kueue LocalQueue {queue})" if queue else "")
        return _out_of_patience(seen, policy, since or seen.created, what, None)

    waits = seen.waiting_for_capacity
    wake_at = deadline[1] if deadline is not None else None
    host = rendezvous_host_pod(job)
    host_wait = next((wait for wait in waits if wait.pod == host), None)
    if host_wait is not None:
        # Elastic rendezvous: the c10d store lives on the pod PET_RDZV_ENDPOINT names (worker-0), and only that pod
        # can host it; without it no other worker can join, however many run.
        what = f"{_describe(host_wait)} (it hosts the rendezvous; no worker can start without it)"
        return replace(_out_of_patience(seen, policy, host_wait.since, what, host_wait.pod), wake_at=wake_at)
    if waits and seen.running < _min_nodes(job, seen.total):
        # The job cannot start (or go on) without these pods: waiting for capacity, bounded by scheduling_timeout.
        first = min(waits, key=lambda wait: wait.since)
        return replace(_out_of_patience(seen, policy, first.since, _describe(first), first.pod), wake_at=wake_at)
    # Enough pods run (elastic partial capacity: the rest may join later, or never): the job makes progress.
    for state in ("Restarting", "Running"):
        if _condition(job, state) is not None:
            phase = Phase.RUNNING if seen.running else Phase.PENDING
            return seen.decision(phase, state, wake_at=wake_at)
    created = "Created" if _condition(job, "Created") else "Pending"
    if queue:
        created += f" (Kueue LocalQueue {queue})"
    return seen.decision(Phase.PENDING, created, wake_at=wake_at)


def active_deadline(job: Mapping[str, Any]) -> tuple[int, float] | None:
    """``(activeDeadlineSeconds, the Unix time it expires)`` of a started PyTorchJob, or None.

    Counted from ``status.startTime``, as the training operator counts it (a resumed job's start time is reset).
    A job that has not started, or is suspended, has no deadline running.
    """
    seconds = (job.get("spec", {}).get("runPolicy") or {}).get("activeDeadlineSeconds")
    started = parse_time(job.get("status", {}).get("startTime"))
    if not isinstance(seconds, int) or isinstance(seconds, bool) or started is None or is_suspended(job):
        return None
    return seconds, started + seconds


def rendezvous_host_pod(job: Mapping[str, Any]) -> str | None:
    """The pod that hosts an elastic PyTorchJob's c10d store: ``<job>-worker-0``, unless ``rdzvHost`` moves it.

    The training operator points every worker's ``PET_RDZV_ENDPOINT`` at ``<job>-worker-0`` (kubeflow/trainer v1.9
    ``pytorch/elastic.go``), and torch elastic hosts the store only on the machine that address resolves to.
    """
    spec = job.get("spec", {})
    elastic = spec.get("elasticPolicy")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if elastic is None or "Master" in replicas or "Worker" not in replicas or elastic.get("rdzvHost"):
        return None
    return f"{job.get('metadata', {}).get('name', '')}-worker-0"


def _vanished(ref: JobRef, snapshot: Snapshot) -> WaitDecision:
    """The job is gone. With ``ttlSecondsAfterFinished`` set, the training operator itself may have deleted it, and
    with a TTL of 0 a job failed by its backoff limit or deadline is deleted *before* its Failed condition is written
    (kubeflow/trainer v1.9 common/job.go: CleanupJob before UpdateJobConditions). What the wait saw last then says
    why it failed; without that evidence (or without a TTL: someone deleted it) a retry may help."""
    last = snapshot.last_seen
    job = last.job if last is not None else None
    if (
        last is None
        or job is None
        or (job.get("spec", {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished") is None
    ):
        return job_gone(ref)
    seen = _Observed(ref=ref, job=job, pods=list(last.pods), total=_total_replicas(job), now=snapshot.now)
    gone = (
        f"then {ref.kind} {ref.namespace}/{ref.name} vanished: its ttlSecondsAfterFinished deleted it as it failed, "
        "before its Failed condition was written"
    )
    state = "Failed (deleted by its TTL)"
    verdict = decide_run(seen.reports())
    if not verdict.succeeded and verdict.node:
        return seen.decision(Phase.FAILED, state, verdict=replace(verdict, detail=f"{verdict.detail}; {gone}"))
    deadline = active_deadline(job)
    if deadline is not None and snapshot.now >= deadline[1]:
        detail = f"{_DEADLINE_PREFIX}={deadline[0]} and was stopped; {gone}"
        return seen.decision(Phase.FAILED, state, verdict=Verdict(succeeded=False, detail=detail))
    limit = (job.get("spec", {}).get("runPolicy") or {}).get("backoffLimit")
    restarts = sum(_restarts(pod) for pod in last.pods)
    if isinstance(limit, int) and restarts and restarts >= limit:
        detail = f"its pods restarted {restarts} times, reaching backoffLimit={limit}; {gone}"
        return seen.decision(Phase.FAILED, state, verdict=Verdict(succeeded=False, detail=detail))
    return job_gone(ref)


def _restarts(pod: Mapping[str, Any]) -> int:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return sum(int(status.get("restartCount") or 0) for status in statuses)


def _phase_of(verdict: Verdict) -> Phase:
    return Phase.SUCCEEDED if verdict.succeeded else Phase.FAILED


_DEADLINE_PREFIX: Final = "the job ran longer than run_policy.active_deadline_seconds"
_BOTH_CONDITIONS: Final = (
    "the PyTorchJob is both Succeeded and Failed (the training operator wrote both in one pass); the pods decide: "
    "a rank that failed fails the task"
)


#: How long a failed job's still-running pods may take to report before the verdict is taken without them.
_FAILED_SETTLE_SECONDS: Final = 10.0


def _says_more(condition: Mapping[str, Any]) -> bool:
    """Whether a Failed condition tells more than "a replica failed": a backoff limit or a deadline was reached."""
    message = str(condition.get("message", "")).lower()
    return "backoff" in message or "deadline" in message


def _failed_condition_verdict(job: Mapping[str, Any], condition: Mapping[str, Any]) -> Verdict:
    message = condition.get("message", "") or condition.get("reason", "")
    deadline = job.get("spec", {}).get("runPolicy", {}).get("activeDeadlineSeconds")
    if deadline is not None and "deadline" in message.lower():
        return Verdict(
            succeeded=False,
            detail=f"{_DEADLINE_PREFIX}={deadline} and was stopped ({message})",
        )
    return Verdict(succeeded=False, recoverable=False, detail=f"the PyTorchJob failed: {message}")


# --- pod logs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LogCursor:
    """How far a pod's log was printed: the last timestamp and the lines already printed at that timestamp."""

    last_time: str = ""
    lines_at_last_time: tuple[str, ...] = ()
    last_seen: float = 0.0


def new_log_lines(cursor: LogCursor, text: str) -> tuple[list[str], LogCursor]:
    """Lines of a timestamped log read that were not printed yet, and the advanced cursor.

    Kubernetes can only restart a log read at a whole second, so reads overlap; lines at or before the last printed
    timestamp are dropped, except those at exactly that timestamp not printed yet. Nothing is printed twice.
    """
    fresh: list[str] = []
    last_time, at_last = cursor.last_time, list(cursor.lines_at_last_time)
    parsed = [_split_stamp(raw, last_time) for raw in text.splitlines()]
    for stamp, line in parsed:
        if stamp < last_time:
            continue
        if stamp == last_time:
            if line in at_last:
                at_last.remove(line)  # seen before: consume one occurrence, print nothing
                continue
            fresh.append(line)
            continue
        fresh.append(line)
        last_time = stamp
        at_last = []
    # Remember every line printed at the final timestamp (including the earlier ones) for the next overlap.
    printed_at_last = [line for stamp, line in parsed if stamp == last_time]
    return fresh, LogCursor(
        last_time=last_time,
        lines_at_last_time=tuple(printed_at_last) or cursor.lines_at_last_time,
        last_seen=parse_time(last_time) or cursor.last_seen,
    )


def _split_stamp(raw: str, previous: str) -> tuple[str, str]:
    """``"2026-11-29T17:40:19.1234Z line"`` -> (a sortable stamp, the line).

    The API writes RFC 3339 with nanoseconds *without trailing zeros*, so the fractions are padded before any
    comparison: ``.1234Z`` would otherwise sort after ``.12345Z``.
    """
    stamp, _, line = raw.partition(" ")
    if not (stamp[:4].isdigit() and stamp.endswith("Z")):
        return previous, raw  # a line without a timestamp keeps its place after the previous one
    base, _, fraction = stamp[:-1].partition(".")
    return f"{base}.{fraction.ljust(9, '0')[:9]}Z", line
