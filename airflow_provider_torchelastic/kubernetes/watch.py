"""One list+watch per connection and namespace, shared by every trigger that waits there (Airflow 3.3 shared streams).

The triggerer runs :func:`watch_namespace` once per :func:`stream_key` (``open_shared_stream``) and broadcasts its
:class:`StreamUpdate` s to the triggers of that key. Each trigger keeps driving the one wait core
(:func:`~wait.wait_for_job`); only its :class:`~requests.AsyncJobSource` changes: a
:class:`~.shared_source.SharedSource` answers "what does the job look like now" from the stream's :class:`JobCache`
and sleeps until the stream says that the job changed. So there is no second state machine, and deciding needs no
request. The worker's synchronous wait runs the same stream for its one job in a private event loop
(``watch_namespace(job=...)``, :mod:`~.worker_wait`).

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
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import calls, kinds
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot
from airflow_provider_torchelastic.kubernetes.watch_scope import (
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
    "StreamUnavailable",
    "StreamUpdate",
    "live_cache",
    "stream_key",
    "watch_namespace",
]

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
        #: Pods by the label that files them under their job (each kind's ``pod_owner_label``) and its value: a
        #: trigger's snapshot reads its job's few pods, not every pod of the namespace (1,000 triggers each
        #: scanning 1,000 pods was the stream's main cost).
        self._owning_kinds = tuple(k for k in kinds.registered() if k.pod_owner_label)
        self._pods_by_owner: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}

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
        label = descriptor.pod_owner_label
        if job is not None and label is not None:
            # The kind's one answer over the cache: the pods its selector would list, that the job controls (through
            # the objects in between, which only a private stream of a kind that has them watches).
            keys = [intermediate_key(query) for query in descriptor.intermediates]
            owners = [owner for key in keys for owner in self.objects.get(key, {}).values()]
            pods_of = descriptor.pods_of(ref.name)
            candidates: Iterable[Mapping[str, Any]] = self.objects.get("Pod", {}).values()
            if pods_of.labels.get(label) == ref.name:  # the selector asks for the label the index files pods by
                candidates = self._pods_by_owner.get((label, ref.name), {}).values()
            pods = pods_of.pick(job, candidates, owners)
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

    def _file_pod(self, name: str, old: Mapping[str, Any] | None, new: dict[str, Any] | None) -> None:
        """Keep :attr:`_pods_by_owner` in step with a pod that changed from ``old`` to ``new`` (None: absent)."""
        for kind in self._owning_kinds:
            key = str(kind.pod_owner_label)
            was = kind.owner_of(old) if old is not None else None
            now = kind.owner_of(new) if new is not None else None
            if was is not None and was != now and (bucket := self._pods_by_owner.get((key, was))) is not None:
                bucket.pop(name, None)
                if not bucket:
                    del self._pods_by_owner[(key, was)]
            if now is not None and new is not None:
                self._pods_by_owner.setdefault((key, now), {})[name] = new

    def replace(self, kind: str, items: list[dict[str, Any]]) -> None:
        """A (re)list: the whole set of objects of ``kind`` as of the list's version."""
        self.objects[kind] = {item["metadata"]["name"]: item for item in items}
        if kind == "Pod":
            self._pods_by_owner = {}
            for name, pod in self.objects[kind].items():
                self._file_pod(name, None, pod)
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
            old = store.pop(name, None)
            if kind == "Pod":
                self._file_pod(name, old, None)
            self.gone(kind, name)
        else:
            current = store.get(name)
            if current is not None and _version(current) > _version(obj):
                return  # an older copy (a GET that raced the watch)
            store[name] = obj
            if kind == "Pod":
                self._file_pod(name, current, obj)
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
