"""DAGs for retry_policy rules written against the provider's failure classes (issue 31), run locally by
``dag.test()`` (tests/e2e/test_retry_policies.py). Each task's default ``retry_delay`` is ten minutes: a retry that
comes within seconds came from the matching rule's own delay."""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, ExceptionRetryPolicy, RetryAction, RetryRule

from airflow_provider_torchelastic import Elastic, RecoverableError, TorchElasticOperator
from airflow_provider_torchelastic.operators import ConfigurationError, UserExceptionRule
from tests.dag_support import record_failure

START = pendulum.datetime(2026, 1, 1, tz="UTC")
#: Long enough that dag.test() would wait it out visibly: only a rule's delay lets a retry start sooner.
SLOW_DEFAULT = timedelta(minutes=10)
RULE_DELAY = timedelta(seconds=2)


def value_error_on_first_try(try_number: str) -> dict:
    if int(try_number) == 1 and os.environ["RANK"] == "1":
        raise ValueError(f"shard 7 is empty on try {try_number}")
    return {"try_number": int(try_number)}


def too_large_on_first_try(try_number: str) -> str:
    # Over the 4096 bytes a result may take without result storage: a configuration error, permanent by default.
    return "x" * 6000 if int(try_number) == 1 else "small"


class FlakyFeedError(RecoverableError):
    """A user's own recoverable error: retried by default."""


def recoverable_on_every_try() -> None:
    raise FlakyFeedError("the feed is down")


def _task(dag_id: str, fn, policy: ExceptionRetryPolicy, **op_kwargs: str) -> DAG:
    with DAG(
        dag_id,
        schedule=None,
        start_date=START,
        catchup=False,
        default_args={"retries": 3, "retry_delay": SLOW_DEFAULT, "on_failure_callback": record_failure},
    ) as dag:
        TorchElasticOperator(
            task_id="train",
            python_callable=fn,
            op_kwargs=op_kwargs,
            task_config=Elastic(nnodes=1, nproc_per_node=2, monitor_interval=0.1),
            execution="local",
            retry_policy=policy,
            on_retry_callback=record_failure,
        )
    return dag


# A user's ValueError, raised in a worker, retried once by a rule that names it.
_task(
    "te_policy_user_value_error",
    value_error_on_first_try,
    ExceptionRetryPolicy(
        rules=[UserExceptionRule(ValueError, retry_delay=RULE_DELAY, reason="an empty shard: retry it")]
    ),
    try_number="{{ ti.try_number }}",
)

# A permanent cause (by default it fails at once) retried because a rule says so: the policy sees every cause.
_task(
    "te_policy_retries_a_permanent_cause",
    too_large_on_first_try,
    ExceptionRetryPolicy(rules=[RetryRule(exception=ConfigurationError, retry_delay=RULE_DELAY)]),
    try_number="{{ ti.try_number }}",
)

# A recoverable user error (by default retried) failed at try 1 by a rule naming its class, despite retries=3.
_task(
    "te_policy_fails_a_recoverable_cause",
    recoverable_on_every_try,
    ExceptionRetryPolicy(rules=[UserExceptionRule("FlakyFeedError", action=RetryAction.FAIL)]),
)
