"""The trigger's events and arguments as data: typed events sent as plain dicts, and arguments that refuse what they
do not know, yet read every trigger row and event that the code before them wrote (in flight across an upgrade)."""

from __future__ import annotations

import asyncio
import datetime
import json
from typing import Any

import pytest
from airflow.sdk import DAG
from airflow.sdk.module_loading import import_string

from airflow_provider_torchelastic import TorchElasticOperator
from airflow_provider_torchelastic.core.summary import XCOM_KEY
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, WaitDecision
from airflow_provider_torchelastic.operators import InfrastructureError
from airflow_provider_torchelastic.operators.links import XCOM_JOB_KIND, XCOM_JOB_NAME, XCOM_JOB_NAMESPACE
from airflow_provider_torchelastic.triggers import (
    EVENT_DONE,
    EVENT_ERROR,
    JobEnded,
    TorchElasticJobTrigger,
    WaitFailed,
    WatchArgs,
    event_from_payload,
    event_hold,
)

# What the code before typed events wrote, frozen here as it was: a trigger row (classpath and kwargs, the
# ``asdict(WatchArgs)`` of that code), a "done" event and an "error" event. Never regenerate these from the code.
OLD_CLASSPATH = "airflow_provider_torchelastic.triggers.TorchElasticJobTrigger"
OLD_KWARGS: dict[str, Any] = {
    "kind": "PyTorchJob",
    "name": "train-abc",
    "namespace": "ml",
    "kubernetes_conn_id": "kubernetes_default",
    "connection_extras": {"namespace": "ml"},
    "config_dict": None,
    "cluster_context": None,
    "in_cluster": None,
    "poll_interval": 10.0,
    "pending_grace_seconds": 120.0,
    "log_pods": 8,
    "delete_on_kill": True,
    "deadline": 1900000000.0,
    "finish_action": "delete_succeeded",
    "scheduling_timeout": 600.0,
    "extra": {},
}
OLD_DONE_EVENT: dict[str, Any] = {
    "status": "done",
    "phase": "succeeded",
    "progress": "Pod train-abc: Succeeded; pods running 0/1; elapsed 1m30s",
    "verdict": {
        "succeeded": True,
        "result": [1, 2],
        "result_ref": None,
        "recoverable": False,
        "node": "train-abc",
        "failure": None,
        "detail": "",
    },
    "pods": [
        {
            "name": "train-abc",
            "replica_type": "pod",
            "replica_index": 0,
            "ranks": [0],
            "phase": "Succeeded",
            "node": None,
            "restarts": 0,
            "reason": "Completed",
            "message": "",
            "exit_code": 0,
            "log_tail": "",
        }
    ],
    "created": 1800000000.0,
    "metrics": None,
}
OLD_ERROR_EVENT: dict[str, Any] = {"status": "error", "message": "ValueError: no usable connection"}


# --- events -----------------------------------------------------------------------------------------------------------


def test_an_event_written_before_typed_events_reads_as_one() -> None:
    ended = event_from_payload(OLD_DONE_EVENT)
    assert isinstance(ended, JobEnded) and ended.decision.phase is Phase.SUCCEEDED
    assert ended.decision.verdict is not None and ended.decision.verdict.result == [1, 2]
    assert ended.decision.state is None  # not in events of that code; only the wait reads it
    assert event_from_payload(OLD_ERROR_EVENT) == WaitFailed("ValueError: no usable connection")


def test_typed_events_are_sent_in_the_same_format_as_before() -> None:
    ended = event_from_payload(OLD_DONE_EVENT)
    assert isinstance(ended, JobEnded)
    payload = ended.to_payload()
    # Keys added since, which older readers ignore: the wait's state, and the verdict's cause, exit code, reason and
    # preemptions seen.
    added = {"cause": "", "exit_code": None, "reason": "", "preemptions": 0}
    assert payload == {**OLD_DONE_EVENT, "state": None, "verdict": {**OLD_DONE_EVENT["verdict"], **added}}
    assert WaitFailed("ValueError: no usable connection").to_payload() == OLD_ERROR_EVENT
    assert (payload["status"], OLD_ERROR_EVENT["status"]) == (EVENT_DONE, EVENT_ERROR)


@pytest.mark.parametrize(
    "event",
    [
        JobEnded(WaitDecision(phase=Phase.RUNNING, progress="Pod x: Running; elapsed 0m05s", state="Pod x: Running")),
        JobEnded(WaitDecision(phase=Phase.FAILED, progress="Pod x is gone", metrics={"last": {"loss": 0.5}})),
        WaitFailed("RuntimeError: boom"),
    ],
    ids=["ended", "ended-with-metrics", "failed"],
)
def test_events_round_trip_through_json(event: JobEnded | WaitFailed) -> None:
    payload = json.loads(json.dumps(event.to_payload()))  # what the triggerer stores and the worker reads
    assert event_from_payload(payload) == event
    assert type(event).from_payload(payload) == event


def test_an_event_of_the_other_kind_is_refused_by_the_typed_reader() -> None:
    with pytest.raises(ValueError, match="expected a 'done' event"):
        JobEnded.from_payload(OLD_ERROR_EVENT)
    with pytest.raises(ValueError, match="expected an 'error' event"):
        WaitFailed.from_payload(OLD_DONE_EVENT)


def test_a_trigger_that_cannot_start_waiting_fires_wait_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_hook(self: TorchElasticJobTrigger) -> Any:
        raise RuntimeError("no cluster settings")

    monkeypatch.setattr(TorchElasticJobTrigger, "_hook", no_hook)
    trigger = TorchElasticJobTrigger(kind="Pod", name="x", namespace="ml")

    async def first_payload() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    payload = asyncio.run(first_payload())
    assert payload == {"status": "error", "message": "RuntimeError: no cluster settings"}
    assert event_from_payload(payload) == WaitFailed("RuntimeError: no cluster settings")


def test_a_client_whose_close_does_not_end_does_not_keep_the_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the worker's wait (test_worker_wait): the job is decided, then the client's close never returns."""
    import contextlib
    import threading
    from collections.abc import AsyncIterator

    from airflow_provider_torchelastic.kubernetes import shared_source, wait

    released = asyncio.Event()

    class StubbornHook:
        @contextlib.asynccontextmanager
        async def get_conn(self) -> AsyncIterator[object]:
            try:
                yield object()
            finally:
                while not released.is_set():  # a close that ignores cancellation as well, until the test ends
                    with contextlib.suppress(asyncio.CancelledError):
                        await released.wait()

    async def decided(flow: Any, source: Any, log: Any, **kwargs: Any) -> WaitDecision:
        return event_from_payload(OLD_DONE_EVENT).decision  # type: ignore[union-attr]

    monkeypatch.setattr(TorchElasticJobTrigger, "_hook", lambda self: StubbornHook())
    monkeypatch.setattr(wait, "drive_async", decided)
    monkeypatch.setattr(shared_source, "CLOSE_SECONDS", 0.2)
    trigger = TorchElasticJobTrigger(kind="Pod", name="train-abc", namespace="ml")
    lines: list[str] = []
    monkeypatch.setattr(trigger, "_emit", lines.append)

    async def first_payload() -> dict[str, Any]:
        try:
            async for event in trigger.run():
                return dict(event.payload)
            raise AssertionError("no event")
        finally:
            released.set()  # else asyncio.run would wait for the close it cancels at its end, for ever

    # In a thread of its own: without the bound, the trigger never ends (and neither would a loop that waits for it).
    payloads: list[dict[str, Any]] = []
    runner = threading.Thread(target=lambda: payloads.append(asyncio.run(first_payload())), daemon=True)
    runner.start()
    runner.join(30)
    assert payloads, "no event within 30 s: the close held it"
    payload = payloads[0]
    assert payload["status"] == "done" and payload["verdict"]["result"] == [1, 2]
    assert lines == ["The trigger's client did not close within 0.2 s; left behind"]


def test_an_early_event_is_held_until_the_hold_after_the_deferral_and_never_longer() -> None:
    assert event_hold(None, 10.0, 1000.0) == 0.0  # a row written before the hold existed
    assert event_hold(1000.0, 0.0, 1000.0) == 0.0  # turned off
    assert event_hold(1000.0, 10.0, 1003.0) == 7.0
    assert event_hold(1000.0, 10.0, 1030.0) == 0.0  # a job that ran longer than the hold is not held
    # The triggerer's clock runs a minute behind the worker's: still no more than the hold itself.
    assert event_hold(1000.0, 10.0, 940.0) == 10.0


def test_a_wait_failed_event_is_held_too(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_hook(self: TorchElasticJobTrigger) -> Any:
        raise RuntimeError("no cluster settings")

    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(TorchElasticJobTrigger, "_hook", no_hook)
    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    now = datetime.datetime.now().timestamp()
    trigger = TorchElasticJobTrigger(kind="Pod", name="x", namespace="ml", deferred_at=now, early_event_hold=10.0)

    async def first_payload() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    assert asyncio.run(first_payload())["status"] == "error"
    assert len(slept) == 1 and 9.0 < slept[0] <= 10.0, slept


def test_a_held_trigger_keeps_taking_its_shared_subscription() -> None:
    from airflow_provider_torchelastic.kubernetes.shared_source import SharedSource
    from airflow_provider_torchelastic.kubernetes.watch import JobCache, StreamUpdate

    taken: list[int] = []

    async def ticks() -> Any:
        cache = JobCache("ml", None)
        for i in range(1000):
            taken.append(i)
            await asyncio.sleep(0.01)
            yield StreamUpdate(cache=cache, changed=frozenset({f"other-{i}"}))

    async def no_direct() -> Any:
        raise AssertionError("a hold needs no client of its own")

    source = SharedSource(ticks(), no_direct, lambda line: None)
    asyncio.run(source.hold(0.3))
    assert len(taken) >= 10, "a held subscriber that stops reading would fill its queue"


def _pod_cache(*names: str) -> Any:
    from airflow_provider_torchelastic.kubernetes.watch import JobCache

    cache = JobCache("ml", None)
    cache.kinds, cache.synced = ("Pod",), {"Pod"}
    cache.objects["Pod"] = {name: {"metadata": {"name": name, "resourceVersion": "1"}} for name in names}
    return cache


def test_a_shared_source_wakes_for_its_own_job_only_and_keeps_its_deadline_without_updates() -> None:
    """Updates about other jobs do not end the sleep; one naming the job does, at once; with no update at all the
    deadline still holds (the stream's heartbeat is 30 s: the source keeps its own timer)."""
    from airflow_provider_torchelastic.kubernetes.shared_source import SharedSource
    from airflow_provider_torchelastic.kubernetes.watch import StreamUpdate

    cache = _pod_cache("mine", "other")
    updates: asyncio.Queue[StreamUpdate] = asyncio.Queue()

    async def subscription() -> Any:
        while True:
            yield await updates.get()

    async def no_direct() -> Any:
        raise AssertionError("the stream serves this job")

    async def scenario() -> tuple[float, float, float]:
        source = SharedSource(subscription(), no_direct, lambda line: None)
        ref = JobRef(kind="Pod", name="mine", namespace="ml")
        updates.put_nowait(StreamUpdate(cache=cache, changed=frozenset()))  # the first update (a heartbeat)
        await asyncio.wait_for(source.snapshot(ref), 0.5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await source.sleep_until_changed(ref, 0.3)  # nothing comes: the timer ends it
        quiet = loop.time() - started

        async def feed() -> None:
            for _ in range(5):
                await updates.put(StreamUpdate(cache=cache, changed=frozenset({"other"})))
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            await updates.put(StreamUpdate(cache=cache, changed=frozenset({"mine"})))

        started = loop.time()
        feeder = asyncio.create_task(feed())
        await source.sleep_until_changed(ref, 5.0)
        woken = loop.time() - started
        await feeder
        # A change that came while the wait was busy ends the next sleep at once.
        await updates.put(StreamUpdate(cache=cache, changed=frozenset({"mine"})))
        await asyncio.sleep(0.05)
        started = loop.time()
        await source.sleep_until_changed(ref, 5.0)
        pending = loop.time() - started
        await source.leave()
        return quiet, woken, pending

    quiet, woken, pending = asyncio.run(scenario())
    assert 0.25 <= quiet < 1.0, quiet
    assert 0.25 <= woken < 1.0, woken  # after the other jobs' updates (0.1 s) and the 0.2 s pause, not before
    assert pending < 0.05, pending


def test_a_late_joiner_reads_the_live_stream_at_once_and_a_failed_subscription_falls_back_once() -> None:
    """A trigger that joins finds the stream's cache by its key before any update; when its subscription fails (the
    triggerer's queue overflow), it says so once and polls on its own."""
    from airflow.triggers.shared_stream import _SubscriberOverflow

    from airflow_provider_torchelastic.kubernetes import watch
    from airflow_provider_torchelastic.kubernetes.shared_source import SharedSource
    from airflow_provider_torchelastic.kubernetes.wait_types import Snapshot

    key = ("torchelastic-watch", "ml", "test")
    said: list[str] = []
    ended = asyncio.Event()

    async def subscription() -> Any:
        await ended.wait()
        raise _SubscriberOverflow("queue full")
        yield  # an async generator

    class Direct:
        async def snapshot(self, ref: JobRef) -> Snapshot:
            return Snapshot(job=None, pods=(), now=0.0)

    async def direct() -> Any:
        return Direct()

    async def scenario() -> tuple[Any, Any]:
        watch._LIVE[key] = _pod_cache("mine")
        try:
            source = SharedSource(subscription(), direct, said.append, key=key)
            ref = JobRef(kind="Pod", name="mine", namespace="ml")
            first = await asyncio.wait_for(source.snapshot(ref), 0.5)
            ended.set()
            await source.sleep_until_changed(ref, 5.0)  # the failure ends the sleep: then it polls
            await source.sleep_until_changed(ref, 0.05)
            return first, await source.snapshot(ref)
        finally:
            del watch._LIVE[key]

    first, polled = asyncio.run(scenario())
    assert first.job is not None and first.job["metadata"]["name"] == "mine"
    assert polled.job is None  # from Direct
    assert len(said) == 1 and "_SubscriberOverflow" in said[0] and "polls the API on its own" in said[0], said


# --- execute_complete reads the events of both the code before and this one -----------------------------------------


class FakeTI:
    task_id = "train"
    map_index = -1
    start_date = None

    def __init__(self) -> None:
        self.xcoms = {XCOM_JOB_KIND: "Pod", XCOM_JOB_NAME: "train-abc", XCOM_JOB_NAMESPACE: "ml"}
        self.pushed: dict[str, Any] = {}

    def xcom_pull(self, *, task_ids: str, key: str, map_indexes: int) -> Any:
        return self.xcoms.get(key)

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def make_operator() -> TorchElasticOperator:
    with DAG("events_dag", schedule=None, start_date=datetime.datetime(2026, 1, 1)):
        return TorchElasticOperator(task_id="train", python_callable=print, image="registry.example.com/train:1")


@pytest.mark.parametrize("event", [OLD_DONE_EVENT, event_from_payload(OLD_DONE_EVENT).to_payload()], ids=["old", "new"])
def test_execute_complete_returns_rank0s_result_from_a_done_event(event: dict[str, Any]) -> None:
    ti = FakeTI()
    assert make_operator().execute_complete({"ti": ti}, json.loads(json.dumps(event))) == [1, 2]  # type: ignore[arg-type]
    assert ti.pushed[XCOM_KEY]["name"] == "train-abc" and ti.pushed[XCOM_KEY]["phase"] == "succeeded"


@pytest.mark.parametrize("event", [OLD_ERROR_EVENT, WaitFailed("ValueError: no usable connection").to_payload()])
def test_execute_complete_stops_the_job_and_fails_recoverably_on_an_error_event(
    event: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped: list[JobRef] = []
    from airflow_provider_torchelastic.operators.backends import kubernetes

    monkeypatch.setattr(kubernetes, "stop", lambda task, ref, kube=None: stopped.append(ref))
    with pytest.raises(InfrastructureError, match=r"Waiting for Pod ml/train-abc failed: ValueError: no usable"):
        make_operator().execute_complete({"ti": FakeTI()}, event)  # type: ignore[arg-type]
    assert stopped == [JobRef(kind="Pod", name="train-abc", namespace="ml")]


# --- arguments ------------------------------------------------------------------------------------------------------


def test_a_trigger_row_written_before_typed_events_inflates_as_the_triggerer_inflates_it() -> None:
    from airflow.models.trigger import Trigger
    from airflow.serialization.decoders import smart_decode_trigger_kwargs

    # The row as the metadata database holds it (Fernet-encrypted serde), read back as the TriggerRunner reads it.
    stored = Trigger(classpath=OLD_CLASSPATH, kwargs=OLD_KWARGS)
    kwargs = {k: smart_decode_trigger_kwargs(v) for k, v in Trigger._decrypt_kwargs(stored.encrypted_kwargs).items()}
    trigger = import_string(stored.classpath)(**kwargs)
    assert trigger.args == WatchArgs(
        kind="PyTorchJob",
        name="train-abc",
        namespace="ml",
        kubernetes_conn_id="kubernetes_default",
        connection_extras={"namespace": "ml"},
        deadline=1_900_000_000.0,
        scheduling_timeout=600.0,
    )
    # ... and serializes back as it was, less ``extra``: a field nothing read, since removed (an older provider
    # reading the row takes its default).
    assert trigger.serialize() == (OLD_CLASSPATH, {k: v for k, v in OLD_KWARGS.items() if k != "extra"})
    assert TorchElasticJobTrigger(**{**OLD_KWARGS, "extra": {"ignored": True}}).args == trigger.args


def test_the_operators_trigger_is_its_arguments() -> None:
    args = WatchArgs(kind="Pod", name="x", namespace="ml", poll_interval=2.0)
    trigger = TorchElasticJobTrigger.for_job(args)
    assert trigger.args == args and import_string(trigger.serialize()[0])(**trigger.serialize()[1]).args == args


def test_an_unknown_argument_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"TorchElasticJobTrigger: unknown argument 'poll_intervall'; expected some"):
        TorchElasticJobTrigger(**{**OLD_KWARGS, "poll_intervall": 3})
    with pytest.raises(TypeError, match=r"unknown arguments 'a', 'b'"):
        TorchElasticJobTrigger(kind="Pod", name="x", namespace="ml", b=1, a=2)


def test_the_shared_stream_refuses_an_unknown_argument_too() -> None:
    async def open_stream() -> None:
        await anext(TorchElasticJobTrigger.open_shared_stream({**OLD_KWARGS, "nmespace": "ml"}))

    with pytest.raises(TypeError, match="unknown argument 'nmespace'"):
        asyncio.run(open_stream())


def test_the_triggerer_fails_a_row_with_an_unknown_argument_naming_it() -> None:
    from airflow.executors.workloads.trigger import RunTrigger
    from airflow.jobs.triggerer_job_runner import TriggerRunner
    from airflow.models.trigger import Trigger

    async def inflate() -> list[tuple[int, BaseException | None]]:
        runner = TriggerRunner()
        encrypted = Trigger.encrypt_kwargs({**OLD_KWARGS, "bogus": 1})
        runner.to_create.append(RunTrigger(id=1, classpath=OLD_CLASSPATH, encrypted_kwargs=encrypted))
        await runner.create_triggers()
        return list(runner.failed_triggers)

    [(trigger_id, error)] = asyncio.run(inflate())
    assert trigger_id == 1 and isinstance(error, TypeError) and "unknown argument 'bogus'" in str(error)


def test_early_event_hold_is_read_for_deferrable_tasks_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_torchelastic.settings import DEFAULT_EARLY_EVENT_HOLD, Settings

    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__EARLY_EVENT_HOLD", raising=False)
    assert Settings.read(execution="kubernetes", deferrable=True).early_event_hold == DEFAULT_EARLY_EVENT_HOLD == 10
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EARLY_EVENT_HOLD", "2.5")
    assert Settings.read(execution="kubernetes", deferrable=True).early_event_hold == 2.5
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EARLY_EVENT_HOLD", "soon")
    with pytest.raises(AirflowFailException, match=r"\[torch_elastic\] early_event_hold: expected seconds >= 0, got"):
        Settings.read(execution="kubernetes", deferrable=True)
    # A task that waits in the worker never reads it: a wrong value there cannot fail it.
    assert Settings.read(execution="kubernetes", deferrable=False).early_event_hold == DEFAULT_EARLY_EVENT_HOLD


def test_job_lease_is_read_on_kubernetes_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_torchelastic.settings import DEFAULT_JOB_LEASE, Settings

    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__JOB_LEASE", raising=False)
    assert Settings.read(execution="kubernetes").job_lease == DEFAULT_JOB_LEASE == 3600
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__JOB_LEASE", "7200")
    assert Settings.read(execution="kubernetes").job_lease == 7200
    # Shorter than a waiter can be sure to renew it between polls and through a triggerer restart.
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__JOB_LEASE", "60")
    with pytest.raises(AirflowFailException, match=r"\[torch_elastic\] job_lease: expected seconds >= 300, got '60'"):
        Settings.read(execution="kubernetes")
    assert Settings.read(execution="local").job_lease == DEFAULT_JOB_LEASE  # local execution has no job to lease


def test_the_lease_travels_in_the_trigger_row_and_an_older_row_has_none() -> None:
    args = WatchArgs(kind="Pod", name="x", namespace="ml", lease_seconds=3600.0)
    trigger = TorchElasticJobTrigger.for_job(args)
    _, kwargs = trigger.serialize()
    assert kwargs["lease_seconds"] == 3600.0 and trigger.args.policy.lease_seconds == 3600.0
    old = TorchElasticJobTrigger(**OLD_KWARGS)
    assert "lease_seconds" not in old.serialize()[1] and old.args.policy.lease_seconds is None
