"""Decisions that must hold against the real Kubeflow training operator (kubeflow/trainer v1.9.4), not only against
the kinder simulation: the deadline on a quiet job, both Succeeded and Failed, a job its TTL deleted as it failed,
and an elastic job whose rendezvous host cannot be scheduled. Fake clock, no I/O."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from airflow_provider_torchelastic.core.outcome import WorkerFailure, encode_failure, encode_success
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.wait import drive_async, drive_sync, wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitDecision, WaitPolicy

T0 = 1_800_000_000.0
STAMP0 = "2027-01-15T08:00:00Z"  # == T0
JOB = JobRef(kind="PyTorchJob", name="train-abc", namespace="ml")
POLICY = WaitPolicy(poll_interval=5, pending_grace_seconds=60)


def decide(snapshot: Snapshot, policy: WaitPolicy = POLICY) -> WaitDecision:
    return kinds.get(JOB.kind).decide(JOB, snapshot, policy)


def job(
    *conditions: str,
    run_policy: dict[str, Any] | None = None,
    elastic: bool = False,
    workers: int = 2,
    started: bool = True,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"pytorchReplicaSpecs": {"Worker": {"replicas": workers}}}
    if run_policy:
        spec["runPolicy"] = run_policy
    if elastic:
        spec["elasticPolicy"] = {"minReplicas": 1, "maxReplicas": workers, "rdzvBackend": "c10d"}
    status: dict[str, Any] = {"conditions": [{"type": c, "status": "True", "message": ""} for c in conditions]}
    if started:
        status["startTime"] = STAMP0
    return {
        "kind": "PyTorchJob",
        "metadata": {"name": JOB.name, "namespace": "ml", "creationTimestamp": STAMP0},
        "spec": spec,
        "status": status,
    }


def pod(name: str, phase: str = "Running", *, exit_code: int | None = None, message: str | None = None) -> Any:
    container: dict[str, Any] = {"name": "pytorch", "state": {"running": {}}, "restartCount": 0}
    if exit_code is not None:
        reason = "Completed" if exit_code == 0 else "Error"
        container["state"] = {"terminated": {"exitCode": exit_code, "message": message, "reason": reason}}
    return {
        "metadata": {"name": name, "creationTimestamp": STAMP0},
        "status": {"phase": phase, "containerStatuses": [container]},
    }


def unschedulable(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": STAMP0},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes fit"}
            ],
        },
    }


def failure(rank: int, *, recoverable: bool = False) -> str:
    return encode_failure(
        WorkerFailure(rank=rank, exception="ValueError", message="bad batch", recoverable=recoverable, timestamp=T0)
    )


# --- activeDeadlineSeconds: the operator checks it only on events (common/job.go:211), so the wait does --------------


def test_a_quiet_job_past_its_active_deadline_fails_and_is_stopped() -> None:
    quiet = job("Created", "Running", run_policy={"activeDeadlineSeconds": 30})
    before = decide(Snapshot(job=quiet, pods=[pod("w0"), pod("w1")], now=T0 + 29))
    assert before.phase is Phase.RUNNING and before.wake_at == T0 + 30
    after = decide(Snapshot(job=quiet, pods=[pod("w0"), pod("w1")], now=T0 + 30))
    assert after.phase is Phase.FAILED and after.stop
    assert after.verdict is not None and not after.verdict.recoverable
    assert "active_deadline_seconds=30" in after.verdict.detail


def test_the_deadline_counts_from_the_start_time_not_creation() -> None:
    late = job("Created", "Running", run_policy={"activeDeadlineSeconds": 30})
    late["status"]["startTime"] = "2027-01-15T08:01:00Z"  # started 60 s after it was created (queued, resumed)
    assert decide(Snapshot(job=late, pods=[pod("w0")], now=T0 + 80)).phase is Phase.RUNNING
    assert decide(Snapshot(job=late, pods=[pod("w0")], now=T0 + 90)).phase is Phase.FAILED


def test_no_deadline_runs_for_a_job_that_has_not_started_or_is_suspended() -> None:
    queued = job("Created", run_policy={"activeDeadlineSeconds": 5}, started=False)
    assert decide(Snapshot(job=queued, now=T0 + 600)).phase is Phase.PENDING
    suspended = job("Created", "Suspended", run_policy={"activeDeadlineSeconds": 5, "suspend": True})
    assert decide(Snapshot(job=suspended, now=T0 + 600)).phase is Phase.PENDING


@pytest.mark.parametrize("action", ["keep", "delete_succeeded", "delete"])
@pytest.mark.parametrize("driver", ["sync", "async"])
def test_the_wait_wakes_at_the_deadline_and_deletes_the_job_whatever_on_finish_action(action: str, driver: str) -> None:
    quiet = job("Created", "Running", run_policy={"activeDeadlineSeconds": 12})
    clock = [T0]
    deleted: list[JobRef] = []

    class Source:
        def snapshot(self, ref: JobRef) -> Snapshot:
            return Snapshot(job=quiet, pods=[pod("w0"), pod("w1")], now=clock[0])

        def read_log(self, *args: Any, **kwargs: Any) -> str:
            return ""

        def delete_job(self, ref: JobRef) -> bool:
            deleted.append(ref)
            return True

    class AsyncSource:
        async def snapshot(self, ref: JobRef) -> Snapshot:
            return Source().snapshot(ref)

        async def read_log(self, *args: Any, **kwargs: Any) -> str:
            return ""

        async def delete_job(self, ref: JobRef) -> bool:
            return Source().delete_job(ref)

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    async def asleep(seconds: float) -> None:
        clock[0] += seconds

    lines: list[str] = []
    flow = wait_for_job(JOB, WaitPolicy(poll_interval=10, finish_action=action))
    if driver == "sync":
        decision = drive_sync(flow, Source(), lines.append, sleep=sleep)
    else:
        decision = asyncio.run(drive_async(flow, AsyncSource(), lines.append, sleep=asleep))
    assert clock[0] == T0 + 12, "polls at 0 and 10, then wakes exactly at the deadline"
    assert decision.phase is Phase.FAILED and "active_deadline_seconds=12" in decision.verdict.detail
    assert deleted == [JOB], "a job stopped at its deadline must not keep its pods"
    assert any(line.startswith("Stopping PyTorchJob ml/train-abc") for line in lines)


def test_a_job_the_operator_already_failed_at_its_deadline_keeps_the_operators_words() -> None:
    failed = job("Created", "Running", "Failed", run_policy={"activeDeadlineSeconds": 30})
    failed["status"]["conditions"][-1]["message"] = (
        "Job train-abc has failed because it was active longer than specified deadline"
    )
    d = decide(Snapshot(job=failed, pods=[], now=T0 + 40))
    assert d.phase is Phase.FAILED and not d.stop
    assert d.verdict is not None and "active_deadline_seconds=30" in d.verdict.detail


# --- both Succeeded and Failed in one pass (pytorchjob_controller.go:409-443) -----------------------------------------


def test_both_succeeded_and_failed_is_a_failure_named_by_the_failed_rank() -> None:
    both = job("Created", "Running", "Succeeded", "Failed", elastic=True)
    pods = [
        pod("w0", "Succeeded", exit_code=0, message=encode_success('{"loss": 0.1}')),
        pod("w1", "Failed", exit_code=1, message=failure(3)),
    ]
    d = decide(Snapshot(job=both, pods=pods, now=T0 + 20))
    assert d.phase is Phase.FAILED and d.verdict is not None
    assert d.verdict.node == "w1" and d.verdict.failure is not None and d.verdict.failure.rank == 3
    assert "both Succeeded and Failed" in d.verdict.detail


def test_both_conditions_decide_the_same_whichever_the_operator_wrote_first() -> None:
    pods = [
        pod("w0", "Succeeded", exit_code=0, message=encode_success('{"loss": 0.1}')),
        pod("w1", "Failed", exit_code=1, message=failure(1)),
    ]
    verdicts = set()
    for order in (("Succeeded", "Failed"), ("Failed", "Succeeded")):
        d = decide(Snapshot(job=job("Created", *order, elastic=True), pods=pods, now=T0 + 20))
        assert d.verdict is not None
        verdicts.add((d.phase, d.verdict.node, d.verdict.recoverable))
    assert verdicts == {(Phase.FAILED, "w1", False)}


# --- TTL 0: deleted before Failed is written (common/job.go:233 before :247) ------------------------------------------


def test_a_job_its_ttl_deleted_as_it_failed_is_judged_by_its_last_pods() -> None:
    last = Snapshot(
        job=job("Created", "Running", run_policy={"ttlSecondsAfterFinished": 0, "backoffLimit": 0}),
        pods=[pod("w0", "Failed", exit_code=1, message=failure(0)), pod("w1")],
        now=T0 + 10,
    )
    d = decide(Snapshot(job=None, now=T0 + 12, last_seen=last))
    assert d.phase is Phase.FAILED and d.verdict is not None
    assert not d.verdict.recoverable, "the pod said why: a retry would fail the same way"
    assert d.verdict.node == "w0" and "ttlSecondsAfterFinished" in d.verdict.detail


def test_a_job_its_ttl_deleted_at_its_deadline_is_a_deadline_failure() -> None:
    last = Snapshot(
        job=job("Created", "Running", run_policy={"ttlSecondsAfterFinished": 0, "activeDeadlineSeconds": 10}),
        pods=[pod("w0"), pod("w1")],
        now=T0 + 9,
    )
    d = decide(Snapshot(job=None, now=T0 + 11, last_seen=last))
    assert d.phase is Phase.FAILED and d.verdict is not None and not d.verdict.recoverable
    assert "active_deadline_seconds=10" in d.verdict.detail


def test_a_job_its_ttl_deleted_after_its_backoff_limit_is_not_retried() -> None:
    restarted = pod("w0")
    restarted["status"]["containerStatuses"][0]["restartCount"] = 2
    last = Snapshot(
        job=job("Created", "Running", run_policy={"ttlSecondsAfterFinished": 0, "backoffLimit": 2}),
        pods=[restarted, pod("w1")],
        now=T0 + 9,
    )
    d = decide(Snapshot(job=None, now=T0 + 11, last_seen=last))
    assert d.phase is Phase.FAILED and d.verdict is not None and not d.verdict.recoverable
    assert "backoffLimit=2" in d.verdict.detail


@pytest.mark.parametrize("run_policy", [None, {"ttlSecondsAfterFinished": 0}])
def test_a_job_deleted_without_evidence_of_a_failure_may_be_retried(run_policy: dict[str, Any] | None) -> None:
    last = Snapshot(job=job("Created", "Running", run_policy=run_policy), pods=[pod("w0")], now=T0 + 9)
    d = decide(Snapshot(job=None, now=T0 + 11, last_seen=last))
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert "deleted before it finished" in d.verdict.detail


def test_the_wait_keeps_what_it_saw_last_for_a_job_that_vanishes() -> None:
    answers = [
        Snapshot(
            job=job("Created", "Running", run_policy={"ttlSecondsAfterFinished": 0}),
            pods=[pod("w0", "Failed", exit_code=1, message=failure(0))],
            now=T0,
        ),
        Snapshot(job=None, now=T0 + 5),
    ]

    class Source:
        def snapshot(self, ref: JobRef) -> Snapshot:
            return answers.pop(0)

        def read_log(self, *args: Any, **kwargs: Any) -> str:
            return ""

        def delete_job(self, ref: JobRef) -> bool:
            return False

    policy = WaitPolicy(poll_interval=5, pending_grace_seconds=60)
    decision = drive_sync(wait_for_job(JOB, policy), Source(), lambda line: None, sleep=lambda s: None)
    assert decision.phase is Phase.FAILED and not decision.verdict.recoverable


# --- elastic rendezvous: only <job>-worker-0 hosts the c10d store -----------------------------------------------------


def test_an_elastic_job_whose_worker_0_cannot_be_scheduled_waits_for_capacity_then_times_out() -> None:
    elastic = job("Created", "Running", elastic=True)
    pods = [unschedulable("train-abc-worker-0"), pod("train-abc-worker-1")]
    policy = WaitPolicy(poll_interval=5, scheduling_timeout=120)
    d = decide(Snapshot(job=elastic, pods=pods, now=T0 + 60), policy)
    assert d.phase is Phase.PENDING and "hosts the rendezvous" in d.progress
    d = decide(Snapshot(job=elastic, pods=pods, now=T0 + 121), policy)
    assert d.phase is Phase.FAILED and d.verdict is not None and d.verdict.recoverable
    assert d.verdict.node == "train-abc-worker-0" and "scheduling_timeout=120" in d.verdict.detail


def test_an_elastic_job_runs_on_partial_capacity_while_worker_0_runs() -> None:
    elastic = job("Created", "Running", elastic=True)
    pods = [pod("train-abc-worker-0"), unschedulable("train-abc-worker-1")]
    d = decide(Snapshot(job=elastic, pods=pods, now=T0 + 600), WaitPolicy(scheduling_timeout=120))
    assert d.phase is Phase.RUNNING


# --- 403: an admission webhook's denial is not RBAC's ---------------------------------------------------------


def _api_error(body: dict[str, Any]) -> Any:
    from airflow_provider_torchelastic.kubernetes.client import _from_api_exception

    class ApiException(Exception):
        status = body["code"]
        reason = "Forbidden"

    error = ApiException()
    error.body = json.dumps(body)  # type: ignore[attr-defined]
    return _from_api_exception(error)


#: What kube-apiserver answers when RBAC refuses the identity: ``details`` names the resource.
RBAC_403 = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "message": 'pytorchjobs.kubeflow.org is forbidden: User "system:serviceaccount:ml:airflow" cannot create '
    'resource "pytorchjobs" in API group "kubeflow.org" in the namespace "ml"',
    "reason": "Forbidden",
    "details": {"group": "kubeflow.org", "kind": "pytorchjobs"},
    "code": 403,
}
#: What it answers when a validating webhook denies the object (controller-runtime's ``admission.Denied``).
WEBHOOK_403 = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied the request: '
    "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1",
    "reason": "Forbidden",
    "code": 403,
}


def test_a_webhook_denial_and_an_rbac_refusal_are_told_apart_by_the_status_not_its_text() -> None:
    from airflow_provider_torchelastic.operators.backends.kubernetes import _submit_error

    rbac, webhook = _api_error(RBAC_403), _api_error(WEBHOOK_403)
    assert (rbac.status, webhook.status) == (403, 403)
    assert not rbac.denied_by_admission and webhook.denied_by_admission
    assert "lacks permission" in str(_submit_error(JOB, rbac))
    refused = str(_submit_error(JOB, webhook))
    assert "admission webhook refused the object" in refused and "permission" not in refused
    assert "must be 1" in refused and "a retry will not help" in refused
