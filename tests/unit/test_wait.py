"""The wait core: deadline, wait failures, clean-up and kills, driven through the real sync and async drivers.

The job source is an in-memory stand-in for the API (the protocol's other implementation is the real client, tested
on the local cluster); everything it is asked is recorded, so the tests see exactly which deletions happen.
"""

from __future__ import annotations

import asyncio
import bisect
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_torchelastic import Elastic
from airflow_provider_torchelastic.core.metrics_format import MAX_LOG_LINE
from airflow_provider_torchelastic.core.naming import placeholder_identity
from airflow_provider_torchelastic.core.outcome import encode_success
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.client import retry_sync
from airflow_provider_torchelastic.kubernetes.render import render_manifests
from airflow_provider_torchelastic.kubernetes.requests import LOG_READ_LIMIT_BYTES, ReadLog
from airflow_provider_torchelastic.kubernetes.wait import (
    drive_async,
    drive_sync,
    stop_job,
    until_first_pause,
    wait_for_job,
)
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy
from tests import fake_kind

T0 = 1_800_000_000.0
STAMP0 = "2027-01-15T08:00:00Z"
POD = JobRef(kind="Pod", name="train-abc", namespace="ml")
JOB = JobRef(kind="PyTorchJob", name="train-abc", namespace="ml")


def pod(phase: str = "Running", *, exit_code: int | None = None, message: str | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"running": {}}
    if exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "message": message, "reason": "Completed"}}
    return {
        "kind": "Pod",
        "metadata": {"name": "train-abc", "creationTimestamp": STAMP0},
        "status": {"phase": phase, "containerStatuses": [{"name": "pytorch", "state": state}]},
    }


def pytorchjob(*conditions: str) -> dict[str, Any]:
    return {
        "kind": "PyTorchJob",
        "metadata": {"name": "train-abc", "creationTimestamp": STAMP0},
        "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1}}},
        "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]},
    }


@dataclass
class FakeSource:
    """Answers with a scripted sequence of jobs (or errors) on a fake clock, and records deletions."""

    answers: list[dict[str, Any] | KubeError | None]
    clock: list[float] = field(default_factory=lambda: [T0])
    deleted: list[JobRef] = field(default_factory=list)
    delete_error: KubeError | None = None
    #: What every log read answers, and the keyword arguments of each read.
    log_text: str = ""
    log_reads: list[dict[str, Any]] = field(default_factory=list)

    def snapshot(self, ref: JobRef) -> Snapshot:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, KubeError):
            raise answer
        return Snapshot(job=answer, pods=[], now=self.clock[0])

    def read_log(self, request: ReadLog) -> str:
        self.log_reads.append(
            {"pod": request.pod, "tail_lines": request.tail_lines, "limit_bytes": request.limit_bytes}
        )
        return self.log_text

    def delete_job(self, ref: JobRef) -> bool:
        if self.delete_error is not None:
            raise self.delete_error
        self.deleted.append(ref)
        return True

    def sleep(self, seconds: float) -> None:
        self.clock[0] += seconds


class AsyncFakeSource:
    def __init__(self, sync: FakeSource) -> None:
        self.sync = sync

    async def snapshot(self, ref: JobRef) -> Snapshot:
        return self.sync.snapshot(ref)

    async def read_log(self, request: ReadLog) -> str:
        return self.sync.read_log(request)

    async def delete_job(self, ref: JobRef) -> bool:
        return self.sync.delete_job(ref)


def run_sync(flow: Any, source: FakeSource) -> tuple[Any, list[str]]:
    lines: list[str] = []
    return drive_sync(flow, source, lines.append, sleep=source.sleep), lines


# --- wait failures ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_wait_that_cannot_observe_the_job_deletes_it_and_may_be_retried(status: int) -> None:
    source = FakeSource([pod(), KubeError(status, "Forbidden", "no")])
    decision, lines = run_sync(wait_for_job(POD, WaitPolicy(poll_interval=1)), source)
    assert source.deleted == [POD], "the job must not keep running on the cluster"
    assert decision.phase is Phase.FAILED and decision.verdict.recoverable
    assert f"{status} Forbidden" in decision.verdict.detail and "deleted" in decision.verdict.detail
    assert any(line.startswith("Deleted Pod ml/train-abc (waiting for it failed") for line in lines)


def test_recoverable_api_errors_are_retried_before_the_wait_gives_up() -> None:
    done = pod("Succeeded", exit_code=0, message=encode_success("1"))
    source = FakeSource([KubeError(503, "ServiceUnavailable", ""), KubeError(429, "TooManyRequests", ""), done])
    decision, lines = run_sync(wait_for_job(POD, WaitPolicy(poll_interval=1)), source)
    assert decision.phase is Phase.SUCCEEDED and decision.verdict.result == 1
    assert sum("retrying in" in line for line in lines) == 2


def test_a_failed_delete_is_reported_not_raised() -> None:
    source = FakeSource([KubeError(403, "Forbidden", "")], delete_error=KubeError(403, "Forbidden", "no delete"))
    decision, lines = run_sync(wait_for_job(POD, WaitPolicy(poll_interval=1)), source)
    assert decision.phase is Phase.FAILED
    assert any("Could not delete Pod ml/train-abc" in line and "no delete" in line for line in lines)


def test_the_look_before_deferring_decides_an_ended_job_and_leaves_a_running_one_to_the_trigger() -> None:
    done = pod("Succeeded", exit_code=0, message=encode_success("1"))
    source = FakeSource([done])
    decision, _ = run_sync(until_first_pause(wait_for_job(POD, WaitPolicy(poll_interval=1))), source)
    assert decision.phase is Phase.SUCCEEDED and decision.verdict.result == 1
    assert source.deleted == [POD], "on_finish_action applies as in the wait"
    running = FakeSource([pod(), done])
    decision, _ = run_sync(until_first_pause(wait_for_job(POD, WaitPolicy(poll_interval=1))), running)
    assert decision is None and running.deleted == [], "a job still running is left to the trigger"


def test_the_async_driver_makes_the_same_decisions() -> None:
    source = FakeSource([pod(), KubeError(403, "Forbidden", "no")])
    flow = wait_for_job(POD, WaitPolicy(poll_interval=0))
    decision = asyncio.run(drive_async(flow, AsyncFakeSource(source), print))
    assert source.deleted == [POD] and decision.verdict.recoverable


def test_every_log_read_is_bounded_and_a_huge_line_reaches_the_log_cut() -> None:
    """A pod decides what it prints: one line of megabytes must cost neither the worker nor the triggerer (which
    every deferred task shares) more than the bound of a read, nor go whole into the task log."""
    done = pod("Succeeded", exit_code=0, message=encode_success("1"))
    huge = "x" * (3 * MAX_LOG_LINE)
    for drive in ("sync", "async"):
        source = FakeSource([pod(), pod(), done], log_text=f"{STAMP0} [rank0]: {huge}\n")
        lines: list[str] = []
        flow = wait_for_job(POD, WaitPolicy(poll_interval=0))
        if drive == "sync":
            drive_sync(flow, source, lines.append, sleep=source.sleep)
        else:
            asyncio.run(drive_async(flow, AsyncFakeSource(source), lines.append))
        assert source.log_reads and all(read["limit_bytes"] == LOG_READ_LIMIT_BYTES for read in source.log_reads)
        (printed,) = [line for line in lines if "xxx" in line]
        assert len(printed) < MAX_LOG_LINE + 100, drive
        assert printed.endswith(f"[... {2 * MAX_LOG_LINE + len('[rank0]: ')} more characters cut]"), printed[-80:]


@dataclass
class NodeLog(FakeSource):
    """A pod that runs until ``ends`` seconds after T0 and prints ``lines`` (seconds after T0 and bytes of each),
    stamped by its node's clock (``skew`` seconds off the wait's); it answers log reads as the kubelet does: the lines
    from ``sinceTime``'s second on, the last ``tailLines`` of them, cut at ``limitBytes`` (inside a line too)."""

    lines: list[tuple[float, int]] = field(default_factory=list)
    ends: float = 60.0
    skew: float = 0.0
    rank: int = 0

    def snapshot(self, ref: JobRef) -> Snapshot:
        running = self.clock[0] < T0 + self.ends
        job = pod() if running else pod("Succeeded", exit_code=0, message=encode_success("1"))
        return Snapshot(job=job, pods=[], now=self.clock[0])

    def line(self, i: int) -> str:
        offset, size = self.lines[i]
        at = datetime.datetime.fromtimestamp(T0 + self.skew + offset, datetime.UTC)
        return f"{at.isoformat(timespec='microseconds')[:-6]}Z " + f"[rank{self.rank}]: line {i} ".ljust(size, ".")

    def read_log(self, request: ReadLog) -> str:
        super().read_log(request)
        offsets = [offset for offset, _ in self.lines]
        written = bisect.bisect_right(offsets, min(self.clock[0], T0 + self.ends) - T0)
        first = 0
        if request.since_time is not None:
            since = datetime.datetime.fromisoformat(request.since_time).timestamp()
            first = bisect.bisect_left(offsets, since - T0 - self.skew)
        if request.tail_lines is not None:
            first = max(first, written - request.tail_lines)
        body, i = b"", first
        while i < written and len(body) < request.limit_bytes:
            body += (self.line(i) + "\n").encode()
            i += 1
        return body[: request.limit_bytes].decode()


@dataclass
class JobLogs(FakeSource):
    """A PyTorchJob whose pods (``logs``: name -> its log, on this source's clock) run until ``ends``, when the job
    fails and each pod ends as ``ended`` says."""

    logs: dict[str, NodeLog] = field(default_factory=dict)
    ends: float = 60.0
    ended: dict[str, str] = field(default_factory=dict)

    def snapshot(self, ref: JobRef) -> Snapshot:
        running = self.clock[0] < T0 + self.ends
        job = pytorchjob("Created", "Running") if running else pytorchjob("Created", "Failed")
        pods = [
            {"metadata": {"name": name}, "status": {"phase": "Running" if running else self.ended[name]}}
            for name in self.logs
        ]
        return Snapshot(job=job, pods=pods, now=self.clock[0])

    def __post_init__(self) -> None:
        for node in self.logs.values():
            node.clock = self.clock  # one job, one clock

    def read_log(self, request: ReadLog) -> str:
        super().read_log(request)
        return self.logs[request.pod].read_log(request)


def _printed(lines: list[str]) -> list[int]:
    return [int(line.split(" line ")[1].split()[0]) for line in lines if " line " in line]


def _gaps(lines: list[str]) -> list[str]:
    return [line for line in lines if "not shown: the log grew faster than reads" in line]


@pytest.mark.parametrize("skew", [-7.0, 0.0, 7.0])
def test_a_log_is_read_by_its_nodes_stamps_whatever_the_clocks(skew: float) -> None:
    """Where a read starts is the node's time of the last line printed: a node whose clock is seconds off the
    triggerer's (a read counted back from the triggerer's clock missed lines when it lagged) loses nothing."""
    source = NodeLog([], lines=[(i / 7, 60) for i in range(350)], ends=50, skew=skew)
    _, lines = run_sync(wait_for_job(POD, WaitPolicy(poll_interval=5)), source)
    assert _printed(lines) == list(range(350)), lines
    assert not _gaps(lines)


@pytest.mark.parametrize("skew", [0.0, 0.3, 0.7])
def test_a_log_that_grows_faster_than_reads_bring_is_followed_to_its_end(skew: float) -> None:
    """Far more than a read brings is written between two reads, and more than that in a read's overlap alone: read
    on from a cut read, the task log fell further behind at each read, or read the same overlap for good. A read after
    a cut one takes the end of the log, the wait's last read is one, and the task log says what they skipped. The
    reads fall anywhere in the node's seconds (``skew``)."""
    source = NodeLog([], lines=[(i / 1500, 1000) for i in range(60_000)], ends=41, skew=skew)
    _, lines = run_sync(wait_for_job(POD, WaitPolicy(poll_interval=5)), source)
    printed = _printed(lines)
    assert printed == sorted(set(printed))  # in order, each once
    assert printed[-1] == 59_999  # the last line written
    assert len(printed) < 30_000  # far from all of them: two seconds of log fill a read
    assert _gaps(lines) and all(line.startswith("[train-abc] [... lines written after 2027-") for line in _gaps(lines))
    # Paced as ever: a read per poll, and one more at the end.
    assert len(source.log_reads) <= 45 / 5 + 2, len(source.log_reads)


def test_a_burst_that_fills_a_read_loses_no_line_when_the_next_reaches_back_to_it() -> None:
    """A burst of 1.5 MB cuts a read; the next takes the end of the log, which reaches back to lines printed: no line
    is lost, and no gap is announced."""
    quiet = [(i / 10, 60) for i in range(300)]
    burst = [(12.2 + i / 20_000, 1000) for i in range(1500)]
    source = NodeLog([], lines=sorted(quiet + burst), ends=30)
    _, lines = run_sync(wait_for_job(POD, WaitPolicy(poll_interval=5)), source)
    assert _printed(lines) == list(range(1800)) and not _gaps(lines)
    after_the_first = [read["tail_lines"] for read in source.log_reads[1:]]
    assert any(after_the_first), after_the_first  # the burst cut a read: the next took the end


def test_a_pod_probed_for_rank_0_announces_no_gap_in_lines_never_shown() -> None:
    """Rank 0 is quiet for its first half minute, so the wait probes each pod in turn, printing nothing; the other pod
    writes faster than reads bring. Its lines are never shown, and neither is a gap in them; rank 0's are, from the
    read that found it on."""
    fast = NodeLog([], lines=[(i / 1500, 1000) for i in range(60_000)], ends=40, rank=1)
    rank0 = NodeLog([], lines=[(30 + i / 10, 60) for i in range(80)], ends=40)
    logs = {"train-abc-worker-0": fast, "train-abc-worker-1": rank0}
    source = JobLogs([], logs=logs, ends=40, ended={"train-abc-worker-0": "Succeeded", "train-abc-worker-1": "Failed"})
    _, lines = run_sync(wait_for_job(JOB, WaitPolicy(poll_interval=5)), source)
    reads = [read["pod"] for read in source.log_reads]
    assert reads.count("train-abc-worker-0") >= 3, reads  # read on after a cut read, then its end: a gap skipped
    assert not _gaps(lines), _gaps(lines)
    assert not [line for line in lines if line.startswith("[train-abc-worker-0]")]
    printed = _printed(lines)
    assert printed and printed == list(range(printed[0], 80)), lines  # from the read that found rank 0, each once


# --- the deadline -----------------------------------------------------------------------------------------------------


def test_the_deadline_deletes_the_job_and_is_not_overslept() -> None:
    source = FakeSource([pod()])
    policy = WaitPolicy(poll_interval=10, deadline=T0 + 25)
    decision, lines = run_sync(wait_for_job(POD, policy), source)
    assert "execution_timeout reached: deleting Pod ml/train-abc" in lines
    # Polls at T0, T0+10, T0+20, then a 5 s nap to wake exactly at the deadline.
    assert source.clock[0] == T0 + 25
    assert source.deleted == [POD]
    assert decision.phase is Phase.FAILED and decision.verdict.recoverable
    assert "execution_timeout" in decision.verdict.detail


# --- on_finish_action -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "succeeded", "deleted"),
    [
        ("delete_succeeded", True, True),
        ("delete_succeeded", False, False),
        ("delete", False, True),
        ("keep", True, False),
    ],
)
def test_finish_action_decides_who_is_deleted(action: str, succeeded: bool, deleted: bool) -> None:
    ended = pod("Succeeded", exit_code=0, message=encode_success("1")) if succeeded else pod("Failed", exit_code=1)
    source = FakeSource([ended])
    decision, lines = run_sync(wait_for_job(POD, WaitPolicy(finish_action=action)), source)
    assert decision.phase is (Phase.SUCCEEDED if succeeded else Phase.FAILED)
    assert source.deleted == ([POD] if deleted else [])
    if not deleted:
        assert any(line.startswith("Keeping Pod ml/train-abc") for line in lines)


def test_an_unknown_finish_action_is_refused() -> None:
    with pytest.raises(ValueError, match="on_finish_action: expected one of 'delete_succeeded'"):
        WaitPolicy(finish_action="drop")


# --- kills ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "job"),
    [
        (JOB, pytorchjob("Created", "Running", "Succeeded")),
        (JOB, pytorchjob("Created", "Failed")),
        (POD, pod("Succeeded", exit_code=0)),
    ],
    ids=["succeeded-job", "failed-job", "ended-pod"],
)
def test_a_kill_leaves_a_finished_job_alone(ref: JobRef, job: dict[str, Any]) -> None:
    source = FakeSource([job])
    stopped, lines = run_sync(stop_job(ref), source)
    assert stopped is False and source.deleted == []
    assert "has finished" in lines[0]


@pytest.mark.parametrize(
    "answer", [pytorchjob("Created", "Running"), KubeError(500, "InternalError", "down")], ids=["running", "unknown"]
)
def test_a_kill_deletes_a_running_or_unobservable_job(answer: Any) -> None:
    source = FakeSource([answer])
    stopped, _ = run_sync(stop_job(JOB), source)
    assert stopped is True and source.deleted == [JOB]


# --- retries ----------------------------------------------------------------------------------------------------------


def test_only_recoverable_api_errors_are_repeated() -> None:
    from tests.unit.test_client_retry_after import failing_then

    calls: list[int] = []

    def flaky(errors: list[KubeError]) -> Callable[[], str]:
        return failing_then(errors, calls)

    naps: list[float] = []
    assert retry_sync(flaky([KubeError(0, "ConnectionResetError", ""), KubeError(502, "", "")]), print, naps.append)
    assert len(calls) == 3 and len(naps) == 2 and all(0 <= nap <= 30 for nap in naps)
    calls.clear()
    with pytest.raises(KubeError) as info:
        retry_sync(flaky([KubeError(422, "Invalid", "bad")]), print, naps.append)
    assert info.value.status == 422 and len(calls) == 1


# --- a new kind of job is one descriptor ------------------------------------------------------------------------------


def test_progress_is_logged_when_where_the_job_stands_changes_and_as_a_heartbeat(tmp_path: Path) -> None:
    # A kind's decisions say where the job stands (state) apart from the line, which may carry anything else.
    states = iter(["a", "a", "a", "b", "b"])

    def decide_fake(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
        state = next(states)
        done = snapshot.job["status"]["state"] == "Done"
        phase = Phase.SUCCEEDED if done else Phase.RUNNING
        return WaitDecision(phase=phase, progress=f"{state} at {snapshot.now - T0:.0f}", state=state)

    with fake_kind.plugged(tmp_path), fake_kind.deciding(decide_fake):
        busy = {"status": {"state": "Busy"}}
        source = FakeSource([busy, busy, busy, busy, {"status": {"state": "Done"}}])
        ref = JobRef(kind="FakeJob", name="f", namespace="ml")
        _, lines = run_sync(wait_for_job(ref, WaitPolicy(poll_interval=30, progress_interval=60)), source)
    # "a" at 0 s, unchanged at 30 s, the heartbeat at 60 s; "b" at once at 90 s, unchanged at 120 s.
    assert [line for line in lines if " at " in line] == ["a at 0", "a at 60", "b at 90"]


def test_a_plugged_in_kind_renders_waits_and_is_addressed_through_its_descriptor(tmp_path: Path) -> None:
    from airflow_provider_torchelastic.kubernetes import calls

    seen: list[str] = []

    def decide_fake(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
        seen.append(snapshot.job["status"]["state"])
        done = snapshot.job["status"]["state"] == "Done"
        return WaitDecision(phase=Phase.SUCCEEDED if done else Phase.RUNNING, progress=f"fake {ref.name}")

    with fake_kind.plugged(tmp_path), fake_kind.deciding(decide_fake):
        fake = kinds.get("FakeJob")
        assert fake is fake_kind.FAKE_JOB and kinds.registered()[0] is fake  # plugged-in kinds claim configs first
        config = Elastic(nproc_per_node=3)
        assert kinds.for_config(config) is fake
        assert kinds.for_config(Elastic(nproc_per_node=2)) is kinds.POD
        # The default renderer is the config's kind: what is checked at parse time is what is submitted.
        for renderer in (None, kinds.for_config(config).render):
            manifests = render_manifests(
                config,
                identity=placeholder_identity("d", "t"),
                namespace="ml",
                image="img",
                payload=b"",
                renderer=renderer,
            )
            assert [m["kind"] for m in manifests] == ["Secret", "FakeJob"]
        owner = fake.owner_reference(owner_name="f", owner_uid="u")["metadata"]["ownerReferences"]
        assert owner == [{"apiVersion": "example.dev/v1", "kind": "FakeJob", "name": "f", "uid": "u"}]

        ref = JobRef(kind="FakeJob", name="f", namespace="ml")
        source = FakeSource([{"status": {"state": "Busy"}}, {"status": {"state": "Done"}}])
        decision, _ = run_sync(wait_for_job(ref, WaitPolicy(poll_interval=1)), source)
        assert seen == ["Busy", "Done"] and decision.phase is Phase.SUCCEEDED and source.deleted == [ref]

        get = calls.get("FakeJob", "f", "ml")
        assert (get.method, get.path) == ("GET", "/apis/example.dev/v1/namespaces/ml/fakejobs/f")
    with pytest.raises(ValueError, match="job kind: expected one of Pod, PyTorchJob, TrainJob, got 'FakeJob'"):
        kinds.get("FakeJob")


@pytest.mark.parametrize(
    ("entry_point", "error"),
    [
        ("bad = tests.fake_kind:ENTRY_POINT", "expected a JobKind"),
        ("pod = airflow_provider_torchelastic.kubernetes.kinds:POD", "the kind 'Pod' is taken"),
    ],
    ids=["not-a-kind", "a-built-in-name"],
)
def test_a_bad_entry_point_is_refused_naming_it(tmp_path: Path, entry_point: str, error: str) -> None:
    with fake_kind.plugged(tmp_path, (entry_point,)), pytest.raises((TypeError, ValueError)) as info:
        kinds.registered()
    assert error in str(info.value) and entry_point.split(" = ")[1] in str(info.value)


def test_every_job_source_takes_what_the_drivers_pass() -> None:
    """The drivers call a source's methods with the protocol's keywords; an implementation that lacks one (the shared
    watch's source once lacked ``limit_bytes``) would fail only when a trigger first reads a log."""
    import inspect

    from airflow_provider_torchelastic.kubernetes.client import AsyncKube, SyncKube
    from airflow_provider_torchelastic.kubernetes.requests import AsyncJobSource, JobSource
    from airflow_provider_torchelastic.kubernetes.shared_source import SharedSource

    for protocol, implementations in ((JobSource, [SyncKube]), (AsyncJobSource, [AsyncKube, SharedSource])):
        for name in ("snapshot", "read_log", "events", "delete_job", "label_job"):
            wanted = inspect.signature(getattr(protocol, name)).parameters
            for implementation in implementations:
                given = inspect.signature(getattr(implementation, name)).parameters
                missing = [p for p in wanted if p not in given]
                assert not missing, f"{implementation.__name__}.{name} lacks {missing}"
