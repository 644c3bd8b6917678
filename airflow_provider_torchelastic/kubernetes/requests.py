"""The wait core's protocol: the requests its generators yield, the answers they get, and the sources that answer.

The generators (:mod:`~.wait`) decide; the drivers carry out these requests against a :class:`JobSource` (blocking)
or an :class:`AsyncJobSource` (the triggerer), so the two paths share every decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeAlias

from airflow_provider_torchelastic.core.naming import TRAINING_CONTAINER
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot

__all__ = [
    "AsyncJobSource",
    "DeleteJob",
    "EmitLog",
    "FetchJob",
    "JobSource",
    "LOG_READ_LIMIT_BYTES",
    "ReadEvents",
    "ReadLog",
    "ReadWorkloads",
    "RenewLease",
    "Request",
    "Sleep",
]


@dataclass(frozen=True)
class FetchJob:
    """Get the job and its pods; answered with a :class:`~.wait_types.Snapshot` (or, when the source failed, with
    the driver's own marker of that failure, :mod:`~.wait`'s to make and to read)."""

    ref: JobRef


#: :attr:`ReadLog.limit_bytes`: far more than a read of :data:`~.wait_logs.FIRST_READ_TAIL_LINES` ordinary lines.
LOG_READ_LIMIT_BYTES: Final = 1 << 20


@dataclass(frozen=True)
class ReadLog:
    """Read the training container's log of ``pod`` with timestamps, from the second ``since_time`` (RFC 3339 in whole
    seconds, compared with the node's stamps; None: all), or only its last ``tail_lines`` lines. Answered with the
    text, ``""`` when it is not available (yet).

    The one description of a log read: the wait core yields it, every source takes it whole, and
    :func:`~.calls.read_log` makes it the API's query."""

    pod: str
    namespace: str
    since_time: str | None
    tail_lines: int | None = None
    #: The kind's training container (``JobKind.log_container``).
    container: str = TRAINING_CONTAINER
    #: The container's run before its last restart (``previous=true``): where a restarted node's exception is.
    previous: bool = False
    #: The most bytes the read brings (the API's ``limitBytes``): a pod that prints one line of gigabytes must not
    #: cost the worker or the triggerer, which every deferred task shares, more than this per read.
    limit_bytes: int = LOG_READ_LIMIT_BYTES
    #: Each line prefixed with its time (what the wait's log cursors need); False leaves the lines as the container
    #: wrote them (what a person reads in the UI).
    timestamps: bool = True
    #: The wait's last read of this pod (the job ended): it must reach the log's end, so a source that follows the
    #: log as a stream reads it from the API rather than answer with the lines the stream brought so far.
    last: bool = False


@dataclass(frozen=True)
class ReadEvents:
    """The events about the object ``name`` of ``kind`` (a pod, or a job whose controller says there why it could
    not create a pod); answered with the list, empty when they cannot be read (they only add detail)."""

    name: str
    namespace: str
    kind: str = "Pod"


@dataclass(frozen=True)
class DeleteJob:
    """Delete the job and its payload; answered with whether it existed, or the error text when deletion failed.

    ``background``: nobody waits for this deletion (a succeeded job's clean-up). A driver given a way to detach it
    (the worker's) starts it and answers None at once; any other driver carries it out as usual."""

    ref: JobRef
    background: bool = False


@dataclass(frozen=True)
class RenewLease:
    """Move the job's lease (:mod:`~.deadline`) to ``until``; answered with None, or the error text when it failed."""

    ref: JobRef
    until: float


@dataclass(frozen=True)
class ReadWorkloads:
    """List the Kueue Workloads of the job whose uid is ``job_uid`` (:mod:`~.queue_limits`); answered with the list,
    empty when they cannot be read (Kueue not installed, or no right to list them: they only add a check)."""

    namespace: str
    job_uid: str


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class EmitLog:
    line: str


Request: TypeAlias = FetchJob | ReadLog | ReadEvents | ReadWorkloads | DeleteJob | RenewLease | Sleep | EmitLog


class JobSource(Protocol):
    """What the sync driver needs: the job as it is now, its pods' logs, and deleting it. Raises ``KubeError``."""

    def snapshot(self, ref: JobRef) -> Snapshot: ...

    def read_log(self, request: ReadLog) -> str: ...

    def events(self, request: ReadEvents) -> list[dict[str, Any]]: ...

    def delete_job(self, ref: JobRef) -> bool: ...

    def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None: ...

    def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]: ...


class AsyncJobSource(Protocol):
    """The same for the async driver (the trigger)."""

    async def snapshot(self, ref: JobRef) -> Snapshot: ...

    async def read_log(self, request: ReadLog) -> str: ...

    async def events(self, request: ReadEvents) -> list[dict[str, Any]]: ...

    async def delete_job(self, ref: JobRef) -> bool: ...

    async def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None: ...

    async def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]: ...
