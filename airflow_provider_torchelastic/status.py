"""The one state machine that waits for a job: pure decisions over what the API server says.

The worker (``deferrable=False``) and the trigger (``deferrable=True``) both drive :func:`watch_job`, a generator
that asks for I/O (fetch the job and its pods, read a pod's log, sleep, log a line) and decides from the answers.
They differ only in how they carry out the requests (sync ``kubernetes`` client or async ``kubernetes_asyncio``),
never in what they decide. Objects are the API's own JSON (camelCase dicts). No I/O, no Airflow, no kubernetes.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Final, TypeAlias

from airflow_provider_torchelastic.outcome import NodeReport, Verdict, WorkerFailure, decide_run, decode_outcome

__all__ = [
    "FetchJob",
    "JobRef",
    "Phase",
    "ReadLog",
    "Snapshot",
    "Sleep",
    "WaitDecision",
    "WaitPolicy",
    "decide",
    "watch_job",
]

TRAINING_CONTAINER: Final = "pytorch"

#: Container waiting reasons that will not resolve by themselves: fail fast instead of waiting for a timeout.
STUCK_WAITING_REASONS: Final = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
)
#: Of those, the ones where a retry could help (capacity may free up); a wrong image or config will not.
_RETRYABLE_STUCK_REASONS: Final = frozenset({"Unschedulable"})


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
    """Which object to wait for. ``kind`` is ``PyTorchJob`` or ``Pod``."""

    kind: str
    name: str
    namespace: str

    @property
    def label_selector(self) -> str:
        # The training operator labels its pods with the job name; our single Pod is its own only pod.
        if self.kind == "PyTorchJob":
            return f"training.kubeflow.org/job-name={self.name}"
        return ""


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


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The API server's answer: the job (``None`` once it is gone) and its pods."""

    job: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]] = ()
    #: Unix time of the observation (a parameter, so that decisions are testable with a fake clock).
    now: float = 0.0


@dataclass(frozen=True, kw_only=True)
class WaitDecision:
    phase: Phase
    #: One line for the task log: job phase, pods ready/total, elapsed time.
    progress: str
    verdict: Verdict | None = None

    def to_event(self) -> dict[str, Any]:
        """JSON-safe form for a trigger event (the trigger and ``execute_complete`` share this one format)."""
        return {"phase": self.phase.value, "progress": self.progress, "verdict": _verdict_to_dict(self.verdict)}

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> WaitDecision:
        return cls(
            phase=Phase(event["phase"]),
            progress=str(event.get("progress", "")),
            verdict=_verdict_from_dict(event.get("verdict")),
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


def _training_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    for status in statuses:
        if status.get("name") == TRAINING_CONTAINER:
            return status
    return statuses[0] if statuses else {}


def pod_report(pod: Mapping[str, Any]) -> NodeReport | None:
    """What an ended pod says: the training container's exit code, reason and outcome document."""
    status = pod.get("status", {})
    container = _training_status(pod)
    terminated = container.get("state", {}).get("terminated") or container.get("lastState", {}).get("terminated")
    name = pod.get("metadata", {}).get("name", "?")
    if terminated:
        return NodeReport(
            name=name,
            exit_code=terminated.get("exitCode"),
            outcome=decode_outcome(terminated.get("message")),
            reason=terminated.get("reason", "") if terminated.get("reason") not in ("Error", "Completed") else "",
        )
    if status.get("phase") == "Failed":
        # Evicted or lost before the container ran to an exit code.
        return NodeReport(name=name, exit_code=None, outcome=None, reason=status.get("reason", "") or "Failed")
    return None


def _stuck_reason(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) if the pod waits on something that will not fix itself."""
    status = pod.get("status", {})
    if status.get("phase") not in (None, "Pending"):
        return None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return "Unschedulable", condition.get("message", "")
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = container.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING_REASONS:
            return waiting["reason"], waiting.get("message", "")
    return None


def _condition(job: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition
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


# --- the decision ------------------------------------------------------------------------------------------------


def decide(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    """Where the job stands, and once it ended, its verdict (rank 0's result or the root cause)."""
    job = snapshot.job
    if job is None:
        return WaitDecision(
            phase=Phase.FAILED,
            progress=f"{ref.kind} {ref.namespace}/{ref.name} is gone",
            verdict=Verdict(
                succeeded=False,
                recoverable=True,
                detail=f"{ref.kind} {ref.namespace}/{ref.name} was deleted before it finished (outside Airflow?)",
            ),
        )
    pods = [job] if ref.kind == "Pod" else list(snapshot.pods)
    created = parse_time(job.get("metadata", {}).get("creationTimestamp")) or snapshot.now
    elapsed = _format_elapsed(snapshot.now - created)
    total = 1 if ref.kind == "Pod" else _total_replicas(job)
    running = sum(1 for pod in pods if pod.get("status", {}).get("phase") == "Running")

    def progress(state: str) -> str:
        return f"{ref.kind} {ref.name}: {state}; pods running {running}/{total}{_ELAPSED}{elapsed}"

    reports = [report for pod in pods if (report := pod_report(pod)) is not None]

    # 1. Stuck pods fail fast, with Kubernetes' own words.
    for pod in pods:
        stuck = _stuck_reason(pod)
        if stuck is None:
            continue
        since = parse_time(pod.get("metadata", {}).get("creationTimestamp")) or created
        if snapshot.now - since >= policy.pending_grace_seconds:
            reason, message = stuck
            name = pod.get("metadata", {}).get("name", "?")
            return WaitDecision(
                phase=Phase.FAILED,
                progress=progress(f"failed ({reason})"),
                verdict=Verdict(
                    succeeded=False,
                    recoverable=reason in _RETRYABLE_STUCK_REASONS,
                    node=name,
                    detail=f"pod {name} stuck in {reason} for more than {policy.pending_grace_seconds:.0f} s: "
                    f"{message}".rstrip(": "),
                ),
            )

    if ref.kind == "Pod":
        phase = job.get("status", {}).get("phase", "Pending")
        if phase in ("Succeeded", "Failed"):
            verdict = decide_run(reports) if reports else Verdict(succeeded=False, detail=f"pod ended {phase}")
            return WaitDecision(phase=_phase_of(verdict), progress=progress(phase), verdict=verdict)
        return WaitDecision(phase=Phase.RUNNING if phase == "Running" else Phase.PENDING, progress=progress(phase))

    failed = _condition(job, "Failed")
    if failed is not None:
        verdict = decide_run(reports)
        if verdict.failure is None:
            # No worker reported an exception: the job's own condition says why (deadline, backoff limit), and
            # pods stopped because of it (exit 143) are consequences, not causes.
            by_condition = _failed_condition_verdict(job, failed)
            if verdict.succeeded or not verdict.node or by_condition.detail.startswith(_DEADLINE_PREFIX):
                verdict = by_condition
        return WaitDecision(phase=Phase.FAILED, progress=progress("Failed"), verdict=verdict)

    if _condition(job, "Succeeded") is not None:
        # An elastic PyTorchJob is Succeeded as soon as *one* worker succeeds; rank 0 may be on another pod that
        # is still at its exit barrier. Wait for the pod that reports rank 0's result.
        holders = [r for r in reports if r.outcome is not None and r.outcome.holds_rank0]
        ended = len(reports) >= len(pods)
        if holders or ended:
            verdict = decide_run(reports)
            return WaitDecision(phase=_phase_of(verdict), progress=progress("Succeeded"), verdict=verdict)
        return WaitDecision(phase=Phase.RUNNING, progress=progress("Succeeded, waiting for rank 0's pod"))

    for state in ("Restarting", "Running", "Suspended"):
        if _condition(job, state) is not None:
            return WaitDecision(phase=Phase.RUNNING if running else Phase.PENDING, progress=progress(state))
    return WaitDecision(phase=Phase.PENDING, progress=progress("Created" if _condition(job, "Created") else "Pending"))


def _phase_of(verdict: Verdict) -> Phase:
    return Phase.SUCCEEDED if verdict.succeeded else Phase.FAILED


_DEADLINE_PREFIX: Final = "the job ran longer than run_policy.active_deadline_seconds"


def _failed_condition_verdict(job: Mapping[str, Any], condition: Mapping[str, Any]) -> Verdict:
    message = condition.get("message", "") or condition.get("reason", "")
    deadline = job.get("spec", {}).get("runPolicy", {}).get("activeDeadlineSeconds")
    if deadline is not None and "deadline" in message.lower():
        return Verdict(
            succeeded=False,
            detail=f"{_DEADLINE_PREFIX}={deadline} and was stopped ({message})",
        )
    return Verdict(succeeded=False, recoverable=False, detail=f"the PyTorchJob failed: {message}")


# --- the protocol that the sync and async drivers carry out ---------------------------------------------------


@dataclass(frozen=True)
class FetchJob:
    """Get the job (None if 404) and its pods; answer with a :class:`Snapshot`."""

    ref: JobRef


@dataclass(frozen=True)
class ReadLog:
    """Read the training container's log of ``pod`` with timestamps, from ``since_seconds`` ago (None: all)."""

    pod: str
    namespace: str
    since_seconds: int | None


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class EmitLog:
    line: str


Request: TypeAlias = FetchJob | ReadLog | Sleep | EmitLog


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


@dataclass(kw_only=True)
class _WatchState:
    #: The progress line without its elapsed time: a change of phase or of running pods is logged at once.
    last_state: str = ""
    last_logged: float = 0.0
    cursors: dict[str, LogCursor] = field(default_factory=dict)


def watch_job(ref: JobRef, policy: WaitPolicy) -> Generator[Request, Any, WaitDecision]:
    """Poll until the job ends; yields I/O requests, returns the final decision.

    ``FetchJob`` is answered with a :class:`Snapshot`, ``ReadLog`` with the log text (``""`` when unavailable),
    ``Sleep`` and ``EmitLog`` with ``None``.
    """
    state = _WatchState()
    while True:
        snapshot = yield FetchJob(ref)
        decision = decide(ref, snapshot, policy)
        current = decision.progress.split(_ELAPSED)[0]
        if current != state.last_state or snapshot.now - state.last_logged >= policy.progress_interval:
            # On change, and as a heartbeat every progress_interval: a long quiet job still shows it is alive.
            yield EmitLog(decision.progress)
            state.last_state, state.last_logged = current, snapshot.now
        yield from _stream_logs(ref, snapshot, policy, state)
        if decision.phase.is_terminal:
            return decision
        yield Sleep(policy.poll_interval)


def _stream_logs(
    ref: JobRef, snapshot: Snapshot, policy: WaitPolicy, state: _WatchState
) -> Generator[Request, Any, None]:
    pods = [snapshot.job] if ref.kind == "Pod" and snapshot.job is not None else list(snapshot.pods)
    started = [p for p in pods if p.get("status", {}).get("phase") in ("Running", "Succeeded", "Failed")]
    for pod in sorted(started, key=lambda p: p.get("metadata", {}).get("name", ""))[: policy.log_pods]:
        name = pod["metadata"]["name"]
        cursor = state.cursors.get(name, LogCursor())
        since = None if not cursor.last_seen else max(1, int(snapshot.now - cursor.last_seen) + 2)
        text = yield ReadLog(pod=name, namespace=ref.namespace, since_seconds=since)
        lines, state.cursors[name] = new_log_lines(cursor, text or "")
        for line in lines:
            yield EmitLog(f"[{name}] {line}")
