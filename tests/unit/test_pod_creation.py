"""A PyTorchJob whose pods the API server refuses: the training operator's ``FailedCreatePod`` Warning is the only
trace, so the wait reads the job's events once it has had no pods for ``pending_grace_seconds``, and waits for a
quota, fails at once on a refusal that will not change, or shows the words it does not know. Pure: JSON, a fake
clock."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.pod_creation import CreateRefusal, create_error_of, create_refusal
from airflow_provider_torchelastic.kubernetes.requests import FetchJob, ReadEvents, ReadLog
from airflow_provider_torchelastic.kubernetes.wait import wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

T0 = 1_800_000_000.0
STAMP0 = "2027-01-15T08:00:00Z"  # == T0
JOB = JobRef(kind="PyTorchJob", name="train-abc", namespace="ml")
POD = 'pods "train-abc-worker-0" is forbidden'
# The API server's words (its admission plugins' and a webhook's), as the training operator records them.
QUOTA = f"Error creating: {POD}: exceeded quota: compute, requested: cpu=2, used: cpu=3, limited: cpu=4"
PERMANENT = {
    "pod security": f'Error creating: {POD}: violates PodSecurity "restricted:latest": allowPrivilegeEscalation '
    '!= false (container "pytorch" must set securityContext.allowPrivilegeEscalation=false)',
    "limit range": f"Error creating: {POD}: maximum cpu usage per Container is 1, but limit is 2",
    "limit range minimum": f"Error creating: {POD}: minimum memory usage per Pod is 1Gi, but request is 512Mi",
    "webhook": 'Error creating: admission webhook "validate.kyverno.svc-fail" denied the request: policy x: y',
}
UNKNOWN = {
    "webhook down": 'Error creating: Internal error occurred: failed calling webhook "v.example.com": Post '
    '"https://v.example.svc:443/validate": dial tcp 10.0.0.1:443: connect: connection refused',
    "service account": f'Error creating: {POD}: error looking up service account ml/trainer: serviceaccount "trainer" '
    "not found",
}


def event(message: str, when: str, *, reason: str = "FailedCreatePod", kind: str = "Warning") -> dict[str, Any]:
    return {"reason": reason, "type": kind, "message": message, "lastTimestamp": when}


def test_a_quota_is_waited_for_and_what_will_not_change_is_not() -> None:
    assert create_refusal(QUOTA) is CreateRefusal.QUOTA
    for name, message in PERMANENT.items():
        assert create_refusal(message) is CreateRefusal.PERMANENT, name
    for name, message in UNKNOWN.items():
        assert create_refusal(message) is CreateRefusal.UNKNOWN, name


def test_the_newest_failed_create_warning_is_the_jobs_create_error() -> None:
    events = [
        event("Error creating: older", "2027-01-15T08:00:10Z"),
        event(QUOTA, "2027-01-15T08:00:40Z"),
        event("Created pod: train-abc-master-0", "2027-01-15T08:00:50Z", reason="SuccessfulCreatePod", kind="Normal"),
        event("not a warning", "2027-01-15T08:00:55Z", kind="Normal"),
    ]
    assert create_error_of(events) == QUOTA
    assert create_error_of([]) == ""


def _job(*conditions: dict[str, str]) -> dict[str, Any]:
    template = {"spec": {"containers": [{"name": "pytorch", "image": "img:1"}]}}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": JOB.name, "namespace": JOB.namespace, "creationTimestamp": STAMP0},
        "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2, "template": template}}},
        "status": {"conditions": [{"type": "Created", "status": "True"}, *conditions]},
    }


def _wait(
    policy: WaitPolicy, polls: list[float], events: list[dict[str, Any]], job: dict[str, Any] | None = None
) -> tuple[WaitDecision, list[Any]]:
    """Drive the wait over a job without pods; returns its decision and what it asked besides the job."""
    job = job or _job()
    flow = wait_for_job(JOB, policy)
    asked: list[Any] = []
    request = next(flow)
    try:
        while True:
            if isinstance(request, FetchJob):
                if not polls:
                    raise AssertionError(f"still waiting; asked {asked}")
                request = flow.send(Snapshot(job=job, pods=[], now=polls.pop(0)))
            elif isinstance(request, ReadEvents):
                asked.append(request)
                request = flow.send(events)
            else:
                asked.append(request)
                request = flow.send("" if isinstance(request, ReadLog) else None)
    except StopIteration as stop:
        return stop.value, asked


def test_a_refusal_that_will_not_change_fails_the_try_once_the_grace_is_over() -> None:
    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=30)
    decision, asked = _wait(policy, [T0 + 10, T0 + 31], [event(PERMANENT["pod security"], "2027-01-15T08:00:05Z")])
    reads = [request for request in asked if isinstance(request, ReadEvents)]
    assert reads == [ReadEvents("train-abc", "ml", kind="PyTorchJob")], "none before the grace, one after"
    assert decision.phase is Phase.FAILED and decision.verdict is not None
    assert decision.verdict.cause == causes.CONFIGURATION and not decision.verdict.recoverable
    assert decision.verdict.detail == (
        "PyTorchJob ml/train-abc: the Kubeflow training operator cannot create its pods: "
        f"{PERMANENT['pod security']}; fix the task's pod options, or the namespace's policy; a retry would meet the "
        "same refusal"
    )


def test_a_quota_is_capacity_bounded_by_scheduling_timeout() -> None:
    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=30, scheduling_timeout=300)
    decision, asked = _wait(policy, [T0 + 31, T0 + 200, T0 + 301], [event(QUOTA, "2027-01-15T08:00:05Z")])
    progress = [request.line for request in asked if hasattr(request, "line")]
    assert any(
        f"waiting for capacity: the Kubeflow training operator cannot create its pods: {QUOTA}" in line
        for line in progress
    ), progress
    assert decision.phase is Phase.FAILED and decision.verdict is not None
    assert decision.verdict.cause == causes.UNSCHEDULABLE and decision.verdict.recoverable
    assert QUOTA in decision.verdict.detail


@pytest.mark.parametrize("message", UNKNOWN.values(), ids=UNKNOWN.keys())
def test_words_it_does_not_know_are_shown_and_waited_on(message: str) -> None:
    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=30, scheduling_timeout=60)
    with pytest.raises(AssertionError, match="still waiting") as waiting:
        _wait(policy, [T0 + 31, T0 + 1000], [event(message, "2027-01-15T08:00:05Z")])
    assert f"no pods: the Kubeflow training operator cannot create its pods: {message}" in str(waiting.value)


def test_a_job_that_ran_is_not_judged_by_a_stale_failed_create() -> None:
    """Its pods were all replaced (a restart): the operator's Warning of before it ran says nothing of now."""
    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=30)
    ran = _job({"type": "Running", "status": "False"}, {"type": "Restarting", "status": "True"})
    with pytest.raises(AssertionError, match="still waiting"):
        _wait(policy, [T0 + 31, T0 + 60], [event(PERMANENT["limit range"], "2027-01-15T08:00:05Z")], ran)


def test_the_events_are_read_paced_and_what_was_read_holds_between_reads() -> None:
    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=30)
    polls = [T0 + 31 + 5 * i for i in range(13)]  # a minute of polls after the grace
    with pytest.raises(AssertionError, match="still waiting") as waiting:
        _wait(policy, polls, [event(UNKNOWN["webhook down"], "2027-01-15T08:00:05Z")])
    asked = str(waiting.value)
    assert asked.count("ReadEvents(") == 3, "at 31 s, 61 s and 91 s: once per pending_grace_seconds"
    # Between two reads the job stands where the last read put it: every progress line (the change, the heartbeat)
    # says so, none falls back to "Created".
    assert asked.count("EmitLog(") == asked.count("no pods: the Kubeflow training operator cannot create") == 2, asked
