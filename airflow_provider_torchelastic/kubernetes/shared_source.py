"""A trigger's side of the shared watch (:mod:`.watch`): an :class:`~.requests.AsyncJobSource` that answers from
the stream's cache and sleeps until the stream says that its job changed, polling on its own once the stream fails
it. The worker's event-driven wait (:mod:`.worker_wait`) uses it over a private stream of its one job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping
from typing import Any, Final, TypeVar

from airflow_provider_torchelastic.kubernetes.requests import ReadEvents, ReadLog
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot
from airflow_provider_torchelastic.kubernetes.watch import JobCache, StreamUpdate, live_cache
from airflow_provider_torchelastic.kubernetes.watch_scope import SELECTOR

__all__ = ["CLOSE_SECONDS", "UNKNOWN_SECONDS", "SharedSource", "close_within"]

T = TypeVar("T")

#: Seconds a trigger waits for the stream to know its job before it polls on its own.
UNKNOWN_SECONDS: Final = 60.0
#: How long the end of a decided wait may take to close what it opened (its subscription, watch, log streams and
#: client): past it they are left behind, and the wait's answer goes out.
CLOSE_SECONDS: Final = 10.0


async def close_within(stack: contextlib.AsyncExitStack, seconds: float) -> bool:
    """Close ``stack``, waiting at most ``seconds``; True when it closed (an error of the close is raised).

    CI once saw a worker's task time out minutes after its job succeeded, held by a client whose close never
    returned: the answer of a decided wait must not depend on its clean-up."""
    closing = asyncio.ensure_future(stack.aclose())
    done, _ = await asyncio.wait({closing}, timeout=seconds)
    if done:
        closing.result()
    return bool(done)


class SharedSource:
    """An :class:`~requests.AsyncJobSource` fed by a shared stream, polling on its own once the stream fails it.

    ``updates`` is the trigger's subscription; ``direct`` opens a client of the trigger's own (an
    :class:`~.client.AsyncKube`) when it must poll. ``say`` is the trigger's log. ``key``
    (:func:`~.watch.stream_key`) finds the live stream's cache before the first update comes.

    A task of its own takes the subscription's updates from the first call on until :meth:`leave`: a subscriber
    that stops reading (in a slow log read, holding an event) fills its queue, and the triggerer fails a subscriber
    whose queue overflows. So the wait sleeps on timers and on an event that task sets when its job changed, and an
    update about other jobs wakes only that task.
    """

    def __init__(
        self,
        updates: AsyncIterator[StreamUpdate],
        direct: Callable[[], Awaitable[Any]],
        say: Callable[[str], None],
        *,
        key: Hashable | None = None,
    ) -> None:
        self._updates = updates
        self._open_direct = direct
        self._say = say
        self._key = key
        self._cache: JobCache | None = None
        self._direct: Any = None
        self._taker: asyncio.Task[None] | None = None
        self._failure: str | None = None  # why the subscription ended, once it has
        self._job: str | None = None  # the name of the job this source answers for, once asked
        self._dirty = False  # the job changed since the last sleep
        self._changed = asyncio.Event()  # set with _dirty, and when the subscription ends
        self._updated = asyncio.Event()  # set by any update

    @property
    def polling(self) -> bool:
        return self._direct is not None

    async def _fall_back(self, why: str) -> Any:
        if self._direct is None:
            self._say(f"Shared watch unavailable ({why}); this trigger polls the API on its own from now on")
            self._direct = await self._open_direct()
        return self._direct

    def _take(self) -> bool:
        """Start taking the updates (once); False once the subscription has ended or this source polls."""
        if self._taker is None and self._direct is None:
            self._cache = live_cache(self._key) if self._key is not None else None
            self._taker = asyncio.create_task(self._take_updates(), name="torchelastic-subscription")
        return self._direct is None and self._failure is None

    async def _take_updates(self) -> None:
        try:
            async for update in self._updates:
                self._cache = update.cache
                changed = update.changed
                if changed is None or self._job is None or self._job in changed:
                    self._dirty = True
                    self._changed.set()
                self._updated.set()
            self._failure = "the shared watch ended"
        except Exception as e:  # overflow, or the stream failed (403, a bug): never leave the task unobserved
            self._failure = f"{type(e).__name__}: {e}"
        self._changed.set()
        self._updated.set()

    async def leave(self) -> None:
        """Stop taking the subscription's updates (the wait is over)."""
        taker, self._taker = self._taker, None
        if taker is not None and not taker.done():
            taker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taker

    def _usable(self, ref: JobRef) -> JobCache | None:
        cache = self._cache
        return cache if cache is not None and not cache.closed and cache.watches(ref) else None

    async def snapshot(self, ref: JobRef) -> Snapshot:
        self._job = ref.name
        deadline = time.monotonic() + UNKNOWN_SECONDS
        while self._take():
            cache = self._cache
            if cache is not None and cache.ready and not cache.watches(ref):
                await self._fall_back(f"{ref.kind} {ref.name} lacks the label {SELECTOR}")
                break
            if cache is not None and not cache.closed and cache.knows(ref):
                return cache.snapshot(ref)
            if (left := deadline - time.monotonic()) <= 0:  # the stream cannot list, or cannot fetch this job
                await self._fall_back(f"it did not see {ref.kind} {ref.name} within {UNKNOWN_SECONDS:g} s")
                break
            if cache is not None and cache.ready:
                cache.want(ref)
            self._updated.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._updated.wait()
        direct = self._direct or await self._fall_back(self._failure or "the shared watch ended")
        snapshot: Snapshot = await direct.snapshot(ref)
        return snapshot

    async def hold(self, seconds: float) -> None:
        """Sleep ``seconds``; the subscription's updates are still taken meanwhile."""
        self._take()
        await asyncio.sleep(seconds)

    async def sleep_until_changed(self, ref: JobRef, seconds: float) -> None:
        """Sleep up to ``seconds``, waking up as soon as the stream reports a change of the job or its pods."""
        self._job = ref.name
        deadline = time.monotonic() + seconds
        if self._take() and not self._dirty:
            self._changed.clear()
            # asyncio.timeout, not wait_for: no task per sleep (1,000 triggers sleep and wake every poll_interval).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._changed.wait()
        self._dirty = False
        if self._failure is not None and self._direct is None:
            await self._fall_back(self._failure)
        if self._direct is not None and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(left)  # polling: the deadline is the poll's pace

    async def _through(self, call: Callable[[Any], Awaitable[T]], ref: JobRef | None = None) -> T:
        """``call`` on the stream's client while the stream lives (at most
        :data:`~.watch.MAX_CONCURRENT_REQUESTS` at once), else on this trigger's own. With ``ref``: only while the
        stream watches that job."""
        cache = self._cache if ref is None else self._usable(ref)
        if self._direct is None and cache is not None and not cache.closed:
            kube = cache.kube
            return await cache.request(lambda: call(kube))  # type: ignore[no-any-return]
        direct = self._direct or await self._fall_back("the shared watch ended")
        return await call(direct)

    async def read_log(self, request: ReadLog) -> str:
        return await self._through(lambda kube: kube.read_log(request))

    async def delete_job(self, ref: JobRef) -> bool:
        return await self._through(lambda kube: kube.delete_job(ref), ref)

    async def events(self, request: ReadEvents) -> list[dict[str, Any]]:
        return await self._through(lambda kube: kube.events(request))

    async def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None:
        await self._through(lambda kube: kube.label_job(ref, labels), ref)

    async def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return await self._through(lambda kube: kube.workloads(namespace, job_uid))
