"""Errors and exit codes, shared by the runner (in pods, without Airflow) and the Airflow side.

One word for "a retry may help": **recoverable**. Every exception the package defines, with the module it lives in
(``here`` is this one) and what it means::

    Exception
    ├── RecoverableError                (here) raised by training code: a retry of the task may help
    │   └── StopRequested               (integrations.common) a framework integration saved and stopped a try
    │                                   that was asked to stop (preempted, drained, killed): the next one resumes
    ├── KubeError                       (here) a Kubernetes API call failed; .status, .reason, .recoverable
    │                                   (429, 5xx, a lost connection: repeating the call may succeed) and
    │                                   .retry_after (when the server said how long to wait first)
    ├── StreamUnavailable               (kubernetes.watch) the shared watch may not list or watch (401/403); its
    │                                   triggers poll the API on their own instead
    ├── WatchNotStarted                 (kubernetes.worker_wait) the worker's watch could not start: it polls
    │                                   instead (never leaves the wait)
    ├── PreflightError                  (preflight) the preflight could not start: the connection is unusable
    ├── WorkerExit                      (runner.worker) a worker's sys.exit() with a failing code, raised in its
    │                                   place so that torch records it; named SystemExit in reports
    ├── ValueError
    │   ├── PayloadError                (core.payload) the payload is corrupt, of another format, or of another Python
    │   ├── ResultTooLargeError         (core.outcome) rank 0's value does not fit where it has to travel
    │   ├── RunnerUsageError            (runner) the runner's arguments or environment are unusable: it exits
    │   │   │                           EXIT_USAGE and publishes the error where the outcome would have gone
    │   │   └── TorchIncompatibleError  (runner.torch_compat) the image's torch lacks a piece of torch elastic the
    │   │                               runner uses (named, with the versions it is tested with)
    │   ├── ArtifactRefError            (core.artifact_ref) an artifact reference that is malformed, or not under
    │   │                               this try's location
    │   ├── ArtifactIntegrityError      (worker.artifact_streams) an artifact's bytes are not those its reference names
    │   │                               (sha256, size), or its local file is a link or not a regular file: refused
    │   │                               before anything is read from them
    │   └── CheckpointMetadataError     (worker.dcp_safe) a sharded checkpoint's DCP metadata names something DCP
    │                                   never writes there: not loaded (raised inside DCP's CheckpointException)
    ├── PermissionError
    │   └── ArtifactPickleRefusedError  (worker.artifacts) a pickled module, to be loaded where pickles are not
    │                                   allowed (artifacts.load(..., allow_pickle=True) trusts it)
    ├── FileNotFoundError
    │   └── ScriptNotFoundError         (worker.program) script= names no file where the workers run
    ├── ImportError
    │   └── ModuleNotFoundError
    │       └── ModuleNotInstalledError (worker.program) module= names no module installed where the workers run
    ├── TypeError
    │   └── ResultNotSerializableError  (core.encoding; the runner re-exports it) rank 0 returned a value that
    │                                   cannot travel as JSON; the message names its type and where it sits
    ├── RuntimeError
    │   ├── NoRunContextError           (core.run_context) context.current() outside the workers of a torch_elastic
    │   │                               task, or a run context that cannot be read
    │   ├── NoCheckpointLocationError   (worker.checkpoint) no checkpoint location: neither uri= nor one in the
    │   │                               run context
    │   └── KubernetesUnavailable       (plugin.service) the UI could not read a live job from Kubernetes (HTTP 503)
    └── AirflowException                (Airflow) what a task ends with: one class per cause (README's table)
        └── TrainingError               (operators) training or waiting failed; .cause, .pod, .rank, .exit_code,
            │                           .reason (operators.exceptions says how retry_policy meets them)
            ├── TrainingRecoverableError    (operators) a retry may help: retried within ``retries``
            │   ├── OutOfMemoryError        (operators) a container or worker ran out of memory (OOMKilled)
            │   ├── PreemptedError          (operators) a pod was evicted or preempted
            │   ├── CapacityTimeoutError    (operators) no capacity within scheduling_timeout
            │   ├── NodeLostError           (operators) the node running a pod went away
            │   ├── InfrastructureError     (operators) the API unreachable, the job deleted by someone else
            │   ├── StalledError            (operators) a rank made no progress within stall_timeout
            │   └── ImageTransientlyUnavailableError (operators) the registry throttled, failed or reset pulls
            │                               for longer than image_pull_timeout
            ├── TrainingFailedError         (operators) a retry will not help: without a retry_policy, raised with
            │   │                           AirflowFailException, so the task fails without its retries
            │   ├── ImageUnavailableError   (operators) the image cannot be pulled
            │   ├── ConfigurationError      (operators) a missing Secret/ConfigMap, an invalid pod, a refusal
            │   └── DeadlineExceededError   (operators) ran past run_policy.active_deadline_seconds
            └── UserCodeError               (operators) the training code raised; .exception_type,
                │                           .exception_module, .exception_bases, .traceback_tail
                ├── UserCodeRecoverableError (operators) it raised RecoverableError; also a TrainingRecoverableError
                └── UserCodeFailedError     (operators) any other exception; also a TrainingFailedError

At run time the worker turns every failure into the class of its cause, naming the pod, the rank and the exception.
Standard library only: the runner imports this module in images that have neither Airflow nor kubernetes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_RECOVERABLE", "EXIT_USAGE", "KubeError", "RecoverableError"]

#: Training finished; rank 0's result (if this node held it) is in the result file.
EXIT_OK: Final = 0
#: A worker failed in a way a retry will not fix (a bug, bad data). PyTorchJob ``ExitCode`` treats 1-127 as permanent.
EXIT_FAILED: Final = 1
#: The runner could not start: bad arguments, an unreadable payload or a Python version mismatch. Also permanent.
EXIT_USAGE: Final = 2
#: A worker raised :class:`RecoverableError`: retrying may succeed. >= 128 so that the PyTorchJob ``ExitCode``
#: restart policy restarts the pod; chosen above 128 + any signal number so it is never mistaken for a signal death.
EXIT_RECOVERABLE: Final = 200
# The runner itself was sent a signal (pod deleted, node drained): it exits 128 + the signal number, like a shell,
# and writes no failure report, because it is not the root cause.

#: API answers worth repeating the call for: throttled, server trouble, gateway trouble.
RECOVERABLE_STATUSES: Final = frozenset({429, 500, 502, 503, 504})


class RecoverableError(Exception):
    """Raise this (or a subclass) from a training function for a failure that a retry may fix.

    Examples: a flaky data source, a lost peer, a preempted spot node. Airflow retries the task (within its
    ``retries``); any other exception fails the task at once.
    """


class KubeError(Exception):
    """A Kubernetes API call failed. ``status`` is the HTTP status (0 when the connection itself failed).

    Raised at one boundary (:mod:`airflow_provider_torchelastic.kubernetes.client`), chained ``from`` the client's
    exception; callers test ``status``/``reason``, never the message text.
    """

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        #: The Kubernetes Status document's ``details`` (the group, kind and name it is about), when it had one.
        self.details: Mapping[str, Any] | None = details
        #: Seconds the server asked the client to wait before trying again (its ``Retry-After`` header: API Priority
        #: and Fairness sends one with a 429, an overloaded server or a proxy with a 503); None when it did not say.
        self.retry_after = retry_after

    @property
    def denied_by_admission(self) -> bool:
        """A 403 from an admission webhook (the object was refused), not from RBAC (the identity may not do this).

        Both say ``403 Forbidden``. The API server's RBAC refusal always names what was forbidden in the Status's
        ``details`` (group and kind); a webhook's denial carries the webhook's own Status, which controller-runtime's
        ``admission.Denied`` (the Kubeflow training operator's webhook) writes without details.
        """
        return self.status == 403 and not (self.details or {}).get("kind")

    @property
    def recoverable(self) -> bool:
        """Repeating the call may succeed (throttling, server trouble, a lost connection)."""
        return self.status == 0 or self.status in RECOVERABLE_STATUSES

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409
