"""A job's pods are the pods it controls: the controller ownerReference chain leads to the job by uid, whatever the
labels say (issue 19, item 2)."""

from __future__ import annotations

from typing import Any

from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.ownership import controlled_pods, controller_reference, is_controlled_by

JOB_UID = "11111111-job"
LABELS = {"training.kubeflow.org/job-name": "te-job", "training.kubeflow.org/replica-type": "master"}


def job(uid: str | None = JOB_UID) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "te-job"}
    if uid is not None:
        meta["uid"] = uid
    return {"kind": "PyTorchJob", "metadata": meta}


def pod(name: str, *owners: dict[str, Any], uid: str = "pod-uid") -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid, "labels": LABELS, "ownerReferences": list(owners)}}


def owner(kind: str = "PyTorchJob", uid: str = JOB_UID, *, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v1", "kind": kind, "name": "te-job", "uid": uid, "controller": controller}


def names(pods: list[Any]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def test_only_pods_whose_controller_is_the_job_by_uid_are_kept() -> None:
    pods = [
        pod("ours", owner()),
        pod("no-owner"),
        pod("other-uid", owner(uid="22222222-other")),
        pod("other-kind", owner(kind="ReplicaSet")),
        pod("not-controller", owner(controller=False)),
        pod("controller-is-another", owner(controller=False), owner(kind="ReplicaSet", uid="3")),
    ]
    assert names(controlled_pods(job(), pods, ("PyTorchJob",))) == ["ours"]


def test_without_the_jobs_uid_no_pod_is_the_jobs() -> None:
    assert controlled_pods(job(uid=None), [pod("ours", owner())], ("PyTorchJob",)) == []
    assert controlled_pods(None, [pod("ours", owner())], ("PyTorchJob",)) == []


def test_malformed_owner_references_are_not_a_controller() -> None:
    for refs in (None, "x", [None, "x", {"controller": "true"}]):
        assert controller_reference({"metadata": {"ownerReferences": refs}}) is None
    assert controller_reference({"metadata": None}) is None
    assert not is_controlled_by(pod("p", {**owner(), "uid": 7}), JOB_UID, ("PyTorchJob",))


def test_an_empty_chain_means_the_pod_is_the_job_itself() -> None:
    bare = {"kind": "Pod", "metadata": {"name": "te-job", "uid": JOB_UID}}
    assert is_controlled_by(bare, JOB_UID, ())
    assert not is_controlled_by({"metadata": {"uid": "else"}}, JOB_UID, ())


def test_a_longer_chain_follows_the_intermediate_objects_by_uid() -> None:
    # What a TrainJob will need: Pod -> Job -> JobSet -> TrainJob.
    chain = ("Job", "JobSet", "TrainJob")
    batch_job = {"metadata": {"uid": "job-1", "ownerReferences": [owner("JobSet", "jobset-1")]}}
    jobset = {"metadata": {"uid": "jobset-1", "ownerReferences": [owner("TrainJob", JOB_UID)]}}
    ours = pod("ours", owner("Job", "job-1"))
    between = {"job-1": batch_job, "jobset-1": jobset}
    assert is_controlled_by(ours, JOB_UID, chain, between)
    assert not is_controlled_by(ours, JOB_UID, chain, {"job-1": batch_job})  # the JobSet is unknown
    assert not is_controlled_by(ours, "other", chain, between)


def test_each_kind_says_its_chain() -> None:
    assert kinds.PYTORCHJOB.controller_chain == ("PyTorchJob",)
    assert kinds.POD.controller_chain == ()
    foreign = pod("foreign", owner(uid="other"))
    ours = pod("ours", owner())
    assert names(kinds.PYTORCHJOB.pods_of("te-job").pick(job(), [foreign, ours])) == ["ours"]


def test_the_shared_watch_files_only_controlled_pods_under_a_job() -> None:
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef
    from airflow_provider_torchelastic.kubernetes.watch import JobCache

    cache = JobCache("ns", kube=None)
    cache.replace("PyTorchJob", [job()])
    cache.replace("Pod", [pod("ours", owner()), pod("foreign", owner(uid="other"))])
    snapshot = cache.snapshot(JobRef(kind="PyTorchJob", name="te-job", namespace="ns"))
    assert names(list(snapshot.pods)) == ["ours"]


def test_the_ui_groups_only_controlled_pods_under_a_job() -> None:
    from airflow_provider_torchelastic.plugin.views import group_live_jobs

    (live,) = group_live_jobs({"PyTorchJob": [job()]}, [pod("foreign"), pod("ours", owner())])
    assert names(list(live.pods)) == ["ours"]
