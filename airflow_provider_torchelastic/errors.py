"""Errors and exit codes shared by the runner (in pods, without Airflow) and the Airflow side.

Standard library only: the runner imports this module in images that have neither Airflow nor kubernetes.
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_RECOVERABLE", "EXIT_USAGE", "RecoverableError"]

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


class RecoverableError(Exception):
    """Raise this (or a subclass) from a training function for a failure that a retry may fix.

    Examples: a flaky data source, a lost peer, a preempted spot node. Airflow retries the task (within its
    ``retries``); any other exception fails the task at once.
    """
