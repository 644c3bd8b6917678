"""How the agent reads its workers' failures: what torch reported, and what each worker left beside its error file.

A worker that raised leaves markers (:mod:`airflow_provider_torchelastic.runner.worker`); torch records the first
failure it polls, with whole seconds. Every failure of the attempt is read here, and the cause chosen among them.
Standard library only (torch's objects are only read by attribute).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from airflow_provider_torchelastic.core.outcome import WorkerFailure, root_cause
from airflow_provider_torchelastic.runner.worker import EXCEPTION_MARKER, FAILED_AT_MARKER, RECOVERABLE_MARKER

__all__ = ["failure_from_child_failed"]

#: torch's ``ProcessFailure.error_file`` of a worker that wrote no error file.
_NO_ERROR_FILE: Final = "<N/A>"


def _split_message(message: str) -> tuple[str, str]:
    """torch records ``"<ExceptionType>: <message>"``."""
    name, sep, rest = message.partition(": ")
    if sep and name.replace(".", "").replace("_", "").isalnum():
        return name, rest
    return "WorkerError", message


def failure_from_child_failed(error: Any, log_dir: str | os.PathLike[str] | None = None) -> WorkerFailure:
    """The root cause of a ``ChildFailedError``, among all the workers of its attempt that failed.

    torch reports the failed workers it found at one poll (with function workers, only the first one, which is
    usually the lowest local rank) and stamps them with whole seconds, so a rank that failed a moment after its peer
    (the peer's exit closed their connection) ties with the peer, or is the only one reported. So every failure is
    read: the ones torch reported and, from the attempt's folder under ``log_dir``, every other worker that left an
    error file or our markers, each with its own sub-second time; then a known cause wins over a consequence
    (:func:`~airflow_provider_torchelastic.core.outcome.root_cause`).
    """
    reported = sorted((int(rank), failure) for rank, failure in error.failures.items())
    attempt = _attempt_folder(log_dir, [failure for _, failure in reported])
    candidates = [_reported_failure(rank, failure, _worker_folder(attempt, failure)) for rank, failure in reported]
    if attempt is not None and reported:
        # Global ranks of one node are consecutive: base + local rank.
        base = reported[0][0] - int(reported[0][1].local_rank)
        known = {int(failure.local_rank) for _, failure in reported}
        folders = [f for f in attempt.iterdir() if f.is_dir() and f.name.isdigit() and int(f.name) not in known]
        for folder in sorted(folders, key=lambda f: int(f.name)):
            found = _unreported_failure(base + int(folder.name), folder)
            if found is not None:
                candidates.append(found)
    return root_cause(candidates)


def _attempt_folder(log_dir: str | os.PathLike[str] | None, reported: Sequence[Any]) -> Path | None:
    """``<log_dir>/<run id>_<random>/attempt_<restart>/``: where each worker's ``<local rank>/`` folder is."""
    for failure in reported:
        if failure.error_file and failure.error_file != _NO_ERROR_FILE and Path(failure.error_file).is_file():
            return Path(failure.error_file).parent.parent
    if log_dir is None:
        return None
    attempts = [p for p in Path(log_dir).glob("*/attempt_*") if p.is_dir() and p.name[len("attempt_") :].isdigit()]
    # With restarts, the failure is the last attempt's.
    return max(attempts, key=lambda p: int(p.name[len("attempt_") :]), default=None)


def _worker_folder(attempt: Path | None, failure: Any) -> Path | None:
    if attempt is not None:
        return attempt / str(failure.local_rank)
    if failure.error_file and failure.error_file != _NO_ERROR_FILE:
        return Path(failure.error_file).parent
    return None


@dataclass(frozen=True)
class _Markers:
    """What a worker left beside its error file when its function raised (see ``_leave_failure_markers``)."""

    failed_at: float | None = None
    recoverable: bool = False
    exception: str | None = None
    message: str = ""
    module: str = ""
    bases: tuple[str, ...] = ()

    def about(self, exception: str) -> dict[str, Any]:
        """The class's module and bases, when ``exception`` (torch's record of it) names the class they are of."""
        if self.exception is None or exception.rpartition(".")[2] != self.exception:
            return {}
        return {"module": self.module, "bases": self.bases}


def _read_markers(folder: Path | None) -> _Markers:
    if folder is None or not folder.is_dir():
        return _Markers()
    failed_at = None
    with contextlib.suppress(OSError, ValueError):  # absent, or cut short by the agent stopping the worker
        failed_at = float(folder.joinpath(FAILED_AT_MARKER).read_text())
    exception, message, module = None, "", ""
    bases: tuple[str, ...] = ()
    try:
        raised = json.loads(folder.joinpath(EXCEPTION_MARKER).read_text())
        exception, message = str(raised["exception"]), str(raised.get("message", ""))
        module = str(raised.get("module") or "")
        found = raised.get("bases")
        bases = tuple(str(name) for name in found) if isinstance(found, list) else ()
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return _Markers(
        failed_at=failed_at,
        recoverable=folder.joinpath(RECOVERABLE_MARKER).exists(),
        exception=exception,
        message=message,
        module=module,
        bases=bases,
    )


def _error_data(data: Any) -> tuple[str, str, float | None] | None:
    """torch's error file: ("<Type>: <message>", traceback, whole-second time), or None when it has none."""
    block = data.get("message") if isinstance(data, dict) else None
    if isinstance(block, dict):
        extra = block.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        when: float | None = None
        with contextlib.suppress(KeyError, TypeError, ValueError):
            when = float(extra["timestamp"])
        return str(block.get("message", "")), str(extra.get("py_callstack", "") or ""), when
    if isinstance(block, str) and block != "<NONE>":  # torch's placeholder when there is no error file
        return block, "", None
    return None


def _recorded_message(raw: Any) -> bool:
    """Whether torch's ``ProcessFailure.message`` holds a recorded exception (a record dict, or "<Type>: <message>")
    rather than its placeholder for a worker that recorded none."""
    if isinstance(raw, dict):
        return bool(raw.get("message"))
    text = str(raw)
    return bool(text) and not text.startswith("To enable traceback") and _split_message(text)[0] != "WorkerError"


def _reported_failure(rank: int, failure: Any, folder: Path | None) -> WorkerFailure:
    """A worker failure torch reported (a ``ProcessFailure``), with the markers its worker left, if any."""
    markers = _read_markers(folder)
    recoverable = markers.recoverable
    traceback = ""
    recorded = _error_data(failure.error_file_data) if failure.error_file != _NO_ERROR_FILE else None
    if recorded is not None:
        text, traceback, _ = recorded
        exception, message = _split_message(text)
    elif markers.exception is not None:
        # It raised, and was stopped before torch wrote its error file.
        exception, message = markers.exception, markers.message
    elif failure.exitcode < 0:
        # A worker killed by a signal left no exception. SIGKILL is almost always the OOM killer or a node going
        # away, SIGTERM a preemption: infrastructure, worth a retry. A segfault or abort is not.
        import signal

        signum = -failure.exitcode
        recoverable = signum in (signal.SIGKILL, signal.SIGTERM)
        exception = f"Signal{signal.Signals(signum).name}" if signum in signal.valid_signals() else "Signal"
        message = str(failure.message)
    elif failure.exitcode > 0 and not _recorded_message(failure.message):
        # It ended with a code and without an exception: os._exit(n), or native code calling exit(). torch's own
        # words for this ("To enable traceback see: ...") would only point at its docs.
        exception = "WorkerExited"
        message = (
            f"the worker process exited with code {failure.exitcode} without raising an exception (os._exit(), "
            "or native code that called exit())"
        )
    else:
        raw = failure.message
        # torch keeps either the recorded "Type: message" string or the whole record dict here.
        text = raw.get("message", "") if isinstance(raw, dict) else str(raw)
        exception, message = _split_message(text)
    return WorkerFailure(
        rank=rank,
        exception=exception,
        message=message,
        traceback=traceback,
        recoverable=recoverable,
        exitcode=int(failure.exitcode),
        timestamp=markers.failed_at if markers.failed_at is not None else float(failure.timestamp),
        hostname=socket.gethostname(),
        **markers.about(exception),
    )


def _unreported_failure(rank: int, folder: Path) -> WorkerFailure | None:
    """A worker torch did not report (it polls for one), from what it left in its folder; None if nothing."""
    markers = _read_markers(folder)
    recorded = None
    with contextlib.suppress(OSError, ValueError):  # no error file, or one cut short
        recorded = _error_data(json.loads(folder.joinpath("error.json").read_text()))
    if recorded is not None:
        text, traceback, when = recorded
        exception, message = _split_message(text)
    elif markers.exception is not None:
        exception, message, traceback, when = markers.exception, markers.message, "", None
    else:
        return None
    timestamp = markers.failed_at if markers.failed_at is not None else when
    return WorkerFailure(
        rank=rank,
        exception=exception,
        message=message,
        traceback=traceback,
        recoverable=markers.recoverable,
        exitcode=1,  # it raised; its real exit code is the agent's to know
        timestamp=timestamp if timestamp is not None else time.time(),
        hostname=socket.gethostname(),
        **markers.about(exception),
    )
