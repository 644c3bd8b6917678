"""One list+watch per connection and namespace, shared by every trigger that waits there (Airflow 3.3 shared streams).

The triggerer runs :func:`watch_namespace` once per :func:`stream_key` (``open_shared_stream``) and broadcasts its
:class:`StreamUpdate` s to the triggers of that key. Each trigger keeps driving the one wait core
(:func:`~wait.wait_for_job`); only its :class:`~requests.AsyncJobSource` changes: a :class:`SharedSource` answers "what
does the job look like now" from the stream's :class:`JobCache` and sleeps until the stream says that the job
changed. So there is no second state machine, and deciding needs no request. The worker's synchronous wait runs
the same stream for its one job in a private event loop (``watch_namespace(job=...)``, :mod:`~.worker_wait`).

What the stream does, as a client-go informer does: list each registered kind of job and the pods, all by the
provider's ``managed-by`` label, then watch from the list's ``resourceVersion`` with bookmarks; a watch that the
server ends is resumed from the last version seen, a 410 Gone relists, a broken connection is retried with jittered
backoff. A 401/403 (an identity that may not list or watch) ends the stream: every trigger then polls on its own.

The contract with the triggers:

* Every update wakes every trigger of the stream (Airflow's triggerer puts each one in each subscriber's queue), so
  the stream broadcasts only changes, at most one update per :data:`BROADCAST_GAP` (a burst of hundreds of jobs
  ending costs a few broadcasts), and a heartbeat every :data:`TICK_SECONDS`. Nothing waits for a broadcast that
  does not concern it: each trigger takes its updates in a task of its own and keeps its deadlines with timers.
* A late joiner reads the current state at once: the live stream's cache is found by its key
  (:func:`live_cache`), without waiting for the next update. A job the cache has not seen (created a moment ago)
  is fetched once by the stream (:meth:`JobCache.want`), not by the trigger.
* The key is a fingerprint of the connection settings (Airflow logs keys; settings may hold a token).
* A trigger whose queue overflowed, or whose stream ended, polls on its own from then on and says so once.
* One API client per stream; the triggers' own requests (log reads, the final delete) go through it, at most
  :data:`MAX_CONCURRENT_REQUESTS` at a time, which leaves the client's connection pool room for the watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import calls, kinds
from airflow_provider_torchelastic.kubernetes.requests import ReadLog
from airflow_provider_torchelastic.kubernetes.status import JobRef, Snapshot
from airflow_provider_torchelastic.kubernetes.watch_scope import (
    SELECTOR,
    Watched,
    intermediate_key,
    job_scope,
    namespace_scope,
)

if TYPE_CHECKING:
    # Its type only: the connection sits above this module (it opens clients), the key just reads its fields.
    from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection

__all__ = [
    "MAX_CONCURRENT_REQUESTS",
    "TICK_SECONDS",
    "JobCache",
    "SharedSource",
    "StreamUnavailable",
    "StreamUpdate",
    "live_cache",
    "stream_key",
    "watch_namespace",
]

T = TypeVar("T")

#: A heartbeat: an update at least this often, though nothing changed. Late joiners and deadlines do not need it
#: (:func:`live_cache`, the sources' own timers); it retries a fetch that failed.
TICK_SECONDS: Final = 30.0
#: How long a change waits for others to share its broadcast.
BATCH_SECONDS: Final = 0.05
#: The least time between two updates of a shared stream: each wakes every trigger of the stream, so at 1,000 jobs
#: ending together this bounds the wake-ups to 4,000 a second, and adds at most this much to seeing a job's end.
BROADCAST_GAP: Final = 0.25
#: Requests the triggers of one stream may have in flight at once (log reads, deletes, the stream's own GETs); the
#: client's pool (100 connections) keeps the rest for the watches, so log reads never starve them.
MAX_CONCURRENT_REQUESTS: Final = 8
#: Seconds a trigger waits for the stream to know its job before it polls on its own.
UNKNOWN_SECONDS: Final = 60.0
#: How long the server keeps one watch open; resumed from the last version afterwards (jittered, as informers do).
WATCH_SECONDS: Final = 290
#: Backoff after a failed list or watch: 1, 2, 4... seconds, capped, jittered.
BACKOFF_MAX: Final = 30.0


class StreamUnavailable(Exception):
    """The stream cannot list or watch (401/403): the triggers poll on their own."""


def stream_key(namespace: str, connection: ClusterConnection) -> tuple[str, str, str]:
    """The shared-stream key: triggers with equal connection settings and namespace share one watch.

    A digest, not the settings: the triggerer logs keys, and the extras or config dict may carry a token.
    """
    settings = {
        "conn_id": connection.conn_id,
        "extras": connection.extras,
        "config": connection.config_dict,
        "context": connection.context,
        "in_cluster": connection.in_cluster,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return ("torchelastic-watch", namespace, digest)


@dataclass(frozen=True)
class StreamUpdate:
    """What the stream broadcasts: its cache, and which jobs changed since the last update (``None``: maybe all)."""

    cache: JobCache
    changed: frozenset[str] | None


def _version(obj: Mapping[str, Any]) -> int:
    # Opaque by contract, but etcd's revisions, compared only to keep the newer of a GET and a watch event.
    try:
        return int(obj.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


#: Bounds of a stream's record of jobs confirmed gone (:meth:`JobCache.gone`).
MAX_ABSENT: Final = 10_000
ABSENT_SECONDS: Final = 3600.0


class JobCache:
    """The stream's view of one namespace: the provider's jobs by kind and name, and their pods by job.

    Written only by the stream; read by the triggers without I/O. ``kube`` is the stream's client (an
    :class:`~.client.AsyncKube`), through which :meth:`request` runs the triggers' own calls.
    """

    def __init__(self, namespace: str, kube: Any, *, job: str | None = None) -> None:
        self.namespace = namespace
        self.kube = kube
        #: The one job a private stream watches (:func:`~.watch_scope.job_scope`): every change is its change.
        self.job = job
        self.objects: dict[str, dict[str, dict[str, Any]]] = {}  # kind -> name -> object
        self.synced: set[str] = set()  # kinds listed at least once
        self.kinds: tuple[str, ...] = ()
        #: (kind, name) the API confirmed gone, oldest first: at most MAX_ABSENT, each for ABSENT_SECONDS (a trigger
        #: of a deleted job reads it within seconds; a stream that runs for months must not keep every name).
        self.absent: dict[tuple[str, str], float] = {}
        self.unwatched: set[tuple[str, str]] = set()  # exists, but without the label: the watch cannot see it
        self.wanted: set[tuple[str, str]] = set()
        self.closed = False
        self._requests = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)
        self._changed: set[str] = set()
        self._all_changed = False
        self._wake = asyncio.Event()

    # -- read by the triggers (no I/O) --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self.kinds) and self.synced >= set(self.kinds)

    def knows(self, ref: JobRef) -> bool:
        """Whether the cache can answer for this job: it is there, or known to be gone."""
        key = (ref.kind, ref.name)
        return self.ready and (ref.name in self.objects.get(ref.kind, {}) or key in self.absent)

    def watches(self, ref: JobRef) -> bool:
        return ref.kind in self.kinds and (ref.kind, ref.name) not in self.unwatched

    def snapshot(self, ref: JobRef) -> Snapshot:
        job = self.objects.get(ref.kind, {}).get(ref.name)
        descriptor = kinds.get(ref.kind)
        pods: Sequence[Mapping[str, Any]] = ()
        if job is not None and descriptor.pod_owner_label is not None:
            # The kind's one answer over the cache: the pods its selector would list, that the job controls (through
            # the objects in between, which only a private stream of a kind that has them watches).
            keys = [intermediate_key(query) for query in descriptor.intermediates]
            owners = [owner for key in keys for owner in self.objects.get(key, {}).values()]
            pods = descriptor.pods_of(ref.name).pick(job, self.objects.get("Pod", {}).values(), owners)
        return Snapshot(job=job, pods=pods, now=time.time())

    def want(self, ref: JobRef) -> None:
        """Ask the stream to fetch a job it has not seen (created just before its trigger joined)."""
        if (ref.kind, ref.name) not in self.wanted:
            self.wanted.add((ref.kind, ref.name))
            self._wake.set()

    async def request(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A trigger's own call through the stream's client, at most :data:`MAX_CONCURRENT_REQUESTS` at once."""
        if self.closed:
            raise KubeError(0, "StreamClosed", "the shared watch's client is closed")
        async with self._requests:
            return await call()

    # -- written by the stream --------------------------------------------------------------------------------

    def _mark(self, names: set[str] | None) -> None:
        if names is None:
            self._all_changed = True
        else:
            self._changed |= names
        self._wake.set()

    def _owner(self, kind: str, obj: Mapping[str, Any]) -> str:
        """The job a Pod event concerns (its own name for a bare Pod job, else its owner label)."""
        meta = obj.get("metadata", {})
        if self.job is not None:
            return self.job
        if kind != "Pod":
            return str(meta.get("name", ""))
        owner = kinds.owner_of_pod(obj)
        return owner[1] if owner is not None else str(meta.get("name", ""))

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        """A (re)list: the whole set of objects of ``kind`` as of the list's version."""
        self.objects[kind] = {item["metadata"]["name"]: item for item in items}
        for item in items:
            self.absent.pop((kind, item["metadata"]["name"]), None)
        self.synced.add(kind)
        self._mark(None)

    def apply(self, kind: str, event_type: str, obj: dict[str, Any]) -> None:
        name = obj.get("metadata", {}).get("name")
        if not name:
            return
        store = self.objects.setdefault(kind, {})
        if event_type == "DELETED":
            store.pop(name, None)
            self.gone(kind, name)
        else:
            current = store.get(name)
            if current is not None and _version(current) > _version(obj):
                return  # an older copy (a GET that raced the watch)
            store[name] = obj
            self.absent.pop((kind, name), None)
            self.unwatched.discard((kind, name))
        self._mark({self._owner(kind, obj)})

    def gone(self, kind: str, name: str, *, now: float | None = None) -> None:
        """Record that the API confirmed ``kind``/``name`` gone, forgetting the oldest and the stale records."""
        now = time.monotonic() if now is None else now
        self.absent.pop((kind, name), None)
        self.absent[(kind, name)] = now
        while self.absent:
            oldest, since = next(iter(self.absent.items()))
            if len(self.absent) <= MAX_ABSENT and now - since < ABSENT_SECONDS:
                break
            del self.absent[oldest]

    def take_changes(self) -> frozenset[str] | None:
        changed: frozenset[str] | None = None if self._all_changed else frozenset(self._changed)
        self._changed, self._all_changed = set(), False
        self._wake.clear()
        return changed


async def _backoff(attempt: int) -> None:
    await asyncio.sleep(random.uniform(0.5, 1.0) * min(BACKOFF_MAX, 2.0 ** min(attempt, 6)))


async def _list_and_watch(cache: JobCache, watched: Watched) -> None:
    """Keep ``cache`` current for one kind, forever; raises :class:`StreamUnavailable` on 401/403."""
    kind, selectors = watched.key, {"label_selector": watched.label_selector, "field_selector": watched.field_selector}
    version: str | None = None
    failures = 0
    while True:
        try:
            if version is None:
                doc = await cache.kube.send(calls.list_objects(watched.resource, cache.namespace, **selectors))
                cache.replace(kind, list(doc.get("items") or []))
                version = str(doc.get("metadata", {}).get("resourceVersion", ""))
            timeout = int(WATCH_SECONDS * random.uniform(0.9, 1.1))
            watch = calls.watch_objects(watched.resource, cache.namespace, version, timeout, **selectors)
            async for event in cache.kube.stream(watch):
                event_type, obj = event.get("type"), event.get("object") or {}
                if event_type == "ERROR":
                    if obj.get("code") == 410:
                        version = None  # too old for the watch cache: relist
                        break
                    raise KubeError(int(obj.get("code") or 0), str(obj.get("reason", "")), str(obj.get("message")))
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                if event_type != "BOOKMARK":
                    cache.apply(kind, str(event_type), obj)
                failures = 0
        except KubeError as e:
            if e.status in (401, 403):
                raise StreamUnavailable(f"cannot list/watch {kind} in {cache.namespace}: {e}") from e
            if e.status == 410:
                version = None
                continue
            if e.status == 404 and version is None:
                # A registered kind whose CRD this cluster does not serve: there are none of it; look again later.
                cache.replace(kind, [])
                await asyncio.sleep(BACKOFF_MAX)
                continue
            failures += 1
            await _backoff(failures)
            if failures >= 3:
                version = None  # a long outage: relist rather than trust a version the server may have dropped


async def _fetch_wanted(cache: JobCache) -> None:
    """GET the jobs that triggers asked for and the watch has not delivered (a job created a moment ago)."""
    for kind, name in sorted(cache.wanted):
        if cache.knows(JobRef(kind=kind, name=name, namespace=cache.namespace)):
            cache.wanted.discard((kind, name))
            continue
        try:
            obj = await cache.request(functools.partial(cache.kube.send, calls.get(kind, name, cache.namespace)))
        except KubeError:
            continue  # asked again on the next tick
        cache.wanted.discard((kind, name))
        if obj is None:
            if name not in cache.objects.get(kind, {}):
                cache.gone(kind, name)
        else:
            cache.apply(kind, "ADDED", obj)
            labels = obj.get("metadata", {}).get("labels") or {}
            if cache.job is None and labels.get(LABEL_MANAGED_BY) != MANAGED_BY:  # a job's own stream: by name
                cache.unwatched.add((kind, name))  # the watch will never update it: its trigger must poll
        cache._mark({name})


#: The cache of each live shared stream, by its key: what a trigger reads before its first update.
_LIVE: dict[Hashable, JobCache] = {}


def live_cache(key: Hashable) -> JobCache | None:
    """The cache of the live stream of ``key`` (:func:`stream_key`), if one runs in this process."""
    cache = _LIVE.get(key)
    return cache if cache is not None and not cache.closed else None


async def watch_namespace(
    kube: Any, namespace: str, *, job: JobRef | None = None, key: Hashable | None = None
) -> AsyncGenerator[StreamUpdate, None]:
    """The shared stream: yields an update on every change (at most one per :data:`BROADCAST_GAP`) and at least
    every :data:`TICK_SECONDS`, forever.

    ``kube`` is an :class:`~.client.AsyncKube`; it is used only here and through :meth:`JobCache.request`. ``job``
    makes it a private stream of that one job (one subscriber: no gap between updates). ``key``: the stream is
    found by :func:`live_cache` while it runs.
    """
    cache = JobCache(namespace, kube, job=job.name if job is not None else None)
    scope = namespace_scope() if job is None else job_scope(job)
    cache.kinds = tuple(sorted(watched.key for watched in scope))
    gap = BROADCAST_GAP if job is None else 0.0
    watchers = [
        asyncio.create_task(_list_and_watch(cache, watched), name=f"torchelastic-watch-{watched.key}")
        for watched in scope
    ]
    for task in watchers:
        task.add_done_callback(lambda _: cache._wake.set())  # a watcher only ends by failing: say so at once
    fetcher: asyncio.Task[None] | None = None
    if key is not None:
        _LIVE[key] = cache
    loop = asyncio.get_running_loop()
    last = -gap
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cache._wake.wait(), TICK_SECONDS)
            if cache._wake.is_set():
                # Gather what else arrives in the next moment into the same update: every update wakes every
                # trigger of the stream, so a burst of events (hundreds of jobs ending) costs a few broadcasts.
                await asyncio.sleep(max(BATCH_SECONDS, last + gap - loop.time()))
            for task in watchers:
                if task.done():
                    task.result()  # raises what ended it (StreamUnavailable); a watcher never returns
            if cache.wanted and cache.ready and (fetcher is None or fetcher.done()):
                fetcher = asyncio.create_task(_fetch_wanted(cache))
            last = loop.time()
            yield StreamUpdate(cache=cache, changed=cache.take_changes())
    finally:
        cache.closed = True
        if key is not None and _LIVE.get(key) is cache:
            del _LIVE[key]
        for task in [*watchers, *([fetcher] if fetcher else [])]:
            task.cancel()
        for task in [*watchers, *([fetcher] if fetcher else [])]:
            with contextlib.suppress(BaseException):
                await task


class SharedSource:
    """An :class:`~requests.AsyncJobSource` fed by a shared stream, polling on its own once the stream fails it.

    ``updates`` is the trigger's subscription; ``direct`` opens a client of the trigger's own (an
    :class:`~.client.AsyncKube`) when it must poll. ``say`` is the trigger's log. ``key`` (:func:`stream_key`) finds
    the live stream's cache before the first update comes.

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
                await asyncio.wait_for(self._updated.wait(), left)
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), seconds)
        self._dirty = False
        if self._failure is not None and self._direct is None:
            await self._fall_back(self._failure)
        if self._direct is not None and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(left)  # polling: the deadline is the poll's pace

    async def _through(self, call: Callable[[Any], Awaitable[T]], ref: JobRef | None = None) -> T:
        """``call`` on the stream's client while the stream lives (at most :data:`MAX_CONCURRENT_REQUESTS` at once),
        else on this trigger's own. With ``ref``: only while the stream watches that job."""
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

    async def pod_events(self, pod: str, namespace: str) -> list[dict[str, Any]]:
        return await self._through(lambda kube: kube.pod_events(pod, namespace))

    async def label_job(self, ref: JobRef, labels: Mapping[str, str]) -> None:
        await self._through(lambda kube: kube.label_job(ref, labels), ref)

    async def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return await self._through(lambda kube: kube.workloads(namespace, job_uid))
