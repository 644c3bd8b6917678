"""The two exceptions a task ends with when training fails: whether a retry may help decides which."""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowException, AirflowFailException

__all__ = ["TrainingFailedError", "TrainingRecoverableError"]


class TrainingRecoverableError(AirflowException):
    """Training (or waiting for it) failed in a way a retry may fix (``RecoverableError``, out of memory, eviction,
    an unreachable API): Airflow retries. The exception tree: :mod:`airflow_provider_torchelastic.errors`."""


class TrainingFailedError(AirflowFailException):
    """Training failed in a way a retry will not fix: the task fails without using its retries."""


# Task logs and the UI print an exception by its classpath (tests and users match on it): the public one, not this
# module's, which is an implementation detail.
TrainingRecoverableError.__module__ = "airflow_provider_torchelastic.operators"
TrainingFailedError.__module__ = "airflow_provider_torchelastic.operators"
