"""The decisions of each job kind, from job and pod JSON, with a fake clock; no I/O."""

from __future__ import annotations

import datetime
import random
from typing import Any

import pytest

from airflow_provider_torchelastic.core.outcome import WorkerFailure, encode_failure, encode_success
from airflow_provider_torchelastic.kubernetes import kinds, status
from airflow_provider_torchelastic.kubernetes.requests import DeleteJob, EmitLog, FetchJob, ReadLog, Sleep
from airflow_provider_torchelastic.kubernetes.status import LogCursor, new_log_lines
from airflow_provider_torchelastic.kubernetes.wait import wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

T0 = 1_800_000_000.0
STAMP0 = "2027-01-15T08:00:00Z"  # == T0
JOB = JobRef(kind="PyTorchJob", name="train-abc", namespace="ml")
POD = JobRef(kind="Pod", name="train-abc", namespace="ml")
POLICY = WaitPolicy(poll_interval=5, pending_grace_seconds=60)


def decide(ref: JobRef, snapshot: Snapshot, policy: WaitPolicy) -> WaitDecision:
    return kinds.get(ref.kind).decide(ref, snapshot, policy)


def make_job(
    *conditions: str, replicas: dict[str, int] | None = None, deadline: int | None = None, failed_message: str = ""
) -> dict[str, Any]:
    specs = {kind: {"replicas": n} for kind, n in (replicas or {"Worker": 2}).items()}
    job: dict[str, Any] = {
        "kind": "PyTorchJob",
        "metadata": {"name": JOB.name, "namespace": "ml", "creationTimestamp": STAMP0},
        "spec": {"pytorchReplicaSpecs": specs},
        "status": {
            "conditions": [
                {"type": c, "status": "True", "message": failed_message if c == "Failed" else ""} for c in conditions
            ]
        },
    }
    if deadline is not None:
        job["spec"]["runPolicy"] = {"activeDeadlineSeconds": deadline}
    return job


def make_pod(
    name: str,
    phase: str = "Running",
    *,
    exit_code: int | None = None,
    message: str | None = None,
    waiting: str | None = None,
    unschedulable: bool = False,
    reason: str | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "pytorch", "state": {}}
    if exit_code is not None:
        container["state"]["terminated"] = {
            "exitCode": exit_code,
            "message": message,
            "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        }
    elif waiting:
        container["state"]["waiting"] = {"reason": waiting, "message": f"Back-off pulling image: {waiting}"}
    else:
        container["state"]["running"] = {}
    status: dict[str, Any] = {"phase": phase, "containerStatuses": [container]}
    if unschedulable:
        status = {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        }
    if reason and exit_code is None:
        status["reason"] = reason
    return {"metadata": {"name": name, "creationTimestamp": STAMP0}, "status": status}


def failure(rank: int, ts: float, *, recoverable: bool = False, exc: str = "ValueError") -> str:
    return encode_failure(
        WorkerFailure(rank=rank, exception=exc, message="boom", recoverable=recoverable, timestamp=ts)
    )


def test_pending_then_running_progress_counts_pods() -> None:
    d = decide(JOB, Snapshot(job=make_job("Created"), pods=[make_pod("w0", "Pending")], now=T0 + 5), POLICY)
    assert d.phase is Phase.PENDING and "Created" in d.progress and "0/2" in d.progress
    d = decide(
        JOB, Snapshot(job=make_job("Created", "Running"), pods=[make_pod("w0"), make_pod("w1")], now=T0 + 75), POLICY
    )
    assert d.phase is Phase.RUNNING and "2/2" in d.progress and "1m15s" in d.progress


def test_elastic_succeeded_waits_for_the_pod_holding_rank0() -> None:
    # worker-0 finished first without rank 0; the job is already Succeeded (any worker succeeds an elastic job).
    pods = [make_pod("w0", "Succeeded", exit_code=0, message=encode_success(None)), make_pod("w1")]
    d = decide(JOB, Snapshot(job=make_job("Running", "Succeeded"), pods=pods, now=T0 + 10), POLICY)
    assert d.phase is Phase.RUNNING and d.verdict is None
    pods[1] = make_pod("w1", "Succeeded", exit_code=0, message=encode_success('{"loss": 0.1}'))
    d = decide(JOB, Snapshot(job=make_job("Running", "Succeeded"), pods=pods, now=T0 + 12), POLICY)
    assert d.phase is Phase.SUCCEEDED and d.verdict is not None
    assert d.verdict.result == {"loss": 0.1} and d.verdict.node == "w1"


def test_failed_job_root_cause_is_the_earliest_failure_across_pods() -> None:
    pods = [
        make_pod("w0", "Failed", exit_code=1, message=failure(0, T0 + 9.5)),  # a consequence
        make_pod("w1", "Failed", exit_code=1, message=failure(3, T0 + 9.1, exc="KeyError")),  # the cause
        make_pod("w2", "Failed", exit_code=143),  # stopped, published nothing
    ]
    d = decide(JOB, Snapshot(job=make_job("Failed"), pods=pods, now=T0 + 20), POLICY)
    assert d.phase is Phase.FAILED and d.verdict is not None
    assert d.verdict.node == "w1" and d.verdict.failure is not None and d.verdict.failure.rank == 3
    assert d.verdict.failure.exception == "KeyError" and not d.verdict.recoverable


def test_recoverable_failure_and_oom_are_recoverable() -> None:
    pods = [make_pod("w0", "Failed", exit_code=200, message=failure(1, T0 + 1, recoverable=True))]
    d = decide(JOB, Snapshot(job=make_job("Failed"), pods=pods, now=T0 + 5), POLICY)
    assert d.verdict is not None and d.verdict.recoverable
    pods = [make_pod("w0", "Failed", exit_code=137, reason="OOMKilled", message="")]
    d = decide(JOB, Snapshot(job=make_job("Failed"), pods=pods, now=T0 + 5), POLICY)
    assert d.verdict is not None and d.verdict.recoverable and "OOMKilled" in d.verdict.detail


def test_evicted_pod_without_exit_code_is_recoverable() -> None:
    pod = make_pod("train-abc", "Failed", reason="Evicted")
    pod["status"]["containerStatuses"] = []
    d = decide(POD, Snapshot(job=pod, now=T0 + 5), POLICY)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert "Evicted" in d.verdict.detail


@pytest.mark.parametrize("waiting", ["ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError"])
def test_stuck_pod_fails_fast_after_the_grace_only(waiting: str) -> None:
    pods = [make_pod("w0", "Pending", waiting=waiting)]
    early = decide(JOB, Snapshot(job=make_job("Created"), pods=pods, now=T0 + 59), POLICY)
    assert early.phase is Phase.PENDING
    late = decide(JOB, Snapshot(job=make_job("Created"), pods=pods, now=T0 + 61), POLICY)
    assert late.phase is Phase.FAILED and late.verdict is not None
    assert waiting in late.verdict.detail and "w0" in late.verdict.detail and not late.verdict.recoverable


def test_unschedulable_is_waiting_for_capacity_bounded_by_scheduling_timeout_not_the_grace() -> None:
    pod = make_pod("train-abc", unschedulable=True)
    long_after_grace = decide(POD, Snapshot(job=pod, now=T0 + 3600), POLICY)
    assert long_after_grace.phase is Phase.PENDING and long_after_grace.verdict is None
    assert "waiting for capacity: pod train-abc is Unschedulable" in long_after_grace.progress
    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=60, scheduling_timeout=600)
    assert decide(POD, Snapshot(job=pod, now=T0 + 599), policy).phase is Phase.PENDING
    d = decide(POD, Snapshot(job=pod, now=T0 + 601), policy)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert "scheduling_timeout=600" in d.verdict.detail and "Insufficient nvidia.com/gpu" in d.verdict.detail
    assert d.verdict.node == "train-abc"


def elastic_job(minimum: int, maximum: int, *conditions: str) -> dict[str, Any]:
    job = make_job(*conditions, replicas={"Worker": maximum})
    job["spec"]["elasticPolicy"] = {"minReplicas": minimum, "maxReplicas": maximum}
    return job


def test_elastic_job_runs_on_partial_capacity_and_says_how_many_pods_wait() -> None:
    policy = WaitPolicy(scheduling_timeout=30)
    pods = [make_pod("w0"), make_pod("w1"), make_pod("w2", unschedulable=True), make_pod("w3", unschedulable=True)]
    d = decide(JOB, Snapshot(job=elastic_job(2, 4, "Created", "Running"), pods=pods, now=T0 + 3600), policy)
    assert d.phase is Phase.RUNNING and d.verdict is None
    assert "pods running 2/4, 2 waiting for capacity" in d.progress
    # It ends on what it got: rank 0's holder reports, the pods that never got capacity are not waited for.
    pods[:2] = [
        make_pod("w0", "Succeeded", exit_code=0, message=encode_success(None)),
        make_pod("w1", "Succeeded", exit_code=0, message=encode_success('{"nodes": 2}')),
    ]
    d = decide(JOB, Snapshot(job=elastic_job(2, 4, "Running", "Succeeded"), pods=pods, now=T0 + 3700), policy)
    assert d.phase is Phase.SUCCEEDED and d.verdict is not None and d.verdict.result == {"nodes": 2}


def test_elastic_job_below_its_minimum_waits_for_capacity_until_scheduling_timeout() -> None:
    policy = WaitPolicy(scheduling_timeout=300)
    pods = [make_pod("w0"), make_pod("w1", unschedulable=True), make_pod("w2", unschedulable=True)]
    job = elastic_job(2, 3, "Created", "Running")
    early = decide(JOB, Snapshot(job=job, pods=pods, now=T0 + 200), policy)
    assert early.phase is Phase.PENDING and "waiting for capacity: pod w1 is Unschedulable" in early.progress
    late = decide(JOB, Snapshot(job=job, pods=pods, now=T0 + 301), policy)
    assert late.phase is Phase.FAILED and late.verdict is not None and late.verdict.recoverable
    assert late.verdict.node == "w1" and "scheduling_timeout=300" in late.verdict.detail


def test_elastic_job_at_its_minimum_is_not_timed_out_while_its_pod_starts_or_has_just_succeeded() -> None:
    # The pod that got capacity counts as progress while its container starts, and once it has succeeded before
    # the training operator writes the job's Succeeded condition; only pods still waiting are not progress.
    policy = WaitPolicy(scheduling_timeout=5)
    job = elastic_job(1, 2, "Created", "Running")
    starting = make_pod("w0", "Pending", waiting="ContainerCreating")
    done = make_pod("w0", "Succeeded", exit_code=0, message=encode_success('{"nodes": 1}'))
    for w0 in (starting, done):
        d = decide(JOB, Snapshot(job=job, pods=[w0, make_pod("w1", unschedulable=True)], now=T0 + 60), policy)
        assert d.phase is not Phase.FAILED and d.verdict is None, (w0["status"], d)
    # A failed pod is not progress: below its minimum, the wait for capacity is bounded again.
    failed = make_pod("w0", "Failed", exit_code=1)
    d = decide(JOB, Snapshot(job=job, pods=[failed, make_pod("w1", unschedulable=True)], now=T0 + 60), policy)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.node == "w1"


def test_a_fixed_size_job_needs_all_its_pods() -> None:
    pods = [make_pod("m0"), make_pod("w0", unschedulable=True)]
    job = make_job("Created", "Running", replicas={"Master": 1, "Worker": 1})
    d = decide(JOB, Snapshot(job=job, pods=pods, now=T0 + 50), WaitPolicy(scheduling_timeout=40))
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.node == "w0"


def queued_job(*conditions: str, since: str = STAMP0) -> dict[str, Any]:
    job = make_job(*conditions)
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    job["spec"]["runPolicy"] = {"suspend": True}
    for condition in job["status"]["conditions"]:
        condition["lastTransitionTime"] = since
    return job


def test_a_suspended_job_waits_as_queued_until_scheduling_timeout() -> None:
    job = queued_job("Created", "Suspended")
    d = decide(JOB, Snapshot(job=job, now=T0 + 7200), POLICY)
    assert d.phase is Phase.PENDING and "queued in Kueue LocalQueue gpu-queue" in d.progress
    d = decide(JOB, Snapshot(job=job, now=T0 + 61), WaitPolicy(scheduling_timeout=60))
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert "is suspended (queued in Kueue LocalQueue gpu-queue)" in d.verdict.detail


def test_preemption_is_not_a_failure_and_the_resumed_run_decides() -> None:
    policy = WaitPolicy(scheduling_timeout=600)
    running = decide(JOB, Snapshot(job=make_job("Created", "Running"), pods=[make_pod("w0"), make_pod("w1")]), policy)
    assert running.phase is Phase.RUNNING
    # Preempted 10 minutes in: suspended, pods deleted. The timeout counts from the suspension, not the creation.
    preempted = queued_job("Created", "Suspended", since="2027-01-15T08:10:00Z")
    d = decide(JOB, Snapshot(job=preempted, pods=[], now=T0 + 900), policy)
    assert d.phase is Phase.PENDING and d.verdict is None
    resumed = make_job("Created", "Running", "Succeeded")
    pods = [make_pod("w0", "Succeeded", exit_code=0, message=encode_success('"second run"')), make_pod("w1")]
    d = decide(JOB, Snapshot(job=resumed, pods=pods, now=T0 + 1500), policy)
    assert d.phase is Phase.SUCCEEDED and d.verdict is not None and d.verdict.result == "second run"


def test_an_evicted_pod_whose_container_ended_is_named_evicted() -> None:
    pod = make_pod("w1", "Failed", exit_code=143, message="")
    pod["status"]["reason"] = "Evicted"
    d = decide(JOB, Snapshot(job=make_job("Failed"), pods=[pod], now=T0 + 20), POLICY)
    assert d.verdict is not None and d.verdict.recoverable
    assert "w1 exited with code 143 (Evicted)" in d.verdict.detail


def test_a_backoff_limit_failure_gives_the_root_cause_and_the_limit() -> None:
    message = "PyTorchJob train-abc has failed because it has reached the specified backoff limit"
    pods = [make_pod("w0", "Failed", exit_code=1, message=failure(0, T0 + 3))]
    d = decide(JOB, Snapshot(job=make_job("Failed", failed_message=message), pods=pods, now=T0 + 30), POLICY)
    assert d.verdict is not None and d.verdict.node == "w0" and not d.verdict.recoverable
    assert "ValueError: boom" in d.verdict.detail and "reached the specified backoff limit" in d.verdict.detail


def test_a_failed_job_waits_briefly_for_peers_that_still_run_before_naming_the_root_cause() -> None:
    job = make_job("Failed")
    job["status"]["conditions"][0]["lastTransitionTime"] = STAMP0
    # The master ended first with a consequence; worker-0, which failed first, has not ended yet.
    pods = [make_pod("m0", "Failed", exit_code=1, message=failure(0, T0 + 0.5, exc="RuntimeError")), make_pod("w0")]
    d = decide(JOB, Snapshot(job=job, pods=pods, now=T0 + 1), POLICY)
    assert d.phase is Phase.RUNNING and d.verdict is None
    pods[1] = make_pod("w0", "Failed", exit_code=1, message=failure(1, T0 + 0.2))
    d = decide(JOB, Snapshot(job=job, pods=pods, now=T0 + 2), POLICY)
    assert d.verdict is not None and d.verdict.node == "w0" and d.verdict.failure.rank == 1  # type: ignore[union-attr]
    # A peer that never ends does not hold the verdict back for long.
    stuck = [pods[0], make_pod("w0")]
    d = decide(JOB, Snapshot(job=job, pods=stuck, now=T0 + 11), POLICY)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.node == "m0"


def test_deadline_failure_names_the_deadline() -> None:
    job = make_job(
        "Failed",
        deadline=600,
        failed_message="PyTorchJob train-abc has failed because it was active longer than specified deadline",
    )
    pods = [make_pod("w0", "Failed", exit_code=143)]
    d = decide(JOB, Snapshot(job=job, pods=pods, now=T0 + 700), POLICY)
    assert d.verdict is not None and "active_deadline_seconds=600" in d.verdict.detail


def test_job_gone_is_a_recoverable_failure() -> None:
    d = decide(JOB, Snapshot(job=None, now=T0), POLICY)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable


def test_master_job_single_pod_success() -> None:
    pod = make_pod("train-abc", "Succeeded", exit_code=0, message=encode_success("[1, 2]"))
    d = decide(POD, Snapshot(job=pod, now=T0 + 30), POLICY)
    assert d.phase is Phase.SUCCEEDED and d.verdict is not None and d.verdict.result == [1, 2]


def test_decision_round_trips_through_a_trigger_event() -> None:
    pods = [make_pod("w0", "Failed", exit_code=1, message=failure(2, T0))]
    d = decide(JOB, Snapshot(job=make_job("Failed"), pods=pods, now=T0 + 5), POLICY)
    assert WaitDecision.from_event(d.to_event()) == d


def test_a_decision_says_where_the_job_stands_apart_from_the_clock() -> None:
    pods = [make_pod("w0"), make_pod("w1")]
    early = decide(JOB, Snapshot(job=make_job("Created", "Running"), pods=pods, now=T0 + 5), POLICY)
    later = decide(JOB, Snapshot(job=make_job("Created", "Running"), pods=pods, now=T0 + 75), POLICY)
    assert early.state == later.state == "PyTorchJob train-abc: Running; pods running 2/2"
    assert (early.progress, later.progress) == (f"{early.state}; elapsed 0m05s", f"{later.state}; elapsed 1m15s")
    assert early.wait_state == early.state
    gone = decide(JOB, Snapshot(job=None, now=T0 + 80), POLICY)
    assert gone.state is None and gone.wait_state == gone.progress  # no clock: the whole line is the state


def test_log_lines_are_never_printed_twice_across_overlapping_reads() -> None:
    first = "2027-01-15T08:00:00.1Z a\n2027-01-15T08:00:01.5Z b\n2027-01-15T08:00:01.5Z b\n"
    lines, cursor = new_log_lines(LogCursor(), first)
    assert lines == ["a", "b", "b"]
    # The next read restarts a little earlier (whole seconds) and brings one new line at the same instant.
    second = "2027-01-15T08:00:01.5Z b\n2027-01-15T08:00:01.5Z b\n2027-01-15T08:00:01.5Z b\n2027-01-15T08:00:02Z c\n"
    lines, cursor = new_log_lines(cursor, second)
    assert lines == ["b", "c"]
    lines, cursor = new_log_lines(cursor, second)
    assert lines == []


def test_a_line_stamped_before_the_one_written_ahead_of_it_is_printed_once() -> None:
    # containerd stamps stdout and stderr in two goroutines: the stdout line was stamped first, written second.
    first = "2027-01-15T08:00:00.5Z a\n2027-01-15T08:00:01.000200Z err\n2027-01-15T08:00:01.000100Z out\n"
    lines, cursor = new_log_lines(LogCursor(), first)
    assert lines == ["a", "err", "out"]
    # A later read from the whole second before, with a new line: the overlap is printed once, whatever its order.
    second = first + "2027-01-15T08:00:01.2Z next\n"
    lines, cursor = new_log_lines(cursor, second)
    assert lines == ["next"]
    # The same inversion as the first line after the overlap: still new.
    third = second + "2027-01-15T08:00:01.4Z err2\n2027-01-15T08:00:01.3Z out2\n"
    assert new_log_lines(cursor, third)[0] == ["err2", "out2"]
    assert new_log_lines(cursor, "2027-01-15T08:00:01.1Z out3\n")[0] == ["out3"]


def test_a_cursor_remembers_a_bounded_number_of_lines_and_skips_what_it_forgot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "LOG_RECENT_LINES", 3)
    text = "".join(f"2027-01-15T08:00:00.{i}Z line {i}\n" for i in range(1, 6))
    lines, cursor = new_log_lines(LogCursor(), text)
    assert len(lines) == 5 and [line for _, line in cursor.recent] == [hash(f"line {i}") for i in (3, 4, 5)]
    # A read from the whole second: what the cursor forgot comes before what it remembers.
    assert new_log_lines(cursor, text + "2027-01-15T08:00:00.6Z line 6\n")[0] == ["line 6"]


def test_a_line_stamped_among_lines_the_cursor_forgot_is_still_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real node's log of 6,000 lines on two streams lost one this way: the cursor remembered the newest lines by
    time and skipped, as forgotten, a new stderr line stamped before them."""
    monkeypatch.setattr(status, "LOG_RECENT_LINES", 3)
    text = "".join(f"2027-01-15T08:00:00.{i}Z line {i}\n" for i in range(1, 6))
    _, cursor = new_log_lines(LogCursor(), text)
    skewed = "2027-01-15T08:00:00.25Z err\n"
    # From the API (the overlap first), and from a followed stream (only what came since).
    assert new_log_lines(cursor, text + skewed + "2027-01-15T08:00:00.6Z line 6\n")[0] == ["err", "line 6"]
    assert new_log_lines(cursor, skewed)[0] == ["err"]
    # A read that starts after some remembered lines (a whole second later) brings the rest, then what is new.
    _, later = new_log_lines(cursor, "2027-01-15T08:00:01.2Z line 7\n")
    assert new_log_lines(later, "2027-01-15T08:00:01.2Z line 7\n2027-01-15T08:00:01.1Z err 8\n")[0] == ["err 8"]


def test_a_read_cut_short_in_its_overlap_prints_none_of_the_lines_the_cursor_forgot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read cut at ``limitBytes`` before the cursor's recent lines brings lines it forgot (printed, more than it
    remembers in a second): taken as new, they were printed twice. A read that reached the log's end and still brings
    no recent line brings new lines (the log was rotated past them): those are printed."""
    monkeypatch.setattr(status, "LOG_RECENT_LINES", 3)
    text = "".join(f"2027-01-15T08:00:00.{i}Z line {i}\n" for i in range(1, 8))
    _, cursor = new_log_lines(LogCursor(), text)
    overlap = "".join(f"2027-01-15T08:00:00.{i}Z line {i}\n" for i in range(1, 4))
    assert new_log_lines(cursor, overlap, cut=True)[0] == []
    assert new_log_lines(cursor, overlap)[0] == ["line 1", "line 2", "line 3"]


def test_log_fractions_compare_numerically_not_as_text() -> None:
    _, cursor = new_log_lines(LogCursor(), "2027-01-15T08:00:00.12345Z x\n")
    lines, _ = new_log_lines(cursor, "2027-01-15T08:00:00.12345Z x\n2027-01-15T08:00:00.1235Z y\n")
    assert lines == ["y"]  # .1235 is later than .12345 although "5Z" < "Z" as text


def test_wait_protocol_logs_progress_streams_logs_cleans_up_and_returns() -> None:
    flow = wait_for_job(POD, POLICY)
    request = next(flow)
    assert request == FetchJob(POD)
    running = make_pod("train-abc")
    request = flow.send(Snapshot(job=running, now=T0 + 1))
    assert isinstance(request, EmitLog) and "Running" in request.line
    request = flow.send(None)
    assert isinstance(request, ReadLog) and request.pod == "train-abc" and request.since_time is None
    request = flow.send("2027-01-15T08:00:01Z [rank0]:epoch 1\n")
    assert request == EmitLog("[train-abc] [rank0]:epoch 1")
    assert flow.send(None) == Sleep(5)
    assert flow.send(None) == FetchJob(POD)
    done = make_pod("train-abc", "Succeeded", exit_code=0, message=encode_success("7"))
    request = flow.send(Snapshot(job=done, now=T0 + 3))
    assert isinstance(request, EmitLog) and "Succeeded" in request.line
    request = flow.send(None)
    assert isinstance(request, ReadLog) and request.since_time is not None
    # The same line again is not re-printed; the job succeeded, so on_finish_action=delete_succeeded deletes it.
    assert flow.send("2027-01-15T08:00:01Z [rank0]:epoch 1\n") == DeleteJob(POD, background=True)
    request = flow.send(True)
    assert isinstance(request, EmitLog) and request.line.startswith("Deleted Pod ml/train-abc")
    with pytest.raises(StopIteration) as stop:
        flow.send(None)
    assert stop.value.value.verdict.result == 7


# --- what current clusters show that the 1.20 test cluster cannot (issue 33, item 5) -------------------------------


def test_a_scheduling_gated_pod_waits_for_capacity_bounded_by_scheduling_timeout() -> None:
    """Kubernetes >= 1.26 holds a pod with ``schedulingGates`` (Kueue's pod integration gates pods until admitted)
    as PodScheduled=False, reason SchedulingGated: a wait for capacity, not a stuck pod, and bounded the same way."""
    pod = make_pod("train-abc")
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated", "message": "Scheduling is blocked"}
        ],
    }
    long_after_grace = decide(POD, Snapshot(job=pod, now=T0 + 3600), POLICY)
    assert long_after_grace.phase is Phase.PENDING and long_after_grace.verdict is None
    assert "waiting for capacity: pod train-abc is SchedulingGated (held by a queue" in long_after_grace.progress
    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=60, scheduling_timeout=600)
    d = decide(POD, Snapshot(job=pod, now=T0 + 601), policy)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert "scheduling_timeout=600" in d.verdict.detail


def test_a_pod_preempted_by_the_scheduler_with_only_a_disruption_target_condition_is_recoverable() -> None:
    """Kubernetes >= 1.26 marks a pod the scheduler preempts (or a drain evicts) with the DisruptionTarget condition
    before it kills it: the container then ends with 137 and no reason of its own."""
    pod = make_pod("train-abc", "Failed", exit_code=137, reason="Error", message="")
    pod["status"]["conditions"] = [
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": "Preempted in order to admit critical pod",
        }
    ]
    d = decide(POD, Snapshot(job=pod, now=T0 + 5), POLICY)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert d.verdict.cause == "preempted", d.verdict


def _skewed_log(rnd: random.Random) -> list[tuple[datetime.datetime, str]]:
    """Lines on stdout and stderr, every other one stamped up to 20 ms before the line written ahead of it."""
    at, log = datetime.datetime(2027, 1, 15, 8), []
    for i in range(rnd.randint(50, 400)):
        at += datetime.timedelta(seconds=rnd.expovariate(1 / rnd.choice((0.0005, 0.005, 0.05))))
        log.append((at - datetime.timedelta(seconds=rnd.random() * 0.02 * (i % 2)), f"line {i}"))
    return log


@pytest.mark.parametrize("seed", range(40))
def test_every_line_is_printed_once_whatever_the_reads(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads end anywhere, and come from the API (the overlap from a whole second before the last line read, or from
    ``sinceSeconds``, two or three seconds before) or from a followed stream (no overlap), to a cursor that remembers
    3 to 50 lines: every line is printed once, in the log's order."""
    rnd = random.Random(seed)
    monkeypatch.setattr(status, "LOG_RECENT_LINES", rnd.choice((3, 10, 50)))
    log = _skewed_log(rnd)
    raw = [f"{at.isoformat()}Z {line}" for at, line in log]
    printed: list[str] = []
    cursor, end = LogCursor(), 0
    while end < len(log):
        start, end = end, min(len(log), end + rnd.randint(1, 120))
        last = log[start - 1][0] if start else log[0][0]
        since = {
            "second": last.replace(microsecond=0) - datetime.timedelta(seconds=1),
            "seconds": last - datetime.timedelta(seconds=2 + rnd.random()),
            "follow": None,
        }[rnd.choice(("second", "seconds", "follow"))]
        read = (
            raw[start:end]
            if since is None
            else [r for (at, _), r in zip(log[:end], raw[:end], strict=True) if at >= since]
        )
        lines, cursor = new_log_lines(cursor, "\n".join(read))
        printed += lines
    assert printed == [line for _, line in log]
