"""The wait's types: which job (:class:`JobRef`), how to wait (:class:`WaitPolicy`), what the API server said
(:class:`Snapshot`) and what the wait decided (:class:`WaitDecision`, :class:`Phase`).

Shared by every kind's decision (:mod:`.status` and :mod:`.kinds`), the wait core (:mod:`.wait`), its drivers and
the trigger's events. No I/O, no Airflow, no kubernetes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Final

from airflow_provider_torchelastic.core import choices
from airflow_provider_torchelastic.core.outcome import Verdict, verdict_from_json
from airflow_provider_torchelastic.core.summary import PodSummary
from airflow_provider_torchelastic.core.validation import as_list, finite_float, short_repr, text_or

__all__ = [
    "FINISH_ACTIONS",
    "JobRef",
    "Phase",
    "Snapshot",
    "WaitDecision",
    "WaitPolicy",
]

#: What happens to the job once it ended: delete it, keep it, or delete it only when it succeeded (the default:
#: a failed job's pods and events stay for debugging; the PyTorchJob's ttl / cleanPodPolicy still apply).
FINISH_ACTIONS: Final = choices.FINISH_ACTIONS


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
    #: Seconds a scheduled pod may keep failing to pull its image for reasons that may pass (429, 5xx, a timeout, a
    #: reset) before the task fails as recoverable; a pull the registry refuses for good fails at once.
    image_pull_timeout: float = 600.0
    #: Stream the training container's log of at most this many pods into the task log (0: none).
    log_pods: int = 8
    #: Seconds between progress lines while nothing changes.
    progress_interval: float = 60.0
    #: Unix time by which the task must end (its ``execution_timeout``): the wait deletes the job then and fails.
    #: Airflow does not enforce ``execution_timeout`` while a task is deferred, so the wait does, on both paths.
    deadline: float | None = None
    #: What the wait does with the job once it ended: one of :data:`FINISH_ACTIONS`.
    finish_action: str = choices.OnFinishAction.DELETE_SUCCEEDED.value
    #: Seconds a job may wait for capacity (pods Unschedulable before the job can start, a suspended or queued job)
    #: before the task fails as recoverable; None: as long as the deadline allows.
    scheduling_timeout: float | None = None
    #: The job's lease (``[torch_elastic] job_lease``) for a try without a deadline: the wait renews it while it
    #: waits (:mod:`~.sweep`). None: nothing to renew (the try has a deadline, which the job carries instead).
    lease_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.finish_action not in FINISH_ACTIONS:
            raise ValueError(
                f"on_finish_action: expected one of {', '.join(map(repr, FINISH_ACTIONS))}, got {self.finish_action!r}"
            )

    def keeps(self, decision: WaitDecision) -> bool:
        """Whether the ended job stays (for debugging) rather than being deleted."""
        succeeded = decision.phase is Phase.SUCCEEDED
        action, choice = self.finish_action, choices.OnFinishAction
        return action == choice.KEEP or (action == choice.DELETE_SUCCEEDED and not succeeded)


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
    #: ``{image: the kubelet's newest "Failed to pull image" event}`` for the images pods wait for in
    #: ``ImagePullBackOff``, whose own message does not say why (:func:`~.core.image_pull.backed_off_images`).
    pull_errors: Mapping[str, str] | None = None
    #: Why the job's controller could not create a pod (its newest ``FailedCreatePod`` Warning), read while a job
    #: whose controller makes its pods has none past ``pending_grace_seconds`` (:mod:`~.core.pod_creation`).
    create_error: str | None = None


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
        """What :meth:`to_event` gave. ``ValueError``, and nothing else, without a phase or with a verdict of the
        wrong shape; the rest (pods, metrics: the job summary's) of the wrong type is read as absent."""
        # A str first: Phase() of anything else puts its repr in the message, which fails for a deep structure.
        if not isinstance(event, Mapping) or not isinstance(event.get("phase"), str):
            raise ValueError(f"a wait's event: expected an object with a phase, got {short_repr(event)}")
        metrics = event.get("metrics")
        return cls(
            phase=Phase(event["phase"]),
            progress=text_or(event.get("progress"), ""),
            state=text_or(event.get("state"), None),  # absent from events written before it existed
            verdict=verdict_from_json(event.get("verdict")),
            pods=tuple(PodSummary.from_dict(pod) for pod in as_list(event.get("pods")) if isinstance(pod, Mapping)),
            created=finite_float(event.get("created")),
            metrics=metrics if isinstance(metrics, Mapping) else None,
        )


def _verdict_to_dict(verdict: Verdict | None) -> dict[str, Any] | None:
    return None if verdict is None else asdict(verdict)
