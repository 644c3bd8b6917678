"""The worker's event-driven wait without a cluster: which deletions nobody waits for, how they are carried out, and
what a private stream watches (tests/e2e/test_worker_watch.py drives it against the local cluster)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from airflow_provider_torchelastic.core.outcome import encode_success
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import calls, kinds, worker_wait
from airflow_provider_torchelastic.kubernetes.requests import DeleteJob, ReadLog
from airflow_provider_torchelastic.kubernetes.status import LogCursor, new_log_lines, split_stamp
from airflow_provider_torchelastic.kubernetes.wait import drive_sync, wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, WaitPolicy
from airflow_provider_torchelastic.kubernetes.watch_scope import SELECTOR, intermediate_key, job_scope, namespace_scope
from airflow_provider_torchelastic.kubernetes.worker_wait import BackgroundDeletes
from tests.unit.test_wait import POD, FakeSource, pod


@pytest.mark.parametrize(
    ("action", "succeeded", "detached", "waited"),
    [("delete_succeeded", True, True, False), ("delete", False, False, True), ("keep", True, False, False)],
)
def test_only_a_succeeded_jobs_deletion_is_left_unwaited(
    action: str, succeeded: bool, detached: bool, waited: bool
) -> None:
    ended = pod("Succeeded", exit_code=0, message=encode_success("1")) if succeeded else pod("Failed", exit_code=1)
    source = FakeSource([ended])
    started: list[DeleteJob] = []
    lines: list[str] = []
    policy = WaitPolicy(finish_action=action)
    decision = drive_sync(wait_for_job(POD, policy), source, lines.append, sleep=source.sleep, detach=started.append)
    assert decision.phase is (Phase.SUCCEEDED if succeeded else Phase.FAILED)
    assert started == ([DeleteJob(POD, background=True)] if detached else [])
    assert source.deleted == ([POD] if waited else [])
    assert any("in the background" in line for line in lines) is detached


def test_without_a_way_to_detach_the_deletion_is_carried_out_as_before() -> None:
    """The triggerer's driver: the shared stream's client may close with the trigger, so it waits."""
    source = FakeSource([pod("Succeeded", exit_code=0, message=encode_success("1"))])
    lines: list[str] = []
    drive_sync(wait_for_job(POD, WaitPolicy()), source, lines.append, sleep=source.sleep)
    assert source.deleted == [POD]
    assert any(line.startswith("Deleted Pod ml/train-abc (it ended") for line in lines), lines


def test_background_deletes_run_in_threads_and_report() -> None:
    source, lines = FakeSource([None]), []
    deletes = BackgroundDeletes(source, lines.append)
    deletes(DeleteJob(POD, background=True))
    assert deletes.join(10)
    assert source.deleted == [POD]
    assert lines == ["Deleted Pod ml/train-abc (existed: True)"]

    failing = FakeSource([None], delete_error=KubeError(403, "Forbidden", "no"))
    deletes = BackgroundDeletes(failing, lines.append)
    deletes(DeleteJob(POD, background=True))
    assert deletes.join(10)
    assert lines[-1].startswith("Could not delete Pod ml/train-abc")


def test_a_private_stream_watches_one_job_its_pods_and_what_is_between() -> None:
    def scope(kind: str) -> dict[str, tuple[Any, ...]]:
        ref = JobRef(kind=kind, name="train-abc", namespace="ml")
        return {w.key: (w.resource, w.label_selector, w.field_selector) for w in job_scope(ref)}

    by_name = (None, "metadata.name=train-abc")
    assert scope("Pod") == {"Pod": ("Pod", *by_name)}
    pytorchjob = kinds.get("PyTorchJob")
    assert scope("PyTorchJob") == {
        "PyTorchJob": ("PyTorchJob", *by_name),
        "Pod": ("Pod", pytorchjob.pod_selector("train-abc"), None),
    }
    trainjob = kinds.get("TrainJob")
    watched = scope("TrainJob")
    assert watched["Pod"] == ("Pod", trainjob.pod_selector("train-abc"), None)
    for query in trainjob.intermediates:
        selectors = (query.label_selector("train-abc"), query.field_selector("train-abc"))
        assert watched[intermediate_key(query)] == (query, *selectors)
    # The triggerer's stream: every kind without objects in between, and the pods, by the provider's label.
    shared = {w.key: w for w in namespace_scope()}
    assert "Pod" in shared and "PyTorchJob" in shared and "TrainJob" not in shared
    assert {w.label_selector for w in shared.values()} == {SELECTOR}


def test_the_polls_of_the_fall_back_take_what_the_driver_passes() -> None:
    import inspect

    from airflow_provider_torchelastic.kubernetes import worker_wait
    from airflow_provider_torchelastic.kubernetes.requests import AsyncJobSource

    for name in ("snapshot", "read_log", "events", "delete_job", "label_job", "workloads"):
        wanted = inspect.signature(getattr(AsyncJobSource, name)).parameters
        given = inspect.signature(getattr(worker_wait._ThreadedPolls, name)).parameters
        assert list(given) == list(wanted), name


def test_a_close_that_does_not_end_does_not_hold_the_decided_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait decided (the job ended); then closing what it watched with never ended. CI once saw such a task
    time out 3 minutes after its job succeeded. The decision is returned, and what would not close is named."""
    import contextlib
    import threading
    from collections.abc import Generator

    monkeypatch.setattr(worker_wait, "CLOSE_SECONDS", 0.5)

    @contextlib.asynccontextmanager
    async def stubborn_client() -> AsyncIterator[object]:
        try:
            yield object()
        finally:
            while True:  # a close that ignores cancellation as well
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)

    def decided() -> Generator[Any, Any, str]:
        return "succeeded"
        yield  # a generator, as the wait core is

    lines: list[str] = []
    answer: list[str] = []
    waiter = threading.Thread(
        target=lambda: answer.append(
            worker_wait.wait_watching(decided(), POD, stubborn_client, FakeSource([None]), lines.append)
        ),
        daemon=True,
    )
    waiter.start()
    waiter.join(30)
    assert answer == ["succeeded"], lines
    assert any("did not close within 0.5 s" in line for line in lines), lines


class CutStream:
    """The API's followed log of one pod: the first stream sends ``first`` and stays open until :attr:`cut` is set; a
    stream opened again sends ``first + later``, each from ``sinceTime``'s second on, as the API does."""

    def __init__(self, first: list[str], later: list[str]) -> None:
        self.first, self.later = first, later
        self.since: list[str | None] = []
        self.sent = 0
        self.cut = asyncio.Event()

    async def stream(self, call: calls.Call[str]) -> AsyncIterator[str]:
        since = dict(call.query).get("sinceTime") or ""
        self.since.append(since)
        for line in self.first if len(self.since) == 1 else self.first + self.later:
            if line[:19] >= since[:19]:
                self.sent += 1
                yield line
        await (self.cut.wait() if len(self.since) == 1 else asyncio.Event().wait())  # open until cut

    def follow(self, lines_before_cut: int, lines_after: int) -> list[str]:
        """The two takes of a follower started by a read of the API that brought ``first[0]``: once the first stream
        sent ``lines_before_cut`` lines, and once the stream opened again after the cut sent ``lines_after``."""

        async def until(done: Callable[[], bool]) -> None:
            for _ in range(500):
                if done():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("not reached")

        async def follow() -> list[str]:
            request = ReadLog(pod="p", namespace="ml", since_time="2027-01-15T07:59:59Z")
            follower = worker_wait.LogFollower(self, request, "2027-01-15T08:00:00Z")  # type: ignore[arg-type]
            await until(lambda: self.sent == lines_before_cut)
            chunks = [follower.take()]
            self.cut.set()
            await until(lambda: self.sent == lines_before_cut + lines_after)
            chunks.append(follower.take())
            await follower.close()
            return chunks

        return asyncio.run(follow())


def test_a_followed_log_opened_again_brings_a_line_stamped_in_the_second_before_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream that was cut is opened again from the second before the last line the wait took, and the wait's
    cursor skips what it sends again: a line written after the cut but stamped in that second before (stderr behind
    stdout) is printed, once. Opened from the last line's own second, the API would not send it."""
    monkeypatch.setattr(worker_wait, "FOLLOW_RETRY", 0.01)
    log = ["2027-01-15T08:00:00.5Z a", "2027-01-15T08:00:01.1Z b", "2027-01-15T08:00:01.2Z c"]
    api = CutStream(log, ["2027-01-15T08:00:00.95Z e", "2027-01-15T08:00:02Z d"])
    chunks = api.follow(3, 5)
    assert api.since == ["2027-01-15T07:59:59Z", "2027-01-15T08:00:00Z"]
    lines, cursor = new_log_lines(LogCursor(), log[0])
    for chunk in chunks:
        more, cursor = new_log_lines(cursor, chunk)
        lines += more
    assert lines == ["a", "b", "c", "e", "d"]


def test_lines_a_reopened_stream_sends_again_are_not_counted_as_not_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream opened again sends the lines the wait took before; when more come than a read holds, those give way
    first. Only the lines the wait never had are counted in the note: here 2 of the 5 that gave way."""
    monkeypatch.setattr(worker_wait, "FOLLOW_RETRY", 0.01)
    monkeypatch.setattr(worker_wait, "FOLLOW_MAX_LINES", 3)
    first = [f"2027-01-15T08:00:00.{i}Z {name}" for i, name in enumerate("abc", 1)]
    later = [f"2027-01-15T08:00:01.{i}Z {name}" for i, name in enumerate("defgh", 1)]
    api = CutStream(first, later)
    chunks = api.follow(3, 8)
    assert api.since == ["2027-01-15T07:59:59Z", "2027-01-15T07:59:59Z"]  # the second before the last line taken
    assert chunks[0].splitlines() == first
    assert chunks[1].splitlines() == [
        "[... 2 earlier lines not shown: more came between two reads than one holds]",
        *later[2:],
    ]


def test_a_line_stamp_is_read_one_way_for_sorting_and_for_since_time() -> None:
    text = "2026-11-29T17:40:19.1234Z a\n2026-11-29T17:40:21Z b\n2026Z not a stamp\nno stamp"
    assert worker_wait.last_stamp(text) == "2026-11-29T17:40:21Z"
    assert split_stamp("2026-11-29T17:40:19.1234Z a", "") == ("2026-11-29T17:40:19.123400000Z", "a")
    # What is no whole second of RFC 3339 is no stamp for either: the line keeps its place, and no read starts there.
    assert split_stamp("2026Z not a stamp", "before") == ("before", "2026Z not a stamp")
    assert worker_wait.last_stamp("2026Z x\nno stamp") is None
