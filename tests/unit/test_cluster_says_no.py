"""``retry_resources`` and the Kueue limits as pure decisions: the parse-time refusals, the memory arithmetic, where
each kind keeps the training container's resources, and the wait's preemption count and Workload check."""

from __future__ import annotations

import calendar
from typing import Any

import pytest

from airflow_provider_torchelastic import Elastic, TorchElasticOperator
from airflow_provider_torchelastic.core import causes
from airflow_provider_torchelastic.core.retry_resources import (
    check_retry_resources,
    escalate,
    format_memory,
    limit_range_max_memory,
    memory_bytes,
)
from airflow_provider_torchelastic.kubernetes.queue_limits import (
    QueueLimits,
    QueueWatch,
    admitted_but_held,
    note_preemption,
    preemption_limit,
)
from airflow_provider_torchelastic.kubernetes.requests import EmitLog, FetchJob, ReadWorkloads, Sleep
from airflow_provider_torchelastic.kubernetes.training_resources import (
    missing_memory,
    training_resources,
    with_training_resources,
)
from airflow_provider_torchelastic.kubernetes.wait import wait_for_job
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitPolicy
from airflow_provider_torchelastic.pod import PodOptions

IMAGE = "local/torchelastic-runner:test"
MEMORY = PodOptions(limits={"memory": "256Mi"})


def operator(**kwargs: Any) -> TorchElasticOperator:
    values: dict[str, Any] = {
        "task_id": "train",
        "python_callable": print,
        "image": IMAGE,
        "execution": "kubernetes",
        "task_config": Elastic(nnodes=2),
    }
    values.update(kwargs)
    return TorchElasticOperator(**values)


# --- retry_resources at parse time -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [(1.0, ValueError), (0.5, ValueError), (float("inf"), ValueError), (True, TypeError), ("2x", TypeError)],
)
def test_retry_resources_refuses_what_is_not_a_factor_above_one_or_a_callable(value: object, error: type) -> None:
    with pytest.raises(error, match=r"^retry_resources: expected a factor > 1 .* got "):
        operator(retry_resources=value, pod_options=MEMORY)


def test_retry_resources_refuses_a_task_without_memory_naming_the_replica() -> None:
    with pytest.raises(ValueError, match=r"retry_resources: expected a memory request or limit .* none on Worker"):
        operator(retry_resources=2.0)


def test_retry_resources_refuses_local_execution() -> None:
    with pytest.raises(ValueError, match=r"retry_resources: expected None with execution='local'"):
        operator(retry_resources=2.0, execution="local")


def test_retry_resources_takes_a_factor_or_a_callable() -> None:
    assert operator(retry_resources=2, pod_options=MEMORY).retry_resources == 2.0

    def more(try_number: int, cause: str, resources: Any) -> Any:
        return resources

    assert operator(retry_resources=more, pod_options=MEMORY).retry_resources is more
    assert check_retry_resources(None) is None


def test_max_preemptions_is_an_int_of_at_least_one() -> None:
    assert operator(max_preemptions=2).max_preemptions == 2
    with pytest.raises(ValueError, match=r"^max_preemptions: expected an int >= 1, got 0"):
        operator(max_preemptions=0)
    with pytest.raises(TypeError, match=r"^max_preemptions: expected an int >= 1, got 1.5"):
        operator(max_preemptions=1.5)


def test_golden_manifests_are_unchanged_when_the_options_are_unset() -> None:
    plain = operator(pod_options=MEMORY).render_manifests()
    assert operator(pod_options=MEMORY, max_preemptions=2, retry_resources=2.0).render_manifests() == plain


# --- memory arithmetic ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quantity", "size"),
    [("256Mi", 256 * 2**20), ("1Gi", 2**30), ("1G", 10**9), (268435456, 268435456), ("1.5Gi", 3 * 2**29), ("x", None)],
)
def test_memory_bytes(quantity: object, size: int | None) -> None:
    assert memory_bytes(quantity) == size


def test_format_memory_rounds_up_to_a_whole_mi() -> None:
    assert [format_memory(n) for n in (2**30, 512 * 2**20, 10**9)] == ["1Gi", "512Mi", "954Mi"]


def test_a_factor_scales_memory_requests_and_limits_only_and_the_cap_cuts() -> None:
    resources = {"requests": {"memory": "256Mi", "cpu": "1"}, "limits": {"memory": "1Gi"}}
    new, cut = escalate(2.0, resources, try_number=2, cause=causes.OUT_OF_MEMORY, cap=64 * 2**30)
    assert (new, cut) == ({"requests": {"memory": "512Mi", "cpu": "1"}, "limits": {"memory": "2Gi"}}, False)
    new, cut = escalate(2.0, resources, try_number=2, cause=causes.OUT_OF_MEMORY, cap=1536 * 2**20)
    assert (new["limits"]["memory"], new["requests"]["memory"], cut) == ("1536Mi", "512Mi", True)


def test_a_callable_decides_and_its_answer_is_checked() -> None:
    seen = []

    def plus_one_gi(try_number: int, cause: str, resources: Any) -> Any:
        seen.append((try_number, cause, resources))
        return {"limits": {"memory": "1280Mi"}}

    new, _ = escalate(plus_one_gi, {"limits": {"memory": "256Mi"}}, try_number=3, cause="out_of_memory", cap=2**40)
    assert new == {"limits": {"memory": "1280Mi"}}
    assert seen == [(3, "out_of_memory", {"limits": {"memory": "256Mi"}})]
    with pytest.raises(TypeError, match=r"retry_resources\(\) returned: expected a mapping"):
        escalate(lambda *a: 42, {"limits": {"memory": "256Mi"}}, try_number=2, cause="", cap=2**40)


def test_the_smallest_container_max_of_the_limit_ranges_caps() -> None:
    ranges = [
        {
            "spec": {
                "limits": [{"type": "Container", "max": {"memory": "8Gi"}}, {"type": "Pod", "max": {"memory": "1Gi"}}]
            }
        },
        {"spec": {"limits": [{"type": "Container", "max": {"memory": "4Gi"}}]}},
    ]
    assert limit_range_max_memory(ranges) == 4 * 2**30
    assert limit_range_max_memory([{"spec": {"limits": [{"type": "Container", "max": {"cpu": "2"}}]}}]) is None


# --- where each kind keeps the training container's resources ----------------------------------------------------


@pytest.mark.parametrize(("nnodes", "replicas"), [(2, ["Worker"]), (1, ["pod"])])
def test_training_resources_of_every_replica_are_read_and_replaced(nnodes: int, replicas: list[str]) -> None:
    workload = operator(pod_options=MEMORY, task_config=Elastic(nnodes=nnodes)).render_manifests()[-1]
    assert list(training_resources(workload)) == replicas
    assert missing_memory(workload) == []
    raised = {replica: {"limits": {"memory": "512Mi"}} for replica in replicas}
    changed = with_training_resources(workload, raised)
    assert training_resources(changed) == raised
    assert training_resources(workload)[replicas[0]] == {"limits": {"memory": "256Mi"}}, "the input is not changed"


def test_a_trainjob_keeps_them_in_resources_per_node() -> None:
    workload = {"kind": "TrainJob", "spec": {"trainer": {"resourcesPerNode": {"limits": {"memory": "1Gi"}}}}}
    assert training_resources(workload) == {"trainer": {"limits": {"memory": "1Gi"}}}
    changed = with_training_resources(workload, {"trainer": {"limits": {"memory": "2Gi"}}})
    assert changed["spec"]["trainer"]["resourcesPerNode"] == {"limits": {"memory": "2Gi"}}


# --- Kueue limits ------------------------------------------------------------------------------------------------

REF = JobRef(kind="PyTorchJob", name="job", namespace="ns")
#: 2027-01-15T08:00:00Z, when the jobs below were created (and the Workloads admitted).
ADMITTED = calendar.timegm((2027, 1, 15, 8, 0, 0))
T0 = ADMITTED + 3600.0


def job(*, suspended: bool, queue: bool = True, suspended_at: str = "2027-01-15T08:00:00Z") -> dict[str, Any]:
    conditions = [{"type": "Suspended", "status": "True", "lastTransitionTime": suspended_at}] if suspended else []
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": "job",
            "uid": "u-1",
            "creationTimestamp": "2027-01-15T08:00:00Z",
            "labels": {"kueue.x-k8s.io/queue-name": "q"} if queue else {},
        },
        "spec": {"runPolicy": {"suspend": suspended}, "pytorchReplicaSpecs": {"Worker": {"replicas": 2}}},
        "status": {"conditions": conditions},
    }


def test_a_preemption_is_a_suspension_after_the_job_ran() -> None:
    watch = QueueWatch()
    assert not note_preemption(watch, job(suspended=True)), "queued at first: not a preemption"
    assert not note_preemption(watch, job(suspended=False))
    assert note_preemption(watch, job(suspended=True))
    assert not note_preemption(watch, job(suspended=True)), "still the same preemption"
    assert watch.preemptions == 1


def test_the_limit_counts_earlier_tries() -> None:
    watch = QueueWatch(preemptions=1)
    assert preemption_limit(REF, QueueLimits(max_preemptions=3, preemptions_before=1), watch) is None
    decision = preemption_limit(REF, QueueLimits(max_preemptions=2, preemptions_before=1), watch)
    assert decision is not None and decision.stop and decision.verdict is not None
    assert (decision.verdict.cause, decision.verdict.recoverable) == (causes.PREEMPTED, True)
    assert (
        "preemption 2 of this task instance (1 in earlier tries) reaches max_preemptions=2" in decision.verdict.detail
    )


def workload(*, admitted_at: str | None, uid: str = "u-1") -> dict[str, Any]:
    conditions = [{"type": "Admitted", "status": "True", "lastTransitionTime": admitted_at}] if admitted_at else []
    return {
        "metadata": {"name": "pytorchjob-job-abcde", "labels": {"kueue.x-k8s.io/job-uid": uid}},
        "status": {"conditions": conditions, "admission": {"clusterQueue": "cq"}},
    }


def test_an_admitted_workload_fails_a_held_job_only_after_the_grace() -> None:
    held = job(suspended=True)
    stamp = "2027-01-15T08:00:00Z"
    assert admitted_but_held(REF, held, [workload(admitted_at=None)], 60, T0) is None
    assert admitted_but_held(REF, held, [workload(admitted_at=stamp, uid="other")], 60, T0) is None
    assert admitted_but_held(REF, held, [workload(admitted_at=stamp)], 60, ADMITTED + 30) is None
    decision = admitted_but_held(REF, held, [workload(admitted_at=stamp)], 60, ADMITTED + 90)
    assert decision is not None and decision.verdict is not None and decision.stop
    assert (decision.verdict.cause, decision.verdict.recoverable) == (causes.CONFIGURATION, False)
    expected = "Kueue Workload ns/pytorchjob-job-abcde was admitted to ClusterQueue cq 90 s ago"
    assert decision.verdict.detail.startswith(expected)
    assert "version skew" in decision.verdict.detail


def drive(snapshots: list[dict[str, Any] | None], *, limits: QueueLimits, workloads: Any = ()) -> tuple[Any, list]:
    """Drive the wait over ``snapshots`` (one per poll, a second apart); the decision and the requests it made."""
    flow = wait_for_job(REF, WaitPolicy(poll_interval=1, pending_grace_seconds=2, finish_action="keep"), limits)
    made: list[Any] = []
    answer: Any = None
    polls = iter(snapshots)
    now = ADMITTED
    while True:
        try:
            request = flow.send(answer)
        except StopIteration as stop:
            return stop.value, made
        made.append(request)
        answer = None
        if isinstance(request, FetchJob):
            now += 1
            answer = Snapshot(job=next(polls), now=now)
        elif isinstance(request, ReadWorkloads):
            answer = list(workloads)
        elif isinstance(request, Sleep | EmitLog):
            pass


def test_the_wait_fails_at_the_preemption_that_reaches_the_limit() -> None:
    snapshots = [job(suspended=False), job(suspended=True), job(suspended=False), job(suspended=True)]
    decision, made = drive(snapshots, limits=QueueLimits(max_preemptions=2))
    assert decision.phase is Phase.FAILED and decision.verdict.cause == causes.PREEMPTED
    assert decision.verdict.preemptions == 2, "the verdict carries this try's count to the state store"
    logs = [r.line for r in made if isinstance(r, EmitLog)]
    assert any("preemption 1 of this task instance" in line for line in logs), logs


def test_the_wait_reads_the_workloads_of_a_job_held_past_the_grace_only() -> None:
    admitted = workload(admitted_at="2027-01-15T08:00:00Z")
    snapshots = [job(suspended=True)] * 6
    decision, made = drive(snapshots, limits=QueueLimits(), workloads=[admitted])
    reads = [r for r in made if isinstance(r, ReadWorkloads)]
    assert reads and reads[0] == ReadWorkloads("ns", "u-1")
    assert decision.verdict.cause == causes.CONFIGURATION
    unqueued = [job(suspended=True, queue=False)] * 5 + [None]
    _, made = drive(unqueued, limits=QueueLimits(), workloads=[admitted])
    assert not [r for r in made if isinstance(r, ReadWorkloads)], "a job in no queue has no Workload to read"
