"""Repeating a Kubernetes API call while the API is throttled or down: one policy for the sync and async clients.

Only recoverable :class:`KubeError` s are repeated (429, 5xx, a failed connection), with a jittered exponential
backoff that never waits less than the server's ``Retry-After`` (capped at :data:`LONGEST_WAIT`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import tenacity

from airflow_provider_torchelastic.errors import KubeError

__all__ = ["LONGEST_WAIT", "MAX_RECOVERABLE_FAILURES", "retry_async", "retry_sync"]

T = TypeVar("T")


#: Consecutive recoverable failures of one call tolerated before giving up (about 5 minutes of backoff).
MAX_RECOVERABLE_FAILURES: Final = 12
#: The longest wait between two tries, seconds: the backoff's ceiling, and the most of a server's ``Retry-After``
#: honoured (a proxy's "come back in an hour" must not hold a task that long without a word).
LONGEST_WAIT: Final = 30.0

# 1, 2, 4, 8, 16, 30, 30... seconds, jittered so that many triggers do not retry in step.
_backoff: Final = tenacity.wait_random_exponential(multiplier=1, max=LONGEST_WAIT)


def _wait(state: tenacity.RetryCallState) -> float:
    """How long to wait before the next try: our own backoff, and never sooner than the server asked for
    (``Retry-After``, capped at :data:`LONGEST_WAIT`)."""
    error = state.outcome.exception() if state.outcome is not None else None
    backoff = float(_backoff(state))
    if isinstance(error, KubeError) and error.retry_after is not None:
        # The server knows its load (API Priority and Fairness computes the 429's Retry-After): trying sooner is
        # refused again. Not shorter than the backoff either: the API server says "1 s" to every throttled request,
        # and the retries would then give up after a dozen seconds of throttling instead of minutes.
        return max(min(error.retry_after, LONGEST_WAIT), backoff)
    return backoff


def _repeated(error: BaseException) -> bool:
    """Whether a failed call is tried again: only for a recoverable API error (429, 5xx, a failed connection)."""
    return isinstance(error, KubeError) and error.recoverable


def _retrying(log: Callable[[str], None]) -> dict[str, Any]:
    """tenacity settings shared by both loops: repeat only recoverable API errors, waiting as :func:`_wait` says."""

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        asked = " as the server asked" if isinstance(error, KubeError) and error.retry_after is not None else ""
        log(f"Kubernetes API error ({error}); retrying in {delay:.0f} s{asked}")

    return {
        "retry": tenacity.retry_if_exception(_repeated),
        "wait": _wait,
        "stop": tenacity.stop_after_attempt(MAX_RECOVERABLE_FAILURES + 1),
        "before_sleep": before_sleep,
        "reraise": True,
    }


def retry_sync(call: Callable[[], T], log: Callable[[str], None], sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, repeated while the API answers 429/5xx or the connection fails; other errors raise at once.

    Between tries it waits the server's ``Retry-After`` when the answer had one (capped at :data:`LONGEST_WAIT`),
    else a jittered exponential backoff.
    """
    # The first try outside tenacity: nearly every call succeeds at once (and every read of a shared watch's cache,
    # which 1,000 waiting triggers make every poll), and tenacity's loop costs about as much as such a read.
    try:
        return call()
    except Exception as e:
        if not _repeated(e):
            raise
        failed = [e]

    def again() -> T:
        # The loop starts from the first try's failure (it counts, and its backoff is logged), not a second call.
        if failed:
            raise failed.pop()
        return call()

    return tenacity.Retrying(sleep=sleep, **_retrying(log))(again)


async def retry_async(call: Callable[[], Awaitable[T]], log: Callable[[str], None]) -> T:
    """The same as :func:`retry_sync`, awaiting."""
    try:
        return await call()
    except Exception as e:
        if not _repeated(e):
            raise
        failed = [e]

    async def again() -> T:
        if failed:
            raise failed.pop()
        return await call()

    return await tenacity.AsyncRetrying(sleep=asyncio.sleep, **_retrying(log))(again)
