"""The worker's wait (``deferrable=False``), event-driven: the triggerer's list+watch of one job, in a private loop.

The worker drives the one wait core (:func:`~.wait.wait_for_job`) with :func:`~.wait.drive_async` over the shared
watch's own :class:`~.watch.SharedSource`, fed by :func:`~.watch.watch_namespace` for this one job (the job by name,
its pods, and a TrainJob's JobSet and Jobs) rather than for the whole namespace. So the decisions are the trigger's,
a change of the job or its pods wakes the wait at once instead of a ``poll_interval`` later, and what the shared
watch does when watching fails happens here too: a 410 relists, a cut stream resumes from the last version seen, and
a watch the identity may not make (401/403) ends the stream, after which the wait polls on its own.

``poll_interval`` stays the pace of that fall-back, of the progress lines and of the log reads, and the safety net:
a pause that passes without any change of the job is followed by a read of the job from the API, as a poll would
read it, so an event the watch missed is caught within it. The fall-back and the safety net use the worker's
blocking client (in a thread): a watch that fails never leaves the wait with less than the polling it had before.

Deletions that nobody waits for (:attr:`~.requests.DeleteJob.background`: a succeeded job's) go to
:class:`BackgroundDeletes`, so the task's result is not held by the API's answers to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes.requests import DeleteJob, JobSource, ReadLog, Request
from airflow_provider_torchelastic.kubernetes.retry import retry_sync
from airflow_provider_torchelastic.kubernetes.status import JobRef, Snapshot
from airflow_provider_torchelastic.kubernetes.wait import drive_async
from airflow_provider_torchelastic.kubernetes.watch import SharedSource, StreamUpdate, watch_namespace

__all__ = ["BackgroundDeletes", "WatchNotStarted", "wait_watching"]


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
        return asyncio.run(_drive(flow, ref, open_client, polls, log, detach))
    raise WatchNotStarted("this thread runs an event loop already")


async def _drive(
    flow: Generator[Request, Any, Any],
    ref: JobRef,
    open_client: Callable[[], AbstractAsyncContextManager[Any]],
    polls: JobSource,
    log: Callable[[str], None],
    detach: Callable[[DeleteJob], None] | None,
) -> Any:
    from airflow_provider_torchelastic.kubernetes.client import AsyncKube

    async with contextlib.AsyncExitStack() as stack:
        try:
            kube = AsyncKube(await stack.enter_async_context(open_client()))
        except Exception as e:  # a connection the async client cannot use: the blocking one polls as before
            raise WatchNotStarted(f"{type(e).__name__}: {e}") from e
        updates = await stack.enter_async_context(contextlib.aclosing(watch_namespace(kube, ref.namespace, job=ref)))
        source = _WatchedJob(updates, _ThreadedPolls(polls), log)
        sleep = functools.partial(source.sleep_until_changed, ref)
        return await drive_async(flow, source, log, sleep=sleep, detach=detach)


class _WatchedJob(SharedSource):
    """The shared watch's source, with the safety net: after a pause in which nothing of the job changed, the job
    is read from the API once (the watch may have missed what a poll would have seen)."""

    def __init__(self, updates: AsyncIterator[StreamUpdate], polls: _ThreadedPolls, say: Callable[[str], None]):
        async def direct() -> _ThreadedPolls:
            return polls

        super().__init__(updates, direct, say)
        self._polls = polls
        self._quiet = False

    async def sleep_until_changed(self, ref: JobRef, seconds: float) -> None:
        started = time.monotonic()
        await super().sleep_until_changed(ref, seconds)
        self._quiet = time.monotonic() - started >= seconds

    async def snapshot(self, ref: JobRef) -> Snapshot:
        if self._quiet and not self.polling:
            self._quiet = False
            return await self._polls.snapshot(ref)
        return await super().snapshot(ref)


class _ThreadedPolls:
    """The worker's blocking client as an :class:`~.requests.AsyncJobSource`: each call in a thread, so that the
    private loop (and the watch it runs) goes on meanwhile."""

    def __init__(self, source: JobSource) -> None:
        self._source = source

    async def snapshot(self, ref: JobRef) -> Snapshot:
        return await asyncio.to_thread(self._source.snapshot, ref)

    async def read_log(self, request: ReadLog) -> str:
        return await asyncio.to_thread(self._source.read_log, request)

    async def pod_events(self, pod: str, namespace: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._source.pod_events, pod, namespace)

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
