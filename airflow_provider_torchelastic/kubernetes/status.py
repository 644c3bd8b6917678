"""Pure decisions over what the API server says about a job: where it stands and, once it ended, its verdict.

What every kind's decision shares: what a pod says (its report, capacity waits, stuck reasons), a job's
conditions, and the steps of a decision (:class:`Observed`), over the wait's types (:mod:`.wait_types`). Each
kind's own decision is in its module under :mod:`.kinds`, and :mod:`.wait` drives them. Objects are the API's own
JSON (camelCase dicts). No I/O, no Airflow, no kubernetes.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Final

from airflow_provider_torchelastic.core import causes, image_pull, pod_creation
from airflow_provider_torchelastic.core.metrics_format import cut_log_line
from airflow_provider_torchelastic.core.outcome import NodeReport, Verdict, decode_outcome
from airflow_provider_torchelastic.core.summary import pod_summaries, training_container_status
from airflow_provider_torchelastic.core.validation import as_list, text_or
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

__all__ = [
    "LogCursor",
    "Observed",
    "describe_wait",
    "job_gone",
    "new_log_lines",
    "out_of_patience",
    "phase_of",
    "pods_not_created",
    "seconds_before",
    "stuck_decision",
    "true_condition",
    "with_pods",
]


#: Container waiting reasons that will not resolve by themselves: fail fast (after ``pending_grace_seconds``) instead
#: of waiting for a timeout. Waiting for capacity is not among them: that is bounded by ``scheduling_timeout``. Every
#: image pull reason is (``ErrImageNeverPull`` was once missing, so such a pod waited for its deadline although
#: :mod:`..core.image_pull` calls it permanent).
STUCK_WAITING_REASONS: Final = image_pull.PULL_REASONS | {"CreateContainerConfigError", "CreateContainerError"}
#: ``PodScheduled=False`` reasons that mean "waiting for capacity": no node fits yet (an autoscaler may add one), or
#: a queue (Kueue's pod integration) holds the pod back with a scheduling gate until it is admitted.
CAPACITY_REASONS: Final = frozenset({"Unschedulable", "SchedulingGated"})
#: The label that puts a job (or a pod) in a Kueue LocalQueue.
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"


# --- reading Kubernetes objects -----------------------------------------------------------------------------------


def parse_time(value: str | None) -> float | None:
    """RFC 3339 ``2026-11-29T17:40:19Z`` -> Unix time (the API server always writes UTC with ``Z``)."""
    if not value:
        return None
    try:
        # Not strptime: every waiting trigger parses its job's times on every poll, and strptime costs 20 us a call.
        return datetime.datetime.fromisoformat(value[:19]).replace(tzinfo=datetime.UTC).timestamp()
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
            # An evicted pod's container ends with a plain "Error" (SIGTERM, 143): the pod's own reason says why,
            # or (1.26+, a preemption or drain) only its DisruptionTarget condition.
            reason=reason or (status.get("reason", "") if status.get("phase") == "Failed" else "") or _disruption(pod),
            # Whole seconds: it only orders pods that ended without a report; reports carry their own times.
            finished_at=parse_time(terminated.get("finishedAt")),
        )
    if status.get("phase") == "Failed":
        # Evicted or lost before the container ran to an exit code.
        return NodeReport(name=name, exit_code=None, outcome=None, reason=status.get("reason", "") or "Failed")
    return None


def _disruption(pod: Mapping[str, Any]) -> str:
    """The reason of a pod's true DisruptionTarget condition (``PreemptionByScheduler``, ``EvictionByEvictionAPI``)."""
    for condition in as_list(pod.get("status", {}).get("conditions")):
        if isinstance(condition, Mapping) and (condition.get("type"), condition.get("status")) == (
            "DisruptionTarget",
            "True",
        ):
            return text_or(condition.get("reason"), "") or "DisruptionTarget"
    return ""


def restarted_run(pod: Mapping[str, Any], container: str) -> tuple[int, Mapping[str, Any]] | None:
    """(restart count, how its previous run ended) of a pod's ``container`` that the kubelet restarted in place;
    None when it never restarted, or the kubelet no longer says how the previous run ended."""
    statuses = pod.get("status", {}).get("containerStatuses") or []
    status = next((s for s in statuses if s.get("name") == container), None)
    if status is None:
        return None
    count = int(status.get("restartCount") or 0)
    terminated = (status.get("lastState") or {}).get("terminated")
    return (count, terminated) if count > 0 and terminated else None


def _stuck_reason(pod: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(reason, message, image) if the pod waits on something that may not fix itself (an image, a Secret)."""
    status = pod.get("status", {})
    if status.get("phase") not in (None, "Pending"):
        return None
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = container.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING_REASONS:
            return waiting["reason"], waiting.get("message", ""), str(container.get("image") or "")
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
    return (
        bool((job.get("spec", {}).get("runPolicy") or {}).get("suspend"))
        or true_condition(job, "Suspended") is not None
    )


def true_condition(job: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            found: Mapping[str, Any] = condition
            return found
    return None


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
            cause=causes.INFRASTRUCTURE,
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Observed:
    """What every kind's decision starts from: the job's pods, their reports, and the progress line's parts."""

    ref: JobRef
    job: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]]
    total: int
    now: float
    #: The snapshot's :attr:`Snapshot.pull_errors`.
    pull_errors: Mapping[str, str] | None = None

    @property
    def created(self) -> float:
        return parse_time(self.job.get("metadata", {}).get("creationTimestamp")) or self.now

    @property
    def running(self) -> int:
        return sum(1 for pod in self.pods if pod.get("status", {}).get("phase") == "Running")

    @cached_property  # read by the decision and by every progress line of it
    def waiting_for_capacity(self) -> list[CapacityWait]:
        return [wait for pod in self.pods if (wait := capacity_wait(pod, self.created)) is not None]

    @property
    def placed(self) -> int:
        """Pods that got capacity and have not failed: starting on their node, running, or done.

        What a job needs to make progress. Counting only Running pods would take a pod that already succeeded
        (its job's Succeeded condition not yet written) or one still starting its container for one that waits.
        """
        waiting = {wait.pod for wait in self.waiting_for_capacity}
        return sum(
            1
            for pod in self.pods
            if pod.get("metadata", {}).get("name") not in waiting and pod.get("status", {}).get("phase") != "Failed"
        )

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

    def stopped(self, state: str, cause: str, detail: str) -> WaitDecision:
        """A failure the wait decided and no retry mends: the job is stopped, and the verdict says why."""
        return self.decision(
            Phase.FAILED, state, verdict=Verdict(succeeded=False, cause=cause, detail=detail), stop=True
        )

    def reports(self) -> list[NodeReport]:
        return [report for pod in self.pods if (report := pod_report(pod)) is not None]


def stuck_decision(seen: Observed, policy: WaitPolicy) -> WaitDecision | None:
    """Pods stuck on something that never resolves by itself fail fast, with Kubernetes' own words. An image the
    registry refused for good fails at once; a pull that may pass (429, 5xx, a timeout) is retried by the kubelet's
    back-off up to ``image_pull_timeout``, then fails as recoverable (:mod:`~.core.image_pull`)."""
    for pod in seen.pods:
        stuck = _stuck_reason(pod)
        if stuck is None:
            continue
        reason, message, image = stuck
        name = pod.get("metadata", {}).get("name", "?")
        since = parse_time(pod.get("metadata", {}).get("creationTimestamp")) or seen.created
        last = (seen.pull_errors or {}).get(image, "") if reason == image_pull.BACK_OFF else ""
        pull = image_pull.classify_pull(reason, last or message) if reason in image_pull.PULL_REASONS else None
        cause, recoverable = causes.cause_of_stuck_reason(reason), False
        if pull is not None and pull.kind is image_pull.PullError.TRANSIENT:
            waited = seen.now - (parse_time(image_pull.scheduled_at(pod)) or since)
            if waited < policy.image_pull_timeout:
                continue
            cause, recoverable = causes.IMAGE_TRANSIENTLY_UNAVAILABLE, True
            said = (
                f"pod {name} could not pull its image for {waited:.0f} s, longer than image_pull_timeout="
                f"{policy.image_pull_timeout:g} ({pull.what}: the registry may answer later, so a retry may help)"
            )
        elif pull is not None and pull.kind is image_pull.PullError.PERMANENT:
            said = f"pod {name} cannot pull its image ({reason}, {pull.what})"
        elif seen.now - since < policy.pending_grace_seconds:
            continue
        else:
            said = f"pod {name} stuck in {reason} for more than {policy.pending_grace_seconds:.0f} s"
        detail = f"{said}: {message}".rstrip(": ") + (f"; the last pull failed: {last}" if last else "")
        return seen.decision(
            Phase.FAILED,
            f"failed ({reason})",
            verdict=Verdict(
                succeeded=False, recoverable=recoverable, node=name, cause=cause, reason=reason, detail=detail
            ),
        )
    return None


def out_of_patience(seen: Observed, policy: WaitPolicy, since: float, what: str, node: str | None) -> WaitDecision:
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
                cause=causes.UNSCHEDULABLE,
                detail=f"waited {waited:.0f} s for capacity, longer than scheduling_timeout="
                f"{policy.scheduling_timeout:g}: {what}; capacity may free up, so a retry may help",
            ),
        )
    return seen.decision(Phase.PENDING, f"waiting for capacity: {what}")


def pods_not_created(seen: Observed, policy: WaitPolicy, error: str, controller: str) -> WaitDecision:
    """The decision for a job without pods whose controller says why it cannot create them (``error``, its newest
    ``FailedCreatePod`` Warning): a quota is waited for as capacity is (``scheduling_timeout``), a refusal that will
    not change fails at once, and anything else is waited for, with the controller's words in the progress line."""
    ref = seen.ref
    what = f"{controller} cannot create its pods: {error}"
    refusal = pod_creation.create_refusal(error)
    if refusal is pod_creation.CreateRefusal.QUOTA:
        return out_of_patience(seen, policy, seen.created, what, None)
    if refusal is pod_creation.CreateRefusal.PERMANENT:
        detail = (
            f"{ref.kind} {ref.namespace}/{ref.name}: {what}; fix the task's pod options, or the namespace's policy; "
            "a retry would meet the same refusal"
        )
        return seen.stopped("failed (its pods are refused)", causes.CONFIGURATION, detail)
    return seen.decision(Phase.PENDING, f"no pods: {what}")


def describe_wait(wait: CapacityWait) -> str:
    gated = " (held by a queue until admitted)" if wait.reason == "SchedulingGated" else ""
    return f"pod {wait.pod} is {wait.reason}{gated}: {wait.message}".rstrip(": ")


def with_pods(decision: WaitDecision, snapshot: Snapshot, pods: Sequence[Mapping[str, Any]]) -> WaitDecision:
    """A decision that ends the wait carries the pods and the creation time, for the job summary."""
    if not decision.phase.is_terminal or snapshot.job is None:
        return decision
    created = parse_time(snapshot.job.get("metadata", {}).get("creationTimestamp"))
    return replace(decision, pods=pod_summaries(pods), created=created)


def phase_of(verdict: Verdict) -> Phase:
    return Phase.SUCCEEDED if verdict.succeeded else Phase.FAILED


# --- pod logs ------------------------------------------------------------------------------------------------


#: How far a line's time may lie behind a line written before it in the same log. containerd stamps a container's
#: stdout and stderr lines in two goroutines and writes them in turn, so across the two streams the log's order and its
#: times disagree (a line stamped first can be written second), by far less than this.
LOG_SKEW_SECONDS: Final = 1
#: Lines a cursor remembers (the last ones printed within ``LOG_SKEW_SECONDS`` of its latest time, in the log's
#: order), each as its time and its text's hash: a triggerer holds a cursor for every deferred task, and a line may be
#: 64 KiB. What it forgets comes before what it remembers in a later read, and is skipped there all the same.
LOG_RECENT_LINES: Final = 500


@dataclass(frozen=True, kw_only=True)
class LogCursor:
    """How far a pod's log was printed: its latest time, and the last lines printed within :data:`LOG_SKEW_SECONDS`
    of it (``(time, hash of the line)``, in the log's order)."""

    last_time: str = ""
    recent: tuple[tuple[str, int], ...] = ()


def new_log_lines(cursor: LogCursor, text: str, *, cut: bool = False) -> tuple[list[str], LogCursor]:
    """Lines of a timestamped log read that were not printed yet, and the advanced cursor.

    Kubernetes starts a log read only at a whole second (``sinceTime``), so a read from the API begins with lines
    printed before: its overlap, in the log's order. A read from a followed stream has none. While the read may still
    bring one of the cursor's recent lines, a line is printed (and skipped) when it is one of them (each consumed
    once), lies more than :data:`LOG_SKEW_SECONDS` before the cursor's latest time, or comes before one of them (a
    printed line the cursor forgot: it remembers the last ones). The lines after the last recent one are new, whatever
    their times: across stdout and stderr a log's times are not in its order, so a line is never dropped for being
    older than the one before it. A read ``cut`` short (at ``limitBytes``) may end before a recent line would have
    come: the lines it leaves undecided are not printed (most likely the cursor forgot them), and not remembered.
    """
    fresh: list[str] = []
    remaining = Counter(cursor.recent)
    left = len(cursor.recent)  # recent lines the read has not brought yet
    undecided: list[tuple[str, tuple[str, int]]] = []  # new, unless a recent line comes after them
    printed = list(cursor.recent)
    floor = seconds_before(cursor.last_time, LOG_SKEW_SECONDS)
    stamp = cursor.last_time
    for raw in text.splitlines():
        stamp, line = split_stamp(raw, stamp)
        line = cut_log_line(line)
        key = (stamp, hash(line))
        if left and remaining[key] > 0:
            remaining[key] -= 1
            left -= 1
            undecided.clear()  # only a printed line comes before a printed one
        elif left and stamp >= floor:
            undecided.append((line, key))
        elif not left:
            fresh.append(line)
            printed.append(key)
    for line, key in [] if cut else undecided:
        fresh.append(line)
        printed.append(key)
    last_time = max((s for s, _ in printed), default=cursor.last_time)
    window = seconds_before(last_time, LOG_SKEW_SECONDS)
    # The last ones in the log's order: a later read brings what this forgets before what it remembers.
    recent = [entry for entry in printed if entry[0] >= window][-LOG_RECENT_LINES:]
    return fresh, LogCursor(last_time=last_time, recent=tuple(recent))


def seconds_before(stamp: str, seconds: int) -> str:
    """``stamp`` (as :func:`split_stamp` writes it, or in whole seconds as ``sinceTime`` takes it) ``seconds``
    earlier, in the same form; ``""`` for no time."""
    base, dot, fraction = stamp.partition(".")
    try:
        moment = datetime.datetime.fromisoformat(base[:19]) - datetime.timedelta(seconds=seconds)
    except ValueError:
        return ""
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + (dot + fraction if dot else "Z")


def split_stamp(raw: str, previous: str) -> tuple[str, str]:
    """``"2026-11-29T17:40:19.1234Z line"`` -> (a sortable stamp, the line).

    The API writes RFC 3339 with nanoseconds *without trailing zeros*, so the fractions are padded before any
    comparison: ``.1234Z`` would otherwise sort after ``.12345Z``. A stamp is at least a whole second
    (``YYYY-MM-DDTHH:MM:SSZ``); :func:`~.worker_wait.last_stamp` reads a log's last one here too.
    """
    stamp, _, line = raw.partition(" ")
    if not (len(stamp) >= 20 and stamp[:4].isdigit() and stamp.endswith("Z")):
        return previous, raw  # a line without a timestamp keeps its place after the previous one
    base, _, fraction = stamp[:-1].partition(".")
    return f"{base}.{fraction.ljust(9, '0')[:9]}Z", line
