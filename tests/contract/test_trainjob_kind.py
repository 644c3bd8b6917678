"""The TrainJob kind on its own: what it cannot run (the parse-time check), its runtime, its pods and its decisions
(the same wait decisions as the other kinds, from TrainJob and pod JSON with a fake clock), and that it is not in
the table of kinds yet."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from airflow_provider_torchelastic.core.config import (
    CleanPodPolicy,
    Elastic,
    Master,
    PyTorch,
    RestartPolicy,
    RunPolicy,
    TaskConfig,
    Worker,
)
from airflow_provider_torchelastic.core.outcome import WorkerFailure, encode_failure, encode_success
from airflow_provider_torchelastic.core.pod_options import PodOptions
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.kinds import trainjob
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Phase, Snapshot, WaitPolicy
from tests.contract.trainjob_schemas import TORCH_DISTRIBUTED, load, validate_training_runtime

T0 = 1_800_000_000.0
STAMP0 = "2027-01-15T08:00:00Z"  # == T0
NAME = "train-abc"
REF = JobRef(kind="TrainJob", name=NAME, namespace="ml")
POLICY = WaitPolicy(poll_interval=5, pending_grace_seconds=60, scheduling_timeout=600)


# ------------------------------------------------------------------------------------------- what it cannot run


@pytest.mark.parametrize(
    ("config", "named", "why"),
    [
        (Elastic(nnodes="2:4"), "Elastic.nnodes", "KEP-2903"),
        (Elastic(nnodes=1), "Elastic.nnodes", "one node runs as a Pod"),
        (Elastic(nnodes=2, max_restarts=2), "Elastic.max_restarts", "static rendezvous"),
        (PyTorch(worker=Worker(replicas=0)), "PyTorch.worker.replicas", "one node"),
        (
            PyTorch(master=Master(restart_policy=RestartPolicy.ON_FAILURE), worker=Worker(replicas=1)),
            "PyTorch.master.restart_policy",
            "no restart policy field",
        ),
        (
            PyTorch(worker=Worker(replicas=1, restart_policy=RestartPolicy.EXIT_CODE)),
            "PyTorch.worker.restart_policy",
            "'ExitCode'",
        ),
        (
            PyTorch(master=Master(limits={"nvidia.com/gpu": "8"}), worker=Worker(replicas=2)),
            "PyTorch.master.limits",
            "",
        ),
        (PyTorch(master=Master(image="a/b:1"), worker=Worker(replicas=2)), "PyTorch.master.image", "same pod"),
        (
            PyTorch(master=Master(pod=PodOptions(labels={"a": "b"})), worker=Worker(replicas=2)),
            "PyTorch.master.pod",
            "",
        ),
        (Elastic(nnodes=2, run_policy=RunPolicy(backoff_limit=3)), "RunPolicy.backoff_limit", "no such field"),
        (Elastic(nnodes=2, run_policy=RunPolicy(ttl_seconds_after_finished=60)), "RunPolicy.ttl_seconds", ""),
        (Elastic(nnodes=2, run_policy=RunPolicy(clean_pod_policy=CleanPodPolicy.ALL)), "RunPolicy.clean_pod", "'All'"),
        (Elastic(nnodes=100_000), "node count", "5 digits"),
    ],
)
def test_what_a_trainjob_cannot_run_is_a_clear_error(config: TaskConfig, named: str, why: str) -> None:
    assert not trainjob.accepts(config)
    with pytest.raises(ValueError) as raised:
        trainjob.check_trainjob_config(config)
    message = str(raised.value)
    assert named in message and why in message and "a TrainJob cannot take" in message


@pytest.mark.parametrize(
    "config",
    [
        Elastic(nnodes=2),
        Elastic(nnodes="3:3"),
        Elastic(nnodes=2, run_policy=RunPolicy(active_deadline_seconds=60)),
        PyTorch(worker=Worker(replicas=1)),
        PyTorch(
            master=Master(limits={"nvidia.com/gpu": "8"}), worker=Worker(replicas=3, limits={"nvidia.com/gpu": "8"})
        ),
    ],
)
def test_fixed_multi_node_configs_are_accepted(config: TaskConfig) -> None:
    trainjob.check_trainjob_config(config)
    assert trainjob.accepts(config)


# ------------------------------------------------------------------------------------------- the runtime


def test_the_torch_distributed_derivative_is_a_valid_runtime_and_the_default() -> None:
    runtime = load(TORCH_DISTRIBUTED)
    validate_training_runtime(runtime)
    assert trainjob.runtime_from_manifest(runtime) == trainjob.TORCH_DISTRIBUTED
    assert trainjob.TORCH_DISTRIBUTED.max_job_name_length == 44


def test_a_runtime_needs_a_trainer_job_with_a_node_container() -> None:
    with pytest.raises(ValueError, match=r"Runtime\.trainer_job"):
        trainjob.Runtime(containers={"launcher": ("launcher",)}, trainer_job="launcher")
    with pytest.raises(ValueError, match=r"Runtime\.kind"):
        trainjob.Runtime(kind="JobSet")


# ------------------------------------------------------------------------------------------- pods


def owned(kind: str, name: str, uid: str, owner_uid: str, owner_kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "metadata": {
            "name": name,
            "uid": uid,
            "ownerReferences": [{"kind": owner_kind, "name": NAME, "uid": owner_uid, "controller": True}],
        },
    }


def node_pod(
    index: int,
    phase: str = "Running",
    *,
    message: str | None = None,
    exit_code: int | None = None,
    reason: str | None = None,
    unschedulable: bool = False,
    owner: str = "job-uid",
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "node", "state": {"running": {}}}
    if exit_code is not None:
        terminated = {"exitCode": exit_code, "message": message, "reason": reason or "Error"}
        container["state"] = {"terminated": terminated}
    status: dict[str, Any] = {"phase": phase, "containerStatuses": [container]}
    if unschedulable:
        status = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no GPU"}],
        }
    pod = owned("Pod", f"{NAME}-node-0-{index}-x1y2z", f"pod-{index}", owner, "Job")
    pod["metadata"].update(
        creationTimestamp=STAMP0,
        labels={
            trainjob.JOBSET_NAME_LABEL: NAME,
            trainjob.REPLICATED_JOB_LABEL: "node",
            trainjob.JOB_INDEX_LABEL: "0",
            trainjob.COMPLETION_INDEX_LABEL: str(index),
        },
    )
    pod["spec"] = {"hostname": trainjob.node_hostname(NAME, index), "subdomain": NAME}
    pod["status"] = status
    return pod


def test_a_jobs_pods_are_those_its_controller_chain_leads_to() -> None:
    job = {"kind": "TrainJob", "metadata": {"name": NAME, "uid": "tj-uid"}}
    jobset = owned("JobSet", NAME, "js-uid", "tj-uid", "TrainJob")
    batch_job = owned("Job", f"{NAME}-node-0", "job-uid", "js-uid", "JobSet")
    ours, foreign = node_pod(0), node_pod(1, owner="someone-elses-job")
    pods_of = trainjob.KIND.pods_of(NAME)
    assert pods_of.pick(job, [ours, foreign], [jobset, batch_job]) == [ours]
    # Labels alone count for nothing, and without the Job and JobSet the chain cannot be followed.
    assert pods_of.pick(job, [ours], []) == []
    assert trainjob.KIND.controller_chain == ("Job", "JobSet", "TrainJob")


def test_node_0_is_the_rank_0_pod_and_its_hostname_is_the_master_address() -> None:
    assert trainjob.is_rank0_pod(node_pod(0)) and not trainjob.is_rank0_pod(node_pod(1))
    assert trainjob.node_hostname(NAME, 0) == "train-abc-node-0-0"
    assert trainjob.KIND.pod_selector(NAME) == (
        "jobset.sigs.k8s.io/jobset-name=train-abc,jobset.sigs.k8s.io/replicatedjob-name=node"
    )
    assert trainjob.KIND.pod_owner_label == "jobset.sigs.k8s.io/jobset-name"


# ------------------------------------------------------------------------------------------- decisions


def make_job(
    *conditions: tuple[str, str, str],
    nodes: int = 2,
    suspend: bool = False,
    queue: str = "",
    deadline: int | None = None,
) -> dict[str, Any]:
    job: dict[str, Any] = {
        "apiVersion": trainjob.API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": NAME, "namespace": "ml", "creationTimestamp": STAMP0, "uid": "tj-uid"},
        "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"numNodes": nodes}},
        "status": {
            "conditions": [
                {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": STAMP0}
                for kind, reason, message in conditions
            ]
        },
    }
    if suspend:
        job["spec"]["suspend"] = True
    if queue:
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": queue}
    if deadline is not None:
        job["spec"]["activeDeadlineSeconds"] = deadline
    return job


def decide(job: dict[str, Any] | None, pods: list[dict[str, Any]], now: float = T0 + 30) -> Any:
    return trainjob.KIND.decide(REF, Snapshot(job=job, pods=pods, now=now), POLICY)


def failure(rank: int, *, recoverable: bool = False) -> str:
    return encode_failure(
        WorkerFailure(rank=rank, exception="ValueError", message="boom", recoverable=recoverable, timestamp=T0)
    )


def test_running_and_created() -> None:
    assert decide(make_job(), [node_pod(0), node_pod(1)]).phase is Phase.RUNNING
    pending = decide(make_job(queue="team-a"), [])
    assert pending.phase is Phase.PENDING and "Created (Kueue LocalQueue team-a)" in pending.progress


def test_complete_takes_rank_0s_result_from_node_0() -> None:
    pods = [
        node_pod(0, "Succeeded", exit_code=0, message=encode_success('{"loss": 0.1}'), reason="Completed"),
        node_pod(1, "Succeeded", exit_code=0, message=encode_success(None), reason="Completed"),
    ]
    decision = decide(make_job(("Complete", "AllJobsCompleted", "")), pods)
    assert decision.phase is Phase.SUCCEEDED and decision.verdict.result == {"loss": 0.1}
    assert {pod.name for pod in decision.pods} == {p["metadata"]["name"] for p in pods}
    waiting = decide(make_job(("Complete", "AllJobsCompleted", "")), [node_pod(0), pods[1]])
    assert waiting.phase is Phase.RUNNING and "waiting for rank 0" in waiting.progress


def test_a_failure_is_named_by_pod_and_rank_and_is_not_retried() -> None:
    pods = [node_pod(0, "Failed", exit_code=1, message=failure(3)), node_pod(1)]
    decision = decide(make_job(("Failed", "FailedJobs", "jobset failed")), pods)
    assert decision.phase is Phase.FAILED and not decision.verdict.recoverable
    assert decision.verdict.node == pods[0]["metadata"]["name"] and "rank 3" in decision.verdict.detail


@pytest.mark.parametrize("reason", ["OOMKilled", "Evicted"])
def test_oom_and_eviction_are_recoverable(reason: str) -> None:
    pods = [node_pod(0, "Failed", exit_code=137, reason=reason), node_pod(1)]
    decision = decide(make_job(("Failed", "FailedJobs", "")), pods)
    assert decision.phase is Phase.FAILED and decision.verdict.recoverable, decision.verdict


def restarted(index: int, message: str | None, exit_code: int = 1, reason: str = "Error") -> dict[str, Any]:
    """A node whose container failed and was restarted in place (torch-distributed's OnFailure): running again,
    the failure in ``lastState``."""
    pod = node_pod(index)
    terminated = {"exitCode": exit_code, "message": message, "reason": reason, "finishedAt": STAMP0}
    pod["status"]["containerStatuses"][0]["lastState"] = {"terminated": terminated}
    pod["status"]["containerStatuses"][0]["restartCount"] = 1
    return pod


def test_a_node_that_failed_and_restarted_in_place_fails_the_task_now_and_stops_the_job() -> None:
    pods = [node_pod(0), restarted(1, failure(1))]
    # Its peers get a moment to report (the root cause may be theirs) ...
    early = decide(make_job(), pods, now=T0 + 2)
    assert early.phase is Phase.RUNNING and "waiting for its peers" in early.progress
    # ... then the task fails without waiting for the backoff limit's restarts, and the job is stopped.
    late = decide(make_job(), pods, now=T0 + 30)
    assert late.phase is Phase.FAILED and late.stop and late.verdict is not None and not late.verdict.recoverable
    assert late.verdict.node == pods[1]["metadata"]["name"] and "rank 1" in late.verdict.detail
    assert "ValueError: boom" in late.verdict.detail


def test_an_oom_killed_node_restarted_in_place_is_recoverable() -> None:
    pods = [node_pod(0), restarted(1, None, exit_code=137, reason="OOMKilled")]
    decision = decide(make_job(), pods, now=T0 + 30)
    assert decision.phase is Phase.FAILED and decision.stop and decision.verdict.recoverable, decision.verdict


def test_a_trainjob_without_pods_past_the_grace_fails_pointing_at_its_events() -> None:
    # A JobSet the JobSet webhook refuses shows only as an event on the TrainJob: the wait must not last forever.
    assert decide(make_job(), [], now=T0 + POLICY.pending_grace_seconds - 1).phase is Phase.PENDING
    late = decide(make_job(), [], now=T0 + POLICY.pending_grace_seconds + 1)
    assert late.phase is Phase.FAILED and late.stop and not late.verdict.recoverable
    assert "kubectl describe trainjob" in late.verdict.detail and "has no pods" in late.verdict.detail
    # Suspended (queued) is waiting for capacity, not this.
    assert decide(make_job(suspend=True), [], now=T0 + POLICY.pending_grace_seconds + 1).phase is Phase.PENDING


def test_a_failure_without_a_report_says_what_the_trainjob_says() -> None:
    deadline = decide(make_job(("Failed", "DeadlineExceeded", "past its deadline"), deadline=600), [])
    assert "active_deadline_seconds=600" in deadline.verdict.detail and not deadline.verdict.recoverable
    runtime = decide(make_job(("Failed", "TrainingRuntimeNotSupported", "no such runtime")), [])
    assert runtime.verdict.detail == "the TrainJob failed: TrainingRuntimeNotSupported: no such runtime"


def test_suspended_is_queued_until_scheduling_timeout() -> None:
    queued = decide(make_job(suspend=True, queue="team-a"), [])
    assert queued.phase is Phase.PENDING and "queued in Kueue LocalQueue team-a" in queued.progress
    late = decide(make_job(("Suspended", "Suspended", "")), [], now=T0 + 601)
    assert late.phase is Phase.FAILED and late.verdict.recoverable


def test_waiting_for_node_0_says_it_hosts_the_rendezvous() -> None:
    decision = decide(make_job(), [node_pod(0, unschedulable=True), node_pod(1)])
    assert decision.phase is Phase.PENDING and "hosts the rendezvous" in decision.progress


def test_a_vanished_trainjob_is_retried() -> None:
    decision = decide(None, [])
    assert decision.phase is Phase.FAILED and decision.verdict.recoverable


def test_finished_replica_count_and_digest() -> None:
    assert trainjob.trainjob_finished(make_job(("Complete", "x", "")))
    assert trainjob.trainjob_finished(make_job(("Failed", "x", "")))
    assert not trainjob.trainjob_finished(make_job(("Suspended", "x", "")))
    assert trainjob.KIND.replica_count(make_job(nodes=4)) == 4
    digest = trainjob.KIND.digest_spec({"spec": {"runtimeRef": {"name": "r"}, "trainer": {"numNodes": 2, "env": []}}})
    assert digest == {"runtimeRef": {"name": "r"}, "trainer": {"numNodes": 2}}


# ------------------------------------------------------------------------------------------------ choosing the kind


def test_the_kind_is_in_the_table_last_so_only_choose_picks_it_and_it_imports_nothing_heavy() -> None:
    assert kinds.BUILT_IN[-1] is trainjob.KIND and kinds.get("TrainJob") is trainjob.KIND
    assert kinds.for_config(Elastic(nnodes=2)) is kinds.PYTORCHJOB, "without a cluster, several nodes: a PyTorchJob"
    assert trainjob.KIND.api_version == "trainer.kubeflow.org/v1alpha1" and trainjob.KIND.plural == "trainjobs"
    owner = trainjob.KIND.owner_reference(owner_name=NAME, owner_uid="tj-uid")
    assert owner["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
    code = (
        "import sys, airflow_provider_torchelastic.kubernetes.kinds.trainjob; "
        "print(sorted(m for m in ('torch', 'kubernetes', 'airflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _served(*names: str) -> Any:
    asked: list[str] = []

    def served(kind: kinds.JobKind) -> bool:
        asked.append(kind.kind)
        return kind.kind in names

    served.asked = asked  # type: ignore[attr-defined]
    return served


@pytest.mark.parametrize(
    ("config", "job_kind", "served", "expected"),
    [
        # One node is a Pod whatever job_kind says, and nothing asks the cluster.
        (Elastic(nnodes=1), "trainjob", (), "Pod"),
        (Elastic(nnodes=1), "auto", ("TrainJob",), "Pod"),
        (Elastic(nnodes=2), "pytorchjob", ("TrainJob",), "PyTorchJob"),
        (Elastic(nnodes=2), "trainjob", (), "TrainJob"),
        # auto: a TrainJob where the cluster serves it (PyTorchJob v1 is in maintenance), else a PyTorchJob.
        (Elastic(nnodes=2), "auto", ("TrainJob", "PyTorchJob"), "TrainJob"),
        (Elastic(nnodes=2), "auto", ("PyTorchJob",), "PyTorchJob"),
        (Elastic(nnodes=2), "auto", (), "PyTorchJob"),
        # What a TrainJob cannot run goes to a PyTorchJob under auto, without asking the cluster.
        (Elastic(nnodes="1:4"), "auto", ("TrainJob", "PyTorchJob"), "PyTorchJob"),
    ],
)
def test_choose_picks_the_kind_from_job_kind_and_what_the_cluster_serves(
    config: Any, job_kind: str, served: tuple[str, ...], expected: str
) -> None:
    ask = _served(*served)
    kind, why = kinds.choose(config, job_kind, ask)
    assert kind.kind == expected, why
    assert why, "the task log says why"
    if expected == "Pod" or job_kind != "auto" or config.min_nodes != config.max_nodes:
        assert ask.asked == [], "only auto with a config a TrainJob runs asks the cluster"


def test_a_config_a_trainjob_cannot_run_is_an_error_naming_the_field_when_job_kind_says_trainjob() -> None:
    with pytest.raises(ValueError, match=r"Elastic.nnodes: a TrainJob cannot take '1:4'.*KEP-2903"):
        kinds.fixed_choice(Elastic(nnodes="1:4"), "trainjob")
    with pytest.raises(ValueError, match=r"job_kind: expected one of 'auto', 'pytorchjob', 'trainjob'.*got 'tfjob'"):
        kinds.fixed_choice(Elastic(nnodes=2), "tfjob")
    assert kinds.fixed_choice(Elastic(nnodes=2), "auto") is None, "auto with a fitting config asks the cluster"


def test_auto_says_whole_why_a_config_a_trainjob_cannot_run_is_a_pytorchjob() -> None:
    choice = kinds.fixed_choice(Elastic(nnodes="1:4"), "auto")
    assert choice is not None
    kind, why = choice
    assert kind is kinds.PYTORCHJOB
    # The whole reason reaches the task log (it was once cut at "a fixed number ", its end a statement of its own).
    assert why.endswith("(a TrainJob runs a fixed number of nodes, with no restart policy of its own)"), why


def test_a_trainjobs_pods_are_its_own_only_through_its_jobset_and_jobs_by_uid() -> None:
    job = {"metadata": {"name": NAME, "uid": "tj"}}

    def owned(uid: str, kind: str, owner: str) -> dict[str, Any]:
        return {"metadata": {"uid": uid, "ownerReferences": [{"controller": True, "kind": kind, "uid": owner}]}}

    jobset, batch_job = owned("js", "TrainJob", "tj"), owned("j0", "JobSet", "js")
    pod = {**owned("p0", "Job", "j0"), "status": {}}
    pod["metadata"]["labels"] = {trainjob.JOBSET_NAME_LABEL: NAME, trainjob.REPLICATED_JOB_LABEL: "node"}
    pods_of = trainjob.KIND.pods_of(NAME)
    assert pods_of.pick(job, [pod], [jobset, batch_job]) == [pod]
    assert pods_of.pick(job, [pod], [batch_job]) == [], "without the JobSet the chain is broken"
    foreign = owned("js", "TrainJob", "another")
    assert pods_of.pick(job, [pod], [foreign, batch_job]) == [], "a JobSet of another TrainJob"
    queries = {
        (q.group, q.plural): (q.label_selector(NAME), q.field_selector(NAME)) for q in trainjob.KIND.intermediates
    }
    assert queries == {
        ("jobset.x-k8s.io", "jobsets"): (None, f"metadata.name={NAME}"),
        ("batch", "jobs"): (f"jobset.sigs.k8s.io/jobset-name={NAME}", None),
    }
    assert trainjob.KIND.log_container == "node" and kinds.PYTORCHJOB.log_container == "pytorch"


def test_a_kind_with_a_longer_controller_chain_must_say_how_to_read_what_is_in_between() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="intermediates: expected an OwnerQuery"):
        replace(trainjob.KIND, intermediates=())


def test_a_webhook_refusal_of_a_trainjob_says_a_missing_runtime_is_refused_so() -> None:
    from airflow_provider_torchelastic.errors import KubeError
    from airflow_provider_torchelastic.kubernetes.submit import refusal

    denied = KubeError(403, "Forbidden", 'admission webhook "validator.trainjob.trainer.kubeflow.org" denied it')
    message = refusal(JobRef(kind="TrainJob", name=NAME, namespace="ml"), denied).message
    assert "most often the validation of Kubeflow Trainer v2" in message
    assert "kubectl get clustertrainingruntimes" in message and "(a retry will not help)" in message
