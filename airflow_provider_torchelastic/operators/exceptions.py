"""What a task ends with when training fails: one class per cause, under one base, for ``retry_policy`` rules.

The tree, with what each class means, is drawn in :mod:`airflow_provider_torchelastic.errors`; their public path
is :mod:`airflow_provider_torchelastic.operators`, and the README's table says what a retry changes for each.

**Retries.** A task without a ``retry_policy`` behaves as it always did: a :class:`TrainingFailedError` is raised
together with ``AirflowFailException`` (Airflow then fails the task without its retries), a
:class:`TrainingRecoverableError` is retried within ``retries``. A task with a ``retry_policy`` gets the plain class
for every cause, permanent ones included, so that its rules decide (Airflow never asks a policy about an
``AirflowFailException``); a cause no rule matches falls to the policy's default. The switch happens at one place,
:func:`for_retry_policy`, when the exception leaves the operator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.encoding import as_authored
from airflow_provider_torchelastic.core.public import OPERATORS_MODULE, publish

if TYPE_CHECKING:
    from airflow_provider_torchelastic.core.outcome import Verdict

#: The lines of a worker's traceback an exception keeps (the end, where the error is).
TRACEBACK_TAIL_LINES = 30


class TrainingError(AirflowException):
    """Training (or waiting for it) failed. Every attribute is None or empty where it is not known.

    - ``cause``: one word (:mod:`airflow_provider_torchelastic.core.causes`), the same for the class and its instances;
    - ``pod``: the pod (or local node) of the root cause; ``rank``: the failing worker's global rank;
    - ``exit_code``, ``reason``: its container's (or runner's) exit code and ending reason (``OOMKilled``);
    - ``exception_type``, ``exception_module``, ``exception_bases``: for the training code's own exception, its class
      name, its class's module, and the qualified names of its class and bases; ``traceback_tail``: its traceback's
      last lines.
    """

    cause: ClassVar[str] = causes.UNKNOWN
    #: Whether a retry may help, by default (no ``retry_policy``).
    recoverable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        pod: str | None = None,
        rank: int | None = None,
        exit_code: int | None = None,
        reason: str = "",
        exception_type: str = "",
        exception_module: str = "",
        exception_bases: Sequence[str] = (),
        traceback_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.pod = pod
        self.rank = rank
        self.exit_code = exit_code
        self.reason = reason
        self.exception_type = exception_type
        self.exception_module = exception_module
        self.exception_bases = tuple(exception_bases)
        self.traceback_tail = traceback_tail

    def __reduce__(self) -> Any:
        # Pickled by its public class (a fail-at-once twin has no importable name of its own) and its fields.
        return (_restore, (_public_class(type(self)).__name__, _fails_at_once(self), self.args, dict(self.__dict__)))


class TrainingRecoverableError(TrainingError):
    """Training (or waiting for it) failed in a way a retry may fix: Airflow retries (within ``retries``)."""

    recoverable = True


class TrainingFailedError(TrainingError):
    """Training failed in a way a retry will not fix: without a ``retry_policy``, the task fails without its
    retries."""


class OutOfMemoryError(TrainingRecoverableError):
    """A container or worker ran out of memory (its container ended ``OOMKilled``): raise the memory limit, or
    retry where more is free."""

    cause = causes.OUT_OF_MEMORY


class PreemptedError(TrainingRecoverableError):
    """A pod was evicted or preempted (node drain, Kueue or scheduler preemption, a reclaimed spot node)."""

    cause = causes.PREEMPTED


class CapacityTimeoutError(TrainingRecoverableError):
    """The job waited for capacity (unschedulable, or held by a queue) longer than ``scheduling_timeout``."""

    cause = causes.UNSCHEDULABLE


class NodeLostError(TrainingRecoverableError):
    """The node that ran a pod went away."""

    cause = causes.NODE_LOST


class InfrastructureError(TrainingRecoverableError):
    """The platform failed, not the training: the API server unreachable, the job deleted by someone else, result
    storage unreadable."""

    cause = causes.INFRASTRUCTURE


class StalledError(TrainingRecoverableError):
    """A rank made no progress within ``stall_timeout`` (or a collective timed out waiting for one): the runner took
    every rank's stacks and stopped the workers; the message names the silent ranks and where they were."""

    cause = causes.STALLED


class ImageTransientlyUnavailableError(TrainingRecoverableError):
    """The image could not be pulled within ``image_pull_timeout``: the registry throttled (429), failed (5xx), timed
    out or reset the connection, and may answer later."""

    cause = causes.IMAGE_TRANSIENTLY_UNAVAILABLE


class ImageUnavailableError(TrainingFailedError):
    """The image cannot be pulled: the registry says it does not exist (a wrong name or tag) or refuses the
    credentials, or its name is invalid."""

    cause = causes.IMAGE_UNAVAILABLE


class ConfigurationError(TrainingFailedError):
    """The job as configured cannot run: a missing Secret or ConfigMap, an invalid pod, a refusal by the API server or
    a webhook, a payload or result the runner cannot use."""

    cause = causes.CONFIGURATION


class DeadlineExceededError(TrainingFailedError):
    """The job ran longer than ``run_policy.active_deadline_seconds``."""

    cause = causes.DEADLINE


class UserCodeError(TrainingError):
    """The training code raised: ``exception_type`` (its class name), ``exception_module``, ``exception_bases`` and
    ``traceback_tail`` say what. Raised as :class:`UserCodeRecoverableError` or :class:`UserCodeFailedError`."""

    cause = causes.USER_CODE


class UserCodeRecoverableError(UserCodeError, TrainingRecoverableError):
    """The training code raised ``RecoverableError`` (or a subclass)."""


class UserCodeFailedError(UserCodeError, TrainingFailedError):
    """The training code raised an exception other than ``RecoverableError``."""


_BY_CAUSE: dict[str, type[TrainingError]] = {
    causes.OUT_OF_MEMORY: OutOfMemoryError,
    causes.PREEMPTED: PreemptedError,
    causes.UNSCHEDULABLE: CapacityTimeoutError,
    causes.NODE_LOST: NodeLostError,
    causes.INFRASTRUCTURE: InfrastructureError,
    causes.IMAGE_UNAVAILABLE: ImageUnavailableError,
    causes.IMAGE_TRANSIENTLY_UNAVAILABLE: ImageTransientlyUnavailableError,
    causes.CONFIGURATION: ConfigurationError,
    causes.DEADLINE: DeadlineExceededError,
    causes.STALLED: StalledError,
}

_ALL: tuple[type[TrainingError], ...] = (
    TrainingError,
    TrainingRecoverableError,
    TrainingFailedError,
    UserCodeError,
    UserCodeRecoverableError,
    UserCodeFailedError,
    *_BY_CAUSE.values(),
)
_PUBLIC: dict[str, type[TrainingError]] = {cls.__name__: cls for cls in _ALL}

# From the classes themselves, so that a new class is exported where it is added (operators/__init__.py spells out
# their public path).
__all__ = [*_PUBLIC, "error_for_verdict", "for_retry_policy"]


def class_for(cause: str, *, recoverable: bool) -> type[TrainingError]:
    """The exception class of a cause; the training code's and an unknown cause's follow ``recoverable``."""
    if cause == causes.USER_CODE:
        return UserCodeRecoverableError if recoverable else UserCodeFailedError
    return _BY_CAUSE.get(cause) or (TrainingRecoverableError if recoverable else TrainingFailedError)


def error_for_verdict(verdict: Verdict, message: str) -> TrainingError:
    """The exception of a failed verdict: the class of its cause, with what the verdict knows of where and why."""
    failure = verdict.failure
    cls = class_for(verdict.cause, recoverable=verdict.recoverable)
    user = issubclass(cls, UserCodeError) and failure is not None
    return cls(
        message,
        pod=verdict.node,
        rank=failure.rank if failure is not None and failure.rank >= 0 else None,
        exit_code=verdict.exit_code if verdict.exit_code is not None else (failure.exitcode if failure else None),
        reason=verdict.reason,
        exception_type=failure.exception if user and failure else "",
        exception_module=failure.module if user and failure else "",
        exception_bases=failure.bases if user and failure else (),
        traceback_tail=_tail(failure.traceback) if user and failure else "",
    )


def _tail(traceback: str) -> str:
    return "\n".join(as_authored(traceback).splitlines()[-TRACEBACK_TAIL_LINES:])


# --- without a retry_policy: permanent causes fail at once ------------------------------------------------------

_TWINS: dict[type[TrainingError], type[TrainingError]] = {}


def _fail_at_once_class(cls: type[TrainingError]) -> type[TrainingError]:
    """``cls`` together with ``AirflowFailException``, under the same name (logs and the UI print the class)."""
    twin = _TWINS.get(cls)
    if twin is None:
        twin = type(cls.__name__, (cls, AirflowFailException), {"__module__": cls.__module__})
        twin.__qualname__ = cls.__qualname__
        _TWINS[cls] = twin
    return twin


def _public_class(cls: type[TrainingError]) -> type[TrainingError]:
    return next((base for base in cls.__mro__ if _PUBLIC.get(base.__name__) is base), TrainingError)


def _fails_at_once(error: TrainingError) -> bool:
    return isinstance(error, AirflowFailException)


def _restore(name: str, fails_at_once: bool, args: tuple[Any, ...], fields: dict[str, Any]) -> TrainingError:
    public = _PUBLIC.get(name, TrainingError)
    cls = _fail_at_once_class(public) if fails_at_once else public
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(fields)
    return error


def for_retry_policy(
    error: TrainingError, retry_policy: object | None, *, try_number: int = 1, max_tries: int = 0
) -> TrainingError:
    """The exception to raise out of the operator: a permanent cause (a :class:`TrainingFailedError`) is raised as
    its class together with ``AirflowFailException``, so that Airflow fails the task without its retries, unless
    the task's ``retry_policy`` has a rule for it; then the plain class, so that the rule decides.

    Airflow sends what no rule matches to its standard retries (``RetryAction.DEFAULT``), which would retry a
    missing Secret ``retries`` times as soon as a task has any policy; the policy is therefore asked here first, as
    Airflow will ask it, and a permanent cause it has no rule for still fails at once.
    """
    if not isinstance(error, TrainingFailedError) or _fails_at_once(error):
        return error
    if retry_policy is not None and _has_rule_for(retry_policy, error, try_number, max_tries):
        return error
    twin = _restore(_public_class(type(error)).__name__, True, error.args, dict(error.__dict__))
    twin.__cause__, twin.__context__ = error.__cause__, error.__context__
    return twin.with_traceback(error.__traceback__)


def _has_rule_for(retry_policy: object, error: TrainingError, try_number: int, max_tries: int) -> bool:
    """Whether ``retry_policy`` decides something other than Airflow's standard retries for ``error``. A policy
    that fails to evaluate is one Airflow falls back from, to the standard retries: no rule then."""
    evaluate = getattr(retry_policy, "evaluate", None)
    if evaluate is None:
        return False
    try:
        decision = evaluate(exception=error, try_number=try_number, max_tries=max_tries, context=None)
    except Exception:
        return False
    action = getattr(getattr(decision, "action", None), "value", "default")
    return action != "default"


# Task logs and the UI print an exception by its classpath (tests and users match on it): the public one, not this
# module's, which is an implementation detail.
publish(*_PUBLIC.values(), module=OPERATORS_MODULE)
