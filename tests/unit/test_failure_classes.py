"""One class per cause (issue 31): the cause each verdict carries, the class each cause raises, what an instance
carries, and how a task's retry_policy meets them (a permanent cause fails at once only without one)."""

from __future__ import annotations

import logging
import pickle

import pytest
from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.outcome import NodeOutcome, NodeReport, Verdict, WorkerFailure, decide_run
from airflow_provider_torchelastic.operators import (
    CapacityTimeoutError,
    ConfigurationError,
    DeadlineExceededError,
    ImageTransientlyUnavailableError,
    ImageUnavailableError,
    InfrastructureError,
    NodeLostError,
    OutOfMemoryError,
    PreemptedError,
    StalledError,
    TrainingError,
    TrainingFailedError,
    TrainingRecoverableError,
    UserCodeError,
    UserCodeFailedError,
    UserCodeRecoverableError,
    UserExceptionRule,
)
from airflow_provider_torchelastic.operators.exceptions import class_for, error_for_verdict, for_retry_policy
from airflow_provider_torchelastic.operators.results import result_or_raise


def failure(exception: str = "ValueError", **fields: object) -> WorkerFailure:
    defaults: dict[str, object] = {"rank": 1, "message": "bad shard", "timestamp": 1.0}
    return WorkerFailure(exception=exception, **{**defaults, **fields})  # type: ignore[arg-type]


def reported(name: str, found: WorkerFailure, *, reason: str = "", exit_code: int = 1) -> NodeReport:
    return NodeReport(
        name=name, exit_code=exit_code, outcome=NodeOutcome(succeeded=False, failure=found), reason=reason
    )


@pytest.mark.parametrize(
    ("reports", "cause", "cls"),
    [
        ([reported("p0", failure())], causes.USER_CODE, UserCodeFailedError),
        ([reported("p0", failure("TransientError", recoverable=True))], causes.USER_CODE, UserCodeRecoverableError),
        # The kernel's OOM killer picked a worker: the runner saw a SIGKILL, the container says OOMKilled.
        (
            [reported("p0", failure("SignalSIGKILL", recoverable=True), reason="OOMKilled", exit_code=200)],
            causes.OUT_OF_MEMORY,
            OutOfMemoryError,
        ),
        ([reported("p0", failure("SignalSIGKILL", recoverable=True))], causes.INFRASTRUCTURE, InfrastructureError),
        ([reported("p0", failure("RunnerUsageError", rank=-1))], causes.CONFIGURATION, ConfigurationError),
        ([reported("p0", failure("ResultTooLargeError", rank=0))], causes.CONFIGURATION, ConfigurationError),
        (
            [NodeReport(name="p0", exit_code=137, outcome=None, reason="OOMKilled")],
            causes.OUT_OF_MEMORY,
            OutOfMemoryError,
        ),
        ([NodeReport(name="p0", exit_code=None, outcome=None, reason="Evicted")], causes.PREEMPTED, PreemptedError),
        ([NodeReport(name="p0", exit_code=None, outcome=None, reason="NodeLost")], causes.NODE_LOST, NodeLostError),
        ([NodeReport(name="p0", exit_code=143, outcome=None)], causes.INFRASTRUCTURE, InfrastructureError),
        ([NodeReport(name="p0", exit_code=1, outcome=None)], causes.UNKNOWN, TrainingFailedError),
    ],
)
def test_each_verdict_names_its_cause_and_class(reports: list[NodeReport], cause: str, cls: type) -> None:
    verdict = decide_run(reports)
    assert verdict.cause == cause, verdict
    assert class_for(verdict.cause, recoverable=verdict.recoverable) is cls


def test_the_cause_not_its_victim_decides_the_class() -> None:
    victim = failure("RuntimeError", rank=0, message="Connection closed by peer", timestamp=0.5)
    cause = failure("TransientError", rank=1, recoverable=True, timestamp=1.0)
    verdict = decide_run([reported("p0", victim), reported("p1", cause)])
    assert verdict.node == "p1" and isinstance(error_for_verdict(verdict, "x"), UserCodeRecoverableError)


def test_every_cause_has_a_class_with_its_default() -> None:
    recoverable = {
        OutOfMemoryError,
        PreemptedError,
        CapacityTimeoutError,
        NodeLostError,
        InfrastructureError,
        ImageTransientlyUnavailableError,
        StalledError,
    }
    permanent = {ImageUnavailableError, ConfigurationError, DeadlineExceededError}
    for cause in causes.CAUSES:
        for flag in (True, False):
            cls = class_for(cause, recoverable=flag)
            assert issubclass(cls, TrainingError) and cls.cause == cause
            if cls in recoverable:
                assert issubclass(cls, TrainingRecoverableError) and cls.recoverable
            assert cls in recoverable | permanent or cls.__name__.startswith(("Training", "UserCode")), cls
            if cls in permanent:
                assert issubclass(cls, TrainingFailedError) and not cls.recoverable
    assert issubclass(UserCodeRecoverableError, UserCodeError) and issubclass(UserCodeFailedError, UserCodeError)
    assert not issubclass(TrainingFailedError, AirflowFailException), "a retry_policy must be able to see it"


def test_an_instance_carries_where_and_what_the_worker_raised() -> None:
    found = failure(
        "DataError", module="team.errors", bases=("team.errors.DataError", "builtins.ValueError"), traceback="a\nb"
    )
    verdict = Verdict(succeeded=False, node="job-worker-1", failure=found, cause=causes.USER_CODE, exit_code=1)
    error = error_for_verdict(verdict, "Training failed")
    assert isinstance(error, UserCodeFailedError)
    assert (error.pod, error.rank, error.exit_code) == ("job-worker-1", 1, 1)
    assert (error.exception_type, error.exception_module) == ("DataError", "team.errors")
    assert error.exception_bases == ("team.errors.DataError", "builtins.ValueError")
    assert error.traceback_tail == "a\nb"
    oom = error_for_verdict(Verdict(succeeded=False, node="p", cause=causes.OUT_OF_MEMORY, reason="OOMKilled"), "m")
    assert (oom.reason, oom.exception_type, oom.rank) == ("OOMKilled", "", None)


def test_a_traceback_names_a_dag_files_classes_by_the_file_in_the_log_and_the_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Airflow imports a DAG file as ``unusual_prefix_<sha1>_<file>``, and a class the file defines keeps that module
    in the workers; a person knows it by the file. The carried module stays as it is: retry rules match it."""
    module = "unusual_prefix_" + "ab" * 20 + "_train_dag"
    found = failure("DataError", module=module, traceback=f"Traceback ...\n{module}.DataError: shard 7 is corrupt")
    verdict = Verdict(succeeded=False, node="job-worker-1", failure=found, cause=causes.USER_CODE, exit_code=1)
    error = error_for_verdict(verdict, "Training failed")
    assert error.traceback_tail == "Traceback ...\ntrain_dag.DataError: shard 7 is corrupt"
    assert error.exception_module == module
    with caplog.at_level(logging.ERROR, logger=__name__), pytest.raises(UserCodeFailedError):
        result_or_raise(logging.getLogger(__name__), verdict, None)
    assert caplog.messages == [
        "Root cause, rank 1 failed with DataError: bad shard, traceback:\n"
        "Traceback ...\ntrain_dag.DataError: shard 7 is corrupt"
    ]


def test_without_a_policy_a_permanent_cause_fails_at_once_and_keeps_its_class() -> None:
    error = ConfigurationError("missing Secret", pod="p-0", reason="CreateContainerConfigError")
    final = for_retry_policy(error, None)
    assert isinstance(final, AirflowFailException) and isinstance(final, ConfigurationError)
    assert isinstance(final, TrainingFailedError) and type(final).__name__ == "ConfigurationError"
    assert (
        f"{type(final).__module__}.{type(final).__qualname__}"
        == "airflow_provider_torchelastic.operators.ConfigurationError"
    )
    assert (final.pod, final.reason, str(final)) == ("p-0", "CreateContainerConfigError", "missing Secret")
    # Pickled and read back as what it was.
    again = pickle.loads(pickle.dumps(final))
    assert type(again) is type(final) and again.pod == "p-0"
    assert type(pickle.loads(pickle.dumps(error))) is ConfigurationError


def test_a_permanent_cause_a_rule_names_is_plain_so_that_the_rule_decides() -> None:
    for action in (RetryAction.RETRY, RetryAction.FAIL):
        policy = ExceptionRetryPolicy(rules=[RetryRule(exception=ConfigurationError, action=action)])
        error = ConfigurationError("x")
        assert for_retry_policy(error, policy) is error and not isinstance(error, AirflowFailException)
    # A base class or the user's own exception (UserExceptionRule) names it too.
    failed = ExceptionRetryPolicy(rules=[RetryRule(exception=TrainingFailedError, action=RetryAction.RETRY)])
    assert for_retry_policy(ConfigurationError("x"), failed).__class__ is ConfigurationError
    value_error = user_error("builtins.ValueError", "builtins.Exception")
    by_name = ExceptionRetryPolicy(rules=[UserExceptionRule("ValueError")])
    assert for_retry_policy(value_error, by_name) is value_error


def test_a_permanent_cause_no_rule_names_still_fails_at_once_under_a_policy() -> None:
    """Airflow sends what no rule matches to its standard retries: without this, any policy at all would have a
    missing Secret retried ``retries`` times."""
    oom_only = ExceptionRetryPolicy(rules=[RetryRule(exception=OutOfMemoryError, action=RetryAction.RETRY)])
    for policy in (ExceptionRetryPolicy(rules=[]), oom_only):
        final = for_retry_policy(ConfigurationError("x"), policy)
        assert isinstance(final, AirflowFailException) and isinstance(final, ConfigurationError)
    other = user_error("builtins.KeyError", "builtins.Exception")
    assert isinstance(
        for_retry_policy(other, ExceptionRetryPolicy(rules=[UserExceptionRule("ValueError")])), AirflowFailException
    )

    class Broken:
        def evaluate(self, **kwargs: object) -> None:
            raise RuntimeError("a policy that cannot decide: Airflow falls back to its standard retries")

    assert isinstance(for_retry_policy(ConfigurationError("x"), Broken()), AirflowFailException)


def test_a_recoverable_cause_is_always_plain() -> None:
    oom = OutOfMemoryError("y")
    assert for_retry_policy(oom, None) is oom
    assert for_retry_policy(oom, ExceptionRetryPolicy(rules=[])) is oom


def user_error(*bases: str, recoverable: bool = False) -> UserCodeError:
    cls = UserCodeRecoverableError if recoverable else UserCodeFailedError
    return cls("m", exception_type=bases[0].rpartition(".")[2], exception_bases=bases)


@pytest.mark.parametrize(
    ("named", "match_subclasses", "bases", "matches"),
    [
        (ValueError, True, ("builtins.ValueError", "builtins.Exception"), True),
        ("ValueError", True, ("builtins.ValueError",), True),
        ("builtins.ValueError", True, ("builtins.ValueError",), True),
        (ValueError, True, ("team.errors.DataError", "builtins.ValueError", "builtins.Exception"), True),
        (ValueError, False, ("team.errors.DataError", "builtins.ValueError"), False),
        ("team.errors.DataError", False, ("team.errors.DataError", "builtins.ValueError"), True),
        ("other.DataError", True, ("team.errors.DataError",), False),
        (KeyError, True, ("builtins.ValueError",), False),
        ([KeyError, "DataError"], True, ("team.errors.DataError",), True),
    ],
)
def test_a_user_exception_rule_matches_the_carried_class(
    named: object, match_subclasses: bool, bases: tuple[str, ...], matches: bool
) -> None:
    rule = UserExceptionRule(named, match_subclasses=match_subclasses)  # type: ignore[arg-type]
    assert rule.matches(user_error(*bases)) is matches
    assert rule.matches(user_error(*bases, recoverable=True)) is matches
    # Never another cause, whatever its text says.
    assert not rule.matches(ConfigurationError("ValueError"))


def test_policies_evaluate_the_new_classes_as_airflow_does() -> None:
    policy = ExceptionRetryPolicy(
        rules=[
            RetryRule(exception=OutOfMemoryError, action=RetryAction.RETRY),
            RetryRule(exception=ImageUnavailableError, action=RetryAction.FAIL),
            UserExceptionRule("ValueError", action=RetryAction.FAIL),
        ]
    )
    assert policy.evaluate(OutOfMemoryError("m"), 1, 3).action is RetryAction.RETRY
    assert policy.evaluate(ImageUnavailableError("m"), 1, 3).action is RetryAction.FAIL
    assert policy.evaluate(user_error("builtins.ValueError"), 1, 3).action is RetryAction.FAIL
    assert policy.evaluate(user_error("builtins.KeyError"), 1, 3).action is RetryAction.DEFAULT
    # A rule serializes (Airflow stores the DAG's policy) and names what it matches.
    assert UserExceptionRule(ValueError).serialize()["user_exceptions"] == ["builtins.ValueError"]


@pytest.mark.parametrize("bad", ["", " ValueError", 3, object])
def test_a_user_exception_rule_refuses_what_is_not_an_exception(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="UserExceptionRule"):
        UserExceptionRule(bad)  # type: ignore[arg-type]
