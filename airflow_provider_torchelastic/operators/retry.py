"""``UserExceptionRule``: a ``retry_policy`` rule that names the training code's own exception.

The exception lives in a pod (or a local worker); what reaches Airflow is a :class:`UserCodeError` carrying its class
name, module and bases. Airflow's ``RetryRule`` matches by ``isinstance``, which cannot see them; this rule matches
a ``UserCodeError`` whose carried class is the one named (or, with ``match_subclasses``, a subclass of it)::

    from datetime import timedelta
    from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule
    from airflow_provider_torchelastic.operators import ConfigurationError, OutOfMemoryError, UserExceptionRule

    retry_policy = ExceptionRetryPolicy(
        rules=[
            RetryRule(exception=OutOfMemoryError, action=RetryAction.RETRY, retry_delay=timedelta(minutes=5)),
            RetryRule(exception=ConfigurationError, action=RetryAction.FAIL),
            UserExceptionRule("ValueError", action=RetryAction.RETRY),  # or ValueError, or "team.errors.DataError"
        ]
    )
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk.definitions.retry_policy import RetryAction, RetryRule

from airflow_provider_torchelastic.operators.exceptions import UserCodeError

__all__ = ["UserExceptionRule"]

_USER_CODE_ERROR = "airflow_provider_torchelastic.operators.UserCodeError"


def _qualified(spec: str | type[BaseException]) -> str:
    if isinstance(spec, str):
        if not spec or spec != spec.strip():
            raise ValueError(f"UserExceptionRule: expected an exception class or its name, got {spec!r}")
        return spec
    if isinstance(spec, type) and issubclass(spec, BaseException):
        return f"{spec.__module__}.{spec.__qualname__}"
    raise TypeError(f"UserExceptionRule: expected an exception class or its name, got {spec!r}")


def _same(wanted: str, carried: str) -> bool:
    """``ValueError`` names ``builtins.ValueError``; a dotted name must match exactly."""
    if "." in wanted:
        return wanted == carried or (wanted.startswith("builtins.") and carried == wanted[len("builtins.") :])
    return carried.rpartition(".")[2] == wanted


class UserExceptionRule(RetryRule):
    """A ``RetryRule`` for the training code's exception, named by class or name (``"ValueError"``,
    ``"team.errors.DataError"``, ``KeyError``), or a list of them. ``match_subclasses`` (default True) also matches
    an exception whose class derives from a named one (the worker recorded its bases)."""

    def __init__(
        self,
        user_exception: str | type[BaseException] | Sequence[str | type[BaseException]],
        action: RetryAction = RetryAction.RETRY,
        retry_delay: timedelta | None = None,
        reason: str | None = None,
        match_subclasses: bool = True,
    ) -> None:
        if isinstance(user_exception, str | type):
            specs: list[Any] = [user_exception]
        elif isinstance(user_exception, Sequence):
            specs = list(user_exception)
        else:
            raise TypeError(f"UserExceptionRule: expected an exception class or its name, got {user_exception!r}")
        if not specs:
            raise ValueError("UserExceptionRule: expected at least one exception class or name, got none")
        self.user_exceptions = tuple(_qualified(spec) for spec in specs)
        super().__init__(
            exception=_USER_CODE_ERROR,
            action=action,
            retry_delay=retry_delay,
            reason=reason or f"the training code raised {' or '.join(self.user_exceptions)}",
            match_subclasses=match_subclasses,
        )

    def matches(self, exc: BaseException) -> bool:
        if not isinstance(exc, UserCodeError):
            return False
        own = exc.exception_bases[0] if exc.exception_bases else exc.exception_type
        carried = exc.exception_bases if self.match_subclasses and exc.exception_bases else (own,)
        return any(_same(wanted, name) for wanted in self.user_exceptions for name in carried)

    def serialize(self) -> dict[str, Any]:
        # Airflow stores the rule for display; the worker evaluates the DAG file's own rule object.
        return {**super().serialize(), "user_exceptions": list(self.user_exceptions)}
