"""The trigger that waits for a PyTorchJob (or the single Pod) while the task is deferred.

It drives the same wait core (:func:`~.kubernetes.wait.wait_for_job`) as the worker does with
``deferrable=False``, deadline, clean-up and all; only the I/O is async, and in the triggerer it comes from one
watch per connection and namespace shared by all triggers there (:mod:`~.kubernetes.watch`).
Its arguments are one frozen dataclass, so
``serialize()`` cannot drift from ``__init__`` (an argument it does not know is refused, not dropped), and they carry
the connection as resolved on the worker (the triggerer needs no connection).

Its one event is typed too: :class:`JobEnded` or :class:`WaitFailed`, sent as a plain JSON dict
(:meth:`~JobEnded.to_payload`) and read back by ``execute_complete`` with :func:`event_from_payload`, which also reads
every event written before these classes existed (the format is the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Final, TypeAlias

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_provider_torchelastic.core.redaction import redact_value, redacting
from airflow_provider_torchelastic.core.validation import short_repr
from airflow_provider_torchelastic.hooks import async_hook
from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection
from airflow_provider_torchelastic.kubernetes.queue_limits import QueueLimits
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, WaitDecision, WaitPolicy

__all__ = [
    "EVENT_DONE",
    "EVENT_ERROR",
    "JobEnded",
    "TorchElasticJobTrigger",
    "TriggerOutcome",
    "WaitFailed",
    "WatchArgs",
    "event_from_payload",
    "event_hold",
]

#: ``payload["status"]``: the job ended (:class:`JobEnded`), or waiting failed (:class:`WaitFailed`).
EVENT_DONE: Final = "done"
EVENT_ERROR: Final = "error"


@dataclass(frozen=True)
class JobEnded:
    """The wait came to its decision: the job ended, or the wait ended it (deadline, a job it could not observe).

    The payload is ``{"status": "done", **decision.to_event()}``.
    """

    decision: WaitDecision

    def to_payload(self) -> dict[str, Any]:
        return {"status": EVENT_DONE, **self.decision.to_event()}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> JobEnded:
        if isinstance(payload, Mapping) and payload.get("status") == EVENT_ERROR:
            raise ValueError(f"JobEnded: expected a {EVENT_DONE!r} event, got an {EVENT_ERROR!r} one")
        return cls(WaitDecision.from_event(payload))


@dataclass(frozen=True)
class WaitFailed:
    """Waiting could not even start (no usable connection, say): the worker stops the job and fails the task.

    The payload is ``{"status": "error", "message": message}``.
    """

    message: str

    def to_payload(self) -> dict[str, Any]:
        return {"status": EVENT_ERROR, "message": self.message}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> WaitFailed:
        status = payload.get("status") if isinstance(payload, Mapping) else None
        if status != EVENT_ERROR:
            raise ValueError(f"WaitFailed: expected an {EVENT_ERROR!r} event, got {short_repr(status)}")
        message = payload.get("message")
        # Never str() of what a row holds: a structure nested 2000 deep makes it raise RecursionError.
        return cls(message=message if isinstance(message, str) else short_repr(message))


TriggerOutcome: TypeAlias = JobEnded | WaitFailed


def event_from_payload(payload: Mapping[str, Any]) -> TriggerOutcome:
    """The event a :class:`TorchElasticJobTrigger` fired, from its payload (a plain dict, as Airflow hands it on).

    An ``"error"`` status is a :class:`WaitFailed`; anything else is read as a :class:`JobEnded`, as
    ``execute_complete`` has always read it. ``ValueError``, and nothing else, for a payload that is neither.
    """
    if not isinstance(payload, Mapping):
        raise ValueError(f"a trigger event: expected an object, got {type(payload).__name__}")
    if payload.get("status") == EVENT_ERROR:
        return WaitFailed.from_payload(payload)
    return JobEnded.from_payload(payload)


@dataclass(frozen=True, kw_only=True)
class WatchArgs:
    """Everything the trigger needs, JSON-serializable."""

    kind: str
    name: str
    namespace: str
    kubernetes_conn_id: str | None = None
    connection_extras: Mapping[str, Any] | None = None
    config_dict: Mapping[str, Any] | None = None
    cluster_context: str | None = None
    in_cluster: bool | None = None
    poll_interval: float = 10.0
    pending_grace_seconds: float = 120.0
    #: Seconds a pod may keep failing to pull its image for reasons that may pass (``image_pull_timeout``).
    image_pull_timeout: float = 600.0
    log_pods: int = 8
    #: Delete the job when a user kills the deferred task (mark failed / clear), unless it has finished.
    delete_on_kill: bool = True
    #: Unix time by which the task must end (its ``execution_timeout``); the trigger then deletes the job and
    #: fails the task. Airflow does not enforce ``execution_timeout`` while a task is deferred.
    deadline: float | None = None
    #: What the trigger does with the job once it ended (``on_finish_action``).
    finish_action: str = WaitPolicy.finish_action
    #: Seconds the job may wait for capacity (``scheduling_timeout``); None: until the deadline.
    scheduling_timeout: float | None = None
    #: Unix time of the deferral, and the seconds after it before the event may fire (``[torch_elastic]
    #: early_event_hold``): a trigger that fires while the scheduler has not yet processed the deferral can lose the
    #: try (:func:`event_hold`). None (rows written before these existed): no hold.
    deferred_at: float | None = None
    early_event_hold: float = 0.0
    #: The try's secret values (its sensitive env entries): the triggerer's log lines and the event never show them
    #: (the worker's masker does not run here). A trigger row's kwargs are encrypted in the metadata database.
    mask: Sequence[str] = ()
    #: The job's lease (``[torch_elastic] job_lease``), renewed while the trigger waits, for a try without a
    #: deadline; None: nothing to renew.
    lease_seconds: float | None = None
    #: The Kueue limits (:class:`~.kubernetes.queue_limits.QueueLimits`): ``max_preemptions``, and the task
    #: instance's preemptions in earlier tries.
    max_preemptions: int | None = None
    preemptions_before: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask", tuple(self.mask))  # a list once read back from a trigger row
        # One source of cluster settings, refused when the trigger is built (at submit), not when the wait starts.
        try:
            _ = self.connection
        except ValueError as e:
            raise ValueError(f"TorchElasticJobTrigger: {e}") from e

    @property
    def connection(self) -> ClusterConnection:
        """The cluster's settings, as the worker resolved them (the row keeps them as flat fields)."""
        return ClusterConnection(**{theirs: getattr(self, ours) for ours, theirs in _CONNECTION_FIELDS.items()})

    @property
    def policy(self) -> WaitPolicy:
        return WaitPolicy(**{name: getattr(self, name) for name in _POLICY_FIELDS})

    @property
    def limits(self) -> QueueLimits:
        return QueueLimits(**{name: getattr(self, name) for name in _LIMITS_FIELDS})

    @property
    def ref(self) -> JobRef:
        return JobRef(kind=self.kind, name=self.name, namespace=self.namespace)

    @classmethod
    def for_wait(
        cls, ref: JobRef, connection: ClusterConnection, policy: WaitPolicy, limits: QueueLimits, **rest: Any
    ) -> WatchArgs:
        """The arguments that wait for ``ref`` as the worker would: the inverse of :attr:`connection`,
        :attr:`policy` and :attr:`limits` (``progress_interval`` stays the trigger's default). ``rest``: the other
        fields (``deferred_at``, ``early_event_hold``, ``mask``)."""
        return cls(
            kind=ref.kind,
            name=ref.name,
            namespace=ref.namespace,
            **{ours: getattr(connection, theirs) for ours, theirs in _CONNECTION_FIELDS.items()},
            **{name: getattr(policy, name) for name in _POLICY_FIELDS},
            **{name: getattr(limits, name) for name in _LIMITS_FIELDS},
            **rest,
        )


#: Which fields of :class:`WatchArgs` are the cluster's settings (by their name in :class:`ClusterConnection`), the
#: wait's policy and its Kueue limits: a row keeps them flat, the wait reads them as those objects.
_CONNECTION_FIELDS: Final = {
    "kubernetes_conn_id": "conn_id",
    "connection_extras": "extras",
    "config_dict": "config_dict",
    "cluster_context": "context",
    "in_cluster": "in_cluster",
}
_POLICY_FIELDS: Final = (
    "poll_interval",
    "pending_grace_seconds",
    "image_pull_timeout",
    "log_pods",
    "deadline",
    "finish_action",
    "scheduling_timeout",
    "lease_seconds",
)
_LIMITS_FIELDS: Final = ("max_preemptions", "preemptions_before")

#: The trigger's arguments: the fields of :class:`WatchArgs`, which is what a trigger row holds (``serialize()``).
_KNOWN_ARGS: Final = frozenset(f.name for f in fields(WatchArgs))
#: Fields added after the first release: left out of a row at their default.
_ADDED_LATER: Final = (
    "deferred_at",
    "early_event_hold",
    "mask",
    "lease_seconds",
    "image_pull_timeout",
    "max_preemptions",
    "preemptions_before",
)
_DEFAULTS: Final = {f.name: f.default for f in fields(WatchArgs) if f.name in _ADDED_LATER}
#: Fields removed since, which rows written before still hold: read and dropped. ``extra`` (always ``{}``) was never
#: read by anything.
_REMOVED: Final = frozenset({"extra"})


def event_hold(deferred_at: float | None, hold: float, now: float) -> float:
    """Seconds to hold a ready event back: until ``hold`` seconds after the deferral, never more than ``hold`` (a
    triggerer whose clock runs behind the worker's must not wait longer).

    Why: Airflow 3.3's scheduler checks an executor's report of a try against the try's state. A trigger that fired
    before the scheduler processed the report of the deferral finds the try QUEUED or RUNNING again, and the
    scheduler then fails it for a state mismatch (apache/airflow#67287, #72716; only SCHEDULED is guarded).
    """
    if deferred_at is None or hold <= 0:
        return 0.0
    return max(0.0, min(hold, deferred_at + hold - now))


def _redacted_event(payload: dict[str, Any], secrets: Sequence[str]) -> dict[str, Any]:
    """The event with the try's secrets out of its texts (progress, messages, pods' log tails and termination
    messages); rank 0's result stays as the training code returned it."""
    if not secrets:
        return payload
    verdict = payload.get("verdict")
    result = verdict.get("result") if isinstance(verdict, dict) else None
    redacted: dict[str, Any] = redact_value(payload, secrets)
    if isinstance(redacted.get("verdict"), dict) and "result" in redacted["verdict"]:
        redacted["verdict"]["result"] = result
    return redacted


def _watch_args(kwargs: Mapping[str, Any]) -> WatchArgs:
    """The trigger's arguments; a key that :class:`WatchArgs` lacks is refused (Airflow then fails the trigger),
    not dropped, so that an argument never goes silently unheeded."""
    unknown = sorted(set(kwargs) - _KNOWN_ARGS - _REMOVED)
    if unknown:
        raise TypeError(
            f"TorchElasticJobTrigger: unknown argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; expected some of {', '.join(sorted(_KNOWN_ARGS))}"
        )
    return WatchArgs(**{name: value for name, value in kwargs.items() if name not in _REMOVED})


class TorchElasticJobTrigger(BaseEventTrigger):
    """Fires once, when the job ended (or waiting for it failed).

    In the triggerer, every trigger of one connection and namespace shares one list+watch
    (:mod:`~.kubernetes.watch`): :meth:`filter_shared_stream` drives the wait core from the
    shared cache. :meth:`run` (``dag.test()``, which runs triggers in-process, or a triggerer without shared
    streams) polls the API on its own, with the same wait core.
    """

    #: A deferred task's trigger (BaseEventTrigger turns this off for asset watchers): honour ``trigger_queue``.
    supports_triggerer_queue = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        self.args = _watch_args(kwargs)
        #: Set once the job's decision was reached: a kill after that has nothing to stop.
        self._finished = False

    @classmethod
    def for_job(cls, args: WatchArgs) -> TorchElasticJobTrigger:
        """The trigger for ``args`` (what the operator defers with); ``cls(**kwargs)`` is the triggerer's way."""
        return cls(**asdict(args))

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs = asdict(self.args)
        # A row written before a field existed serializes back as it was: the field is left out at its default.
        for name in _ADDED_LATER:
            if kwargs[name] == _DEFAULTS[name]:
                del kwargs[name]
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    def _hook(self) -> Any:
        return async_hook(self.args.connection)

    def _emit(self, line: str) -> None:
        """The one place where the trigger writes to the task log (progress, pods' log lines, fallbacks)."""
        self.log.info(line)

    def shared_stream_key(self) -> tuple[str, str, str]:
        from airflow_provider_torchelastic.kubernetes.watch import stream_key

        return stream_key(self.args.namespace, self.args.connection)

    @classmethod
    async def open_shared_stream(cls, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        """One client and one list+watch for the namespace; only the key's fields (connection, namespace) count."""
        from airflow_provider_torchelastic.kubernetes.client import AsyncKube
        from airflow_provider_torchelastic.kubernetes.watch import stream_key, watch_namespace

        args = _watch_args(kwargs)
        key = stream_key(args.namespace, args.connection)
        async with async_hook(args.connection).get_conn() as api:
            async for update in watch_namespace(AsyncKube(api), args.namespace, key=key):
                yield update

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        async for event in self._wait(shared_stream):
            yield event

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in self._wait(None):
            yield event

    async def _wait(self, updates: AsyncIterator[Any] | None) -> AsyncIterator[TriggerEvent]:
        from airflow_provider_torchelastic.core.tap import MetricsTap
        from airflow_provider_torchelastic.kubernetes.client import AsyncKube
        from airflow_provider_torchelastic.kubernetes.shared_source import CLOSE_SECONDS, SharedSource, close_within
        from airflow_provider_torchelastic.kubernetes.wait import drive_async, wait_for_job

        args = self.args
        # Rank 0's metrics lines become progress lines here too; what the tap kept travels in the event, so that
        # execute_complete ends the task log with the last values and saves them in the job summary.
        tap = MetricsTap(self._emit)
        log = redacting(tap, args.mask)  # before the tap keeps a line for the summary
        stack = contextlib.AsyncExitStack()
        try:
            try:

                async def direct() -> AsyncKube:
                    return AsyncKube(await stack.enter_async_context(self._hook().get_conn()))

                flow = wait_for_job(args.ref, args.policy, args.limits)
                hold: Callable[[float], Awaitable[None]] = asyncio.sleep
                if updates is None:
                    decision = await drive_async(flow, await direct(), log)
                else:
                    source = SharedSource(updates, direct, log, key=self.shared_stream_key())
                    stack.push_async_callback(source.leave)
                    sleep = functools.partial(source.sleep_until_changed, args.ref)
                    decision = await drive_async(flow, source, log, sleep=sleep)
                    hold = source.hold  # keeps taking the subscription's updates: a stalled subscriber overflows
                self._finished = True
                await self._hold_early_event(hold)
            finally:
                # As in the worker's wait: a client whose close never returns must not keep the event from the task.
                if not await close_within(stack, CLOSE_SECONDS):
                    self._emit(f"The trigger's client did not close within {CLOSE_SECONDS:g} s; left behind")
        except Exception as e:  # not reached through the wait core (e.g. no usable connection): the worker says so
            self.log.exception("Waiting for %s %s failed", args.kind, args.name)
            await self._hold_early_event(asyncio.sleep)
            yield TriggerEvent(WaitFailed(f"{type(e).__name__}: {e}").to_payload())
            return
        decision = dataclasses.replace(decision, metrics=tap.to_json())
        yield TriggerEvent(_redacted_event(JobEnded(decision).to_payload(), args.mask))

    async def _hold_early_event(self, hold: Callable[[float], Awaitable[None]]) -> None:
        seconds = event_hold(self.args.deferred_at, self.args.early_event_hold, time.time())
        if seconds > 0:
            self._emit(
                f"{self.args.kind} {self.args.name} ended within {self.args.early_event_hold:g} s of the deferral: "
                f"holding the event {seconds:.1f} s, until the scheduler has seen the deferral ([torch_elastic] "
                "early_event_hold)"
            )
            await hold(seconds)

    async def on_kill(self) -> None:
        """A user marked the deferred task failed or cleared it: the job must not keep the GPUs.

        Airflow 3.3's triggerer calls this only on such a user action, never on a restart or a timeout. A job that
        has finished is left alone: a stale trigger (one left behind by ``airflow dags test``, say) cancelled long
        after its job ended must not delete a job that ``on_finish_action="keep"`` kept.
        """
        if not self.args.delete_on_kill or self._finished:
            return
        from airflow_provider_torchelastic.kubernetes.client import AsyncKube
        from airflow_provider_torchelastic.kubernetes.wait import drive_async, stop_job

        async with self._hook().get_conn() as api:
            await drive_async(stop_job(self.args.ref), AsyncKube(api), self._emit)
