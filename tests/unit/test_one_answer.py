"""One answer per concept (issue 36, item 3): one cluster connection, one answer to "the pods of a job" (the kind's),
one choice of a kind, and the kind's facts in its descriptor."""

from __future__ import annotations

import json
import time
from dataclasses import fields
from typing import Any

import pytest

from airflow_provider_torchelastic.core.config import Elastic, Master, PyTorch, Worker
from airflow_provider_torchelastic.hooks import async_hook, connect
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.connection import ClusterConnection
from airflow_provider_torchelastic.kubernetes.queue_limits import QueueLimits
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, WaitPolicy
from airflow_provider_torchelastic.triggers import WatchArgs

# --- one cluster connection ------------------------------------------------------------------------------------------


def test_a_connection_is_read_once_with_its_namespace_and_refuses_two_ways_to_a_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra = {"kube_config_path": "/etc/kube/config", "namespace": "ml"}
    monkeypatch.setenv("AIRFLOW_CONN_ONE_WAY", json.dumps({"conn_type": "kubernetes", "extra": extra}))
    cluster = connect("one_way")
    assert cluster.namespace == "ml"
    assert cluster.connection == ClusterConnection(conn_id="one_way", extras=extra)
    cluster.connection.check_one_source()
    assert connect("one_way", namespace="other").namespace == "other", "the task's namespace comes first"

    two = {"in_cluster": True, "extra__kubernetes__kube_config": "{}"}
    monkeypatch.setenv("AIRFLOW_CONN_TWO_WAYS", json.dumps({"conn_type": "kubernetes", "extra": two}))
    with pytest.raises(ValueError, match="connection 'two_ways' sets in_cluster and kube_config; expected one of"):
        connect("two_ways").connection.check_one_source()


def test_the_hooks_get_the_settings_as_resolved_and_never_the_default_connection_beside_a_config_dict() -> None:
    connection = ClusterConnection(config_dict={"apiVersion": "v1"}, context="lab")
    assert connection.hook_arguments() == {
        "conn_id": None,
        "kubernetes_conn_id": None,
        "connection_extras": None,
        "config_dict": {"apiVersion": "v1"},
        "cluster_context": "lab",
        "in_cluster": None,
    }
    hook = async_hook(ClusterConnection(conn_id="k8s", extras={"namespace": "ml"}))
    assert hook.conn_id == "k8s"


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"conn_id": "k8s", "config_dict": {"apiVersion": "v1"}}, "kubernetes_conn_id='k8s' and config_dict"),
        ({"config_dict": {"apiVersion": "v1"}, "in_cluster": True}, "in_cluster=True and config_dict"),
        ({"conn_id": "k8s", "extras": {"kube_config_path": "/k"}, "in_cluster": True}, "sets kube_config_path"),
    ],
)
def test_two_sources_of_cluster_settings_are_refused_when_built(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ClusterConnection(**settings)


def test_outside_airflow_only_a_kubeconfig_or_the_service_account_opens_a_client() -> None:
    with pytest.raises(ValueError, match=r"hooks\.connect"):
        ClusterConnection(conn_id="k8s").sync_kube()


def test_the_triggers_arguments_are_the_workers_connection_policy_and_limits() -> None:
    ref = JobRef(kind="PyTorchJob", name="train-abc", namespace="ml")
    connection = ClusterConnection(conn_id="k8s", extras={"namespace": "ml"})
    policy = WaitPolicy(
        poll_interval=3.0,
        pending_grace_seconds=30.0,
        image_pull_timeout=60.0,
        log_pods=4,
        deadline=time.time() + 600,
        finish_action="keep",
        scheduling_timeout=120.0,
        lease_seconds=None,
    )
    limits = QueueLimits(max_preemptions=2, preemptions_before=1)
    args = WatchArgs.for_wait(ref, connection, policy, limits, mask=("s3cret",))
    assert (args.ref, args.connection, args.policy, args.limits) == (ref, connection, policy, limits)
    assert args.mask == ("s3cret",)
    carried = {f.name for f in fields(WaitPolicy)} - {"progress_interval"}
    assert carried <= {f.name for f in fields(WatchArgs)}, "every field of the policy but one travels"


# --- the pods of a job -----------------------------------------------------------------------------------------------


def _pod(name: str, labels: dict[str, str], owner: dict[str, Any] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": labels, "uid": f"uid-{name}"}
    if owner is not None:
        metadata["ownerReferences"] = [
            {
                "kind": owner["kind"],
                "uid": owner["metadata"]["uid"],
                "name": owner["metadata"]["name"],
                "controller": True,
            }
        ]
    return {"metadata": metadata}


def test_the_pods_of_a_job_are_one_answer_as_a_selector_and_over_pods_at_hand() -> None:
    job = {"kind": "PyTorchJob", "metadata": {"name": "train-abc", "uid": "job-uid"}}
    other = {"kind": "PyTorchJob", "metadata": {"name": "train-xyz", "uid": "other-uid"}}
    label = kinds.PYTORCHJOB.pod_owner_label
    assert label is not None
    ours = _pod("train-abc-worker-0", {label: "train-abc"}, job)
    foreign = _pod("train-abc-worker-1", {label: "train-abc"}, other)  # the labels, another controller
    unlabelled = _pod("train-abc-worker-2", {}, job)
    pods_of = kinds.PYTORCHJOB.pods_of("train-abc")
    assert pods_of.selector == f"{label}=train-abc" == kinds.PYTORCHJOB.pod_selector("train-abc")
    assert pods_of.labels == {label: "train-abc"}
    assert [pods_of.labelled(p) for p in (ours, foreign, unlabelled)] == [True, True, False]
    assert pods_of.pick(job, [ours, foreign, unlabelled]) == [ours]
    assert pods_of.pick(None, [ours]) == [], "no job, no pods"
    assert kinds.owner_of_pod(ours) == (kinds.PYTORCHJOB, "train-abc")

    trainjob = kinds.TRAINJOB.pods_of("tj")
    assert set(trainjob.labels) == {"jobset.sigs.k8s.io/jobset-name", "jobset.sigs.k8s.io/replicatedjob-name"}


def test_a_pod_job_is_its_own_only_pod() -> None:
    pod = _pod("single-abc", {})
    pods_of = kinds.POD.pods_of("single-abc")
    assert pods_of.selector is None
    assert pods_of.pick(pod, [_pod("someone-else", {})]) == [pod]
    assert pods_of.pick(None, []) == []
    assert kinds.owner_of_pod(pod) is None, "no kind that owns pods claims it"


def test_a_pytorchjobs_pods_read_master_first_then_workers_by_index() -> None:
    replica = "training.kubeflow.org/replica-type"
    index = "training.kubeflow.org/replica-index"
    pods = [
        _pod("j-worker-10", {replica: "worker", index: "10"}),
        _pod("j-worker-2", {replica: "worker", index: "2"}),
        _pod("j-master-0", {replica: "master", index: "0"}),
    ]
    names = [p["metadata"]["name"] for p in sorted(pods, key=kinds.PYTORCHJOB.pod_order)]
    assert names == ["j-master-0", "j-worker-2", "j-worker-10"]
    assert [p["metadata"]["name"] for p in sorted(pods, key=kinds.TRAINJOB.pod_order)] == sorted(names)


# --- one choice of a kind --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        Elastic(nnodes=1),
        Elastic(nnodes=2),
        Elastic(nnodes="1:4"),
        PyTorch(master=Master(), worker=Worker(), num_workers=1),
    ],
)
def test_every_way_to_a_kind_is_the_one_choice(config: Any) -> None:
    assert kinds.for_config(config) is kinds.choose(config, "pytorchjob")[0]
    fixed = kinds.fixed_choice(config, "auto")
    chosen, why = kinds.choose(config, "auto")  # no cluster to ask: what a dry run shows
    assert chosen is (fixed[0] if fixed is not None else kinds.PYTORCHJOB)
    if fixed is None:
        assert "without a cluster" in why
        assert kinds.choose(config, "auto", lambda kind: kind is kinds.TRAINJOB)[0] is kinds.TRAINJOB
