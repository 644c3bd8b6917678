"""The worker's wait (``deferrable=False``), event-driven: the triggerer's list+watch of one job, in a private loop.

The worker drives the one wait core (:func:`~.wait.wait_for_job`) with :func:`~.wait.drive_async` over the shared
watch's own :class:`~.shared_source.SharedSource`, fed by :func:`~.watch.watch_namespace` for this one job (the job
by name, its pods, and a TrainJob's JobSet and Jobs) rather than for the whole namespace. So the decisions are the
trigger's, a change of the job or its pods wakes the wait at once instead of a ``poll_interval`` later, and what the
shared watch does when watching fails happens here too: a 410 relists, a cut stream resumes from the last version
seen, and a watch the identity may not make (401/403) ends the stream, after which the wait polls on its own.

``poll_interval`` stays the pace of that fall-back, of the progress lines and of the log reads, and the safety net:
a pause that passes without any change of the job is followed by a read of the job from the API, as a poll would
read it, so an event the watch missed is caught within it. The fall-back and the safety net use the worker's
blocking client (in a thread): a watch that fails never leaves the wait with less than the polling it had before.

Rank 0's log is followed as a stream (:class:`LogFollower`) once the wait reads it at its pace: the lines wait in a
bounded buffer until the wait's next read takes them, and a stream that ends (a cut connection, a read timeout, the
container's end) is opened again from the second before the last line the wait took (``sinceTime``), so that the
wait's log cursor sees an overlap as it does in a read from the API, and alone decides what was printed. The wait's
last read of a pod, when the job ended, goes to the API, so it reaches the log's end whatever the stream has
delivered.

Deletions that nobody waits for (:attr:`~.requests.DeleteJob.background`: a succeeded job's) go to
:class:`BackgroundDeletes`, so the task's result is not held by the API's answers to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final, TypeVar

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import calls
from airflow_provider_torchelastic.kubernetes.requests import DeleteJob, JobSource, ReadEvents, ReadLog, Request
from airflow_provider_torchelastic.kubernetes.retry import retry_sync
from airflow_provider_torchelastic.kubernetes.shared_source import CLOSE_SECONDS, SharedSource, close_within
from airflow_provider_torchelastic.kubernetes.status import LOG_SKEW_SECONDS, seconds_before, split_stamp
from airflow_provider_torchelastic.kubernetes.wait import drive_async
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot
from airflow_provider_torchelastic.kubernetes.watch import StreamUpdate, watch_namespace

if TYPE_CHECKING:
    from airflow_provider_torchelastic.kubernetes.client import AsyncKube

T = TypeVar("T")

__all__ = ["BackgroundDeletes", "LogFollower", "WatchNotStarted", "wait_watching"]

#: Lines a followed log keeps between two reads of the wait (one interval), and at most the request's
#: ``limit_bytes`` of them; older ones give way, and the next read says how many. A read from the API brings at most
#: as much (``FIRST_READ_TAIL_LINES``, ``limit_bytes``).
FOLLOW_MAX_LINES: Final = 1000
#: Seconds before a stream that ended is opened again, doubled while reopening brings no line, up to the maximum:
#: a container that ended (its stream ends at once) costs a request every half minute until the wait is done.
FOLLOW_RETRY: Final = 1.0
FOLLOW_RETRY_MAX: Final = 30.0


class WatchNotStarted(Exception):
    """The private watch could not start (this thread runs an event loop, or the async client would not open);
    nothing of the flow ran: the caller polls instead."""


def wait_watching(
    flow: Generator[Request, Any, Any],
    ref: JobRef,
    open_client: Callable[[], AbstractAsyncContextManager[Any]],
    polls: JobSource,
    log: Callable[[str], None],
    *,
    detach: Callable[[DeleteJob], None] | None = None,
) -> Any:
    """Drive ``flow`` (the wait core for ``ref``) to its end, woken by a watch of the job; returns what it returns.

    ``open_client`` opens a ``kubernetes_asyncio`` API client (an ``AsyncKubernetesHook``'s ``get_conn``), used for
    the watch and the wait's own requests while the watch lives; ``polls`` is the worker's blocking client, for the
    fall-back and the safety net. Raises :class:`WatchNotStarted` before anything of ``flow`` ran.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_bounded(_drive(flow, ref, open_client, polls, log, detach), log)
    raise WatchNotStarted("this thread runs an event loop already")


def _run_bounded(main: Coroutine[Any, Any, T], log: Callable[[str], None]) -> T:
    """``asyncio.run(main)``, whose end waits for what is left in the loop at most :data:`CLOSE_SECONDS`.

    ``asyncio.run`` waits without a bound for every task it cancels at the end: one that does not end (a stream
    whose close never returns) would hold the task after its job was decided, until ``execution_timeout``."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                _, stuck = loop.run_until_complete(asyncio.wait(left, timeout=CLOSE_SECONDS))
                if stuck:
                    log(f"The job's watch did not close within {CLOSE_SECONDS:g} s: {_names(stuck)}; left behind")
            closing = loop.create_task(loop.shutdown_asyncgens())
            loop.run_until_complete(asyncio.wait({closing}, timeout=CLOSE_SECONDS))
        finally:
            # Without waiting for the default executor's threads: a blocking call of the fall-back may be in one.
            loop.close()


def _names(tasks: set[asyncio.Task[Any]]) -> str:
    return ", ".join(sorted(task.get_name() for task in tasks))


async def _drive(
    flow: Generator[Request, Any, Any],
    ref: JobRef,
    open_client: Callable[[], AbstractAsyncContextManager[Any]],
    polls: JobSource,
    log: Callable[[str], None],
    detach: Callable[[DeleteJob], None] | None,
) -> Any:
    from airflow_provider_torchelastic.kubernetes.client import AsyncKube

    stack = contextlib.AsyncExitStack()
    try:
        try:
            kube = AsyncKube(await stack.enter_async_context(open_client()))
        except Exception as e:  # a connection the async client cannot use: the blocking one polls as before
            raise WatchNotStarted(f"{type(e).__name__}: {e}") from e
        updates = await stack.enter_async_context(contextlib.aclosing(watch_namespace(kube, ref.namespace, job=ref)))
        source = _WatchedJob(updates, _ThreadedPolls(polls), log, kube)
        stack.push_async_callback(source.close)
        stack.push_async_callback(source.leave)
        sleep = functools.partial(source.sleep_until_changed, ref)
        return await drive_async(flow, source, log, sleep=sleep, detach=detach)
    finally:
        # The wait is decided (or failed): what would not close is named by _run_bounded, which leaves it behind.
        await close_within(stack, CLOSE_SECONDS)


class _WatchedJob(SharedSource):
    """The shared watch's source, with the safety net: after a pause in which nothing of the job changed, the job
    is read from the API once (the watch may have missed what a poll would have seen). The log the wait reads at its
    pace is followed as a stream (one pod at a time)."""

    def __init__(
        self,
        updates: AsyncIterator[StreamUpdate],
        polls: _ThreadedPolls,
        say: Callable[[str], None],
        kube: AsyncKube,
    ):
        async def direct() -> _ThreadedPolls:
            return polls

        super().__init__(updates, direct, say)
        self._polls = polls
        self._quiet = False
        self._kube = kube
        self._follower: LogFollower | None = None

    async def read_log(self, request: ReadLog) -> str:
        follower = self._follower
        if follower is not None and follower.serves(request):
            return follower.take()
        text = await super().read_log(request)
        # A read at the wait's pace (it has a cursor: since_time) of a pod whose stream is not open: follow it
        # from the last line this read brought. Tails of failed pods and previous runs are read once: not followed.
        if request.since_time is not None and not request.previous and not request.last:
            await self.close()
            since = last_stamp(text) or request.since_time
            self._follower = LogFollower(self._kube, request, since)
        elif request.last and follower is not None and follower.request.pod == request.pod:
            await self.close()
        return text

    async def close(self) -> None:
        """Stop following (the wait ended, or another pod's log is read now)."""
        follower, self._follower = self._follower, None
        if follower is not None:
            await follower.close()

    async def sleep_until_changed(self, ref: JobRef, seconds: float) -> None:
        started = time.monotonic()
        await super().sleep_until_changed(ref, seconds)
        self._quiet = time.monotonic() - started >= seconds

    async def snapshot(self, ref: JobRef) -> Snapshot:
        if self._quiet and not self.polling:
            self._quiet = False
            return await self._polls.snapshot(ref)
        return await super().snapshot(ref)


def last_stamp(text: str) -> str | None:
    """The timestamp of the last line of a timestamped log read, in whole seconds (what ``sinceTime`` takes)."""
    for line in reversed(text.splitlines()):
        stamp = split_stamp(line, "")[0]
        if stamp:
            return stamp[:19] + "Z"
    return None


class LogFollower:
    """One pod's log followed as a stream (``follow=true``): its lines wait, at most :data:`FOLLOW_MAX_LINES` and
    ``limit_bytes``, until the wait's next read takes them (:meth:`take`). A stream that ends is opened again from the
    second before the last line taken, and the lines not taken yet are dropped: it sends them again, after the lines
    the wait printed last, which the wait's cursor skips as it skips a read's overlap (and which, if they give way,
    are not counted as lines not shown). Refused (401, 403, 404): it stops, and the wait reads the log from the API as
    before.
    """

    def __init__(self, kube: AsyncKube, request: ReadLog, since_time: str | None) -> None:
        self.request = request
        self._kube = kube
        #: The second of the last line the wait has (``since_time``: what the read that started this brought).
        self._taken = since_time
        self._lines: deque[str] = deque()
        self._chars = 0  # in the lines kept: at most the request's limit_bytes, as a read from the API brings
        self._dropped = 0
        #: The latest time of a line taken (sortable, :func:`~.status.split_stamp`'s): a line that gives way is counted
        #: as not shown only when it is later, not when a stream opened again sent it again. (A new line stamped
        #: before it, stderr behind stdout, is not counted either: the note may say too few, never lines printed.)
        self._newest_taken = ""
        #: The latest second of a line the streams brought: a stream opened again that brings none later only
        #: repeats what came (an ended container's), and is opened again less often.
        self._latest = since_time or ""
        #: Why the stream stopped for good (401, 403, 404, or an error of this code): the wait reads from the API.
        self.refused: Exception | None = None
        self._task = asyncio.create_task(self._run(), name=f"torchelastic-follow-{request.pod}")

    def serves(self, request: ReadLog) -> bool:
        """Whether this stream answers ``request``: a paced read of the same pod's container, while not refused."""
        mine = self.request
        same = (request.pod, request.namespace, request.container) == (mine.pod, mine.namespace, mine.container)
        paced = request.since_time is not None and not request.previous and not request.last
        return same and paced and self.refused is None

    def take(self) -> str:
        """The lines that came since the last call, preceded by a note when some gave way."""
        lines = list(self._lines)
        self._lines.clear()
        self._chars = 0
        if self._dropped:
            lines.insert(
                0, f"[... {self._dropped} earlier lines not shown: more came between two reads than one holds]"
            )
            self._dropped = 0
        text = "\n".join(lines)
        self._taken = last_stamp(text) or self._taken
        self._newest_taken = max([self._newest_taken, *(split_stamp(line, "")[0] for line in lines)])
        return text

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        pause = FOLLOW_RETRY
        while True:
            latest = self._latest
            # A line written after the last one taken may be stamped in the second before it.
            since = seconds_before(self._taken or "", LOG_SKEW_SECONDS) or None
            try:
                async for line in self._kube.stream(calls.follow_log(self.request, since)):
                    self._keep(line)
            except KubeError as e:
                if e.status in (401, 403, 404):
                    self.refused = e
                    return
            except Exception as e:  # a bug here must not cost the task its log: the wait reads it as before
                self.refused = e
                return
            # Ended: a cut connection, a read timeout, or the container's end (then reopening brings nothing new).
            # What was not taken comes again, after the overlap the wait's cursor expects.
            self._lines.clear()
            self._chars = self._dropped = 0
            pause = FOLLOW_RETRY if self._latest > latest else min(pause * 2, FOLLOW_RETRY_MAX)
            await asyncio.sleep(pause)

    def _keep(self, line: str) -> None:
        self._lines.append(line)
        self._chars += len(line)
        while len(self._lines) > FOLLOW_MAX_LINES or self._chars > self.request.limit_bytes:
            dropped = self._lines.popleft()
            self._chars -= len(dropped)
            if split_stamp(dropped, "")[0] > self._newest_taken:
                self._dropped += 1
        self._latest = max(self._latest, last_stamp(line) or "")


class _ThreadedPolls:
    """The worker's blocking client as an :class:`~.requests.AsyncJobSource`: each call in a thread, so that the
    private loop (and the watch it runs) goes on meanwhile."""

    def __init__(self, source: JobSource) -> None:
        self._source = source

    async def snapshot(self, ref: JobRef) -> Snapshot:
        return await asyncio.to_thread(self._source.snapshot, ref)

    async def read_log(self, request: ReadLog) -> str:
        return await asyncio.to_thread(self._source.read_log, request)

    async def events(self, request: ReadEvents) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._source.events, request)

    async def delete_job(self, ref: JobRef) -> bool:
        return await asyncio.to_thread(self._source.delete_job, ref)

    async def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None:
        await asyncio.to_thread(self._source.label_job, ref, labels)

    async def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._source.workloads, namespace, job_uid)


class BackgroundDeletes:
    """Deletions that nobody waits for, each in a thread of its own with the worker's blocking client.

    The task's result, its summary and its XComs are made while the API answers; :meth:`join` is called as the task
    returns, bounded: the worker's process ends with ``os._exit`` right after the task reports its state, which
    would cut a deletion still in flight. One that takes longer than the bound (an API that keeps failing) is left
    to the sweep, which deletes the job once its deadline or lease has passed (:mod:`~.sweep`).
    """

    def __init__(self, source: JobSource, log: Callable[[str], None]) -> None:
        self._source = source
        self._log = log
        self._threads: list[threading.Thread] = []

    def __call__(self, request: DeleteJob) -> None:
        name = f"torchelastic-delete-{request.ref.name}"
        thread = threading.Thread(target=self._delete, args=(request.ref,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _delete(self, ref: JobRef) -> None:
        what = f"{ref.kind} {ref.namespace}/{ref.name}"
        try:
            existed = retry_sync(functools.partial(self._source.delete_job, ref), self._log, time.sleep)
        except KubeError as e:
            self._log(f"Could not delete {what}: {e}")
        else:
            self._log(f"Deleted {what} (existed: {existed})")

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the deletions started; whether they all ended."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
