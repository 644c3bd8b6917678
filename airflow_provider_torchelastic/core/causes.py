"""Why a training run failed, as one word Airflow can act on: decided where the evidence is, once.

A verdict (:class:`~airflow_provider_torchelastic.core.outcome.Verdict`) carries one of these in ``cause``; the
Airflow side raises the exception class of that cause (``operators.exceptions``), which ``retry_policy`` rules match.
Pure and standard library only: the runner, the wait's state machine and the operator share it.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CAUSES",
    "CONFIGURATION",
    "DEADLINE",
    "IMAGE_TRANSIENTLY_UNAVAILABLE",
    "IMAGE_UNAVAILABLE",
    "INFRASTRUCTURE",
    "NODE_LOST",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "STALLED",
    "UNKNOWN",
    "UNSCHEDULABLE",
    "USER_CODE",
    "cause_of_reason",
    "cause_of_stuck_reason",
]

#: A container or worker ran out of memory (the kernel's OOM killer, a container's ``OOMKilled``).
OUT_OF_MEMORY: Final = "out_of_memory"
#: The pod was evicted or preempted (node drain, Kueue or scheduler preemption, a reclaimed spot node).
PREEMPTED: Final = "preempted"
#: The job waited for capacity longer than ``scheduling_timeout``.
UNSCHEDULABLE: Final = "unschedulable"
#: The node that ran a pod went away.
NODE_LOST: Final = "node_lost"
#: The image cannot be pulled: the registry says it does not exist or refuses the credentials, or its name is invalid.
IMAGE_UNAVAILABLE: Final = "image_unavailable"
#: The image could not be pulled within ``image_pull_timeout`` because the registry throttled (429), failed (5xx),
#: timed out or reset the connection: it may answer later.
IMAGE_TRANSIENTLY_UNAVAILABLE: Final = "image_transiently_unavailable"
#: The job as configured cannot run: a missing Secret or ConfigMap, an invalid pod, a refusal by the API server or a
#: webhook, an unusable payload or runner setting, a result too large for where it has to go.
CONFIGURATION: Final = "configuration"
#: A rank made no progress within ``stall_timeout`` (stuck, deadlocked, waiting for a peer that is gone), or a
#: collective timed out waiting for one: the runner stopped the workers, and a retry resumes from the checkpoint.
STALLED: Final = "stalled"
#: The job ran longer than ``run_policy.active_deadline_seconds``.
DEADLINE: Final = "deadline_exceeded"
#: The training code raised (the user's own exception, ``RecoverableError`` included).
USER_CODE: Final = "user_code"
#: The platform failed: the API server unreachable, the job deleted by someone else, a store that could not be read.
INFRASTRUCTURE: Final = "infrastructure"
#: Nothing says why (a node exited non-zero without a report): the recoverable flag alone decides.
UNKNOWN: Final = ""

CAUSES: Final = (
    OUT_OF_MEMORY,
    PREEMPTED,
    UNSCHEDULABLE,
    NODE_LOST,
    IMAGE_UNAVAILABLE,
    IMAGE_TRANSIENTLY_UNAVAILABLE,
    CONFIGURATION,
    DEADLINE,
    STALLED,
    USER_CODE,
    INFRASTRUCTURE,
    UNKNOWN,
)

#: Why Kubernetes ended a pod or container (its ``reason``), as a cause. ``DisruptionTarget`` is the pod condition
#: 1.26+ writes before a preemption or eviction; ``Shutdown``/``Terminated`` are a graceful node shutdown's.
_REASONS: Final = {
    "OOMKilled": OUT_OF_MEMORY,
    "Evicted": PREEMPTED,
    "Preempted": PREEMPTED,
    "PreemptionByScheduler": PREEMPTED,
    "PreemptionByKubeScheduler": PREEMPTED,
    "DisruptionTarget": PREEMPTED,
    # The other reasons of a DisruptionTarget condition: a drain's eviction, the kubelet's (node pressure, a
    # graceful node shutdown), and the taint manager's (a NoExecute taint: the node is going away).
    "EvictionByEvictionAPI": PREEMPTED,
    "TerminationByKubelet": PREEMPTED,
    "DeletionByTaintManager": NODE_LOST,
    "Shutdown": PREEMPTED,
    "Terminated": PREEMPTED,
    "NodeLost": NODE_LOST,
    "NodeShutdown": NODE_LOST,
    "DeletionByPodGC": NODE_LOST,
    # The runtime could not start the container's command (not in the image, or not runnable there).
    "StartError": CONFIGURATION,
    "ContainerCannotRun": CONFIGURATION,
}

#: Container waiting reasons that never resolve by themselves, as a cause.
_STUCK: Final = {
    "ImagePullBackOff": IMAGE_UNAVAILABLE,
    "ErrImagePull": IMAGE_UNAVAILABLE,
    "InvalidImageName": IMAGE_UNAVAILABLE,
    "ErrImageNeverPull": IMAGE_UNAVAILABLE,
    "CreateContainerConfigError": CONFIGURATION,
    "CreateContainerError": CONFIGURATION,
}


def cause_of_reason(reason: str) -> str:
    """The cause a pod's or container's ending ``reason`` names; :data:`UNKNOWN` for one that names none."""
    return _REASONS.get(reason, UNKNOWN)


def cause_of_stuck_reason(reason: str) -> str:
    """The cause of a container stuck waiting with ``reason``; :data:`CONFIGURATION` for any other such reason."""
    return _STUCK.get(reason, CONFIGURATION)
