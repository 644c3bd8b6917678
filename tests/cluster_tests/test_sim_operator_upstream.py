"""The simulated operator on the points where it once was kinder than the real one; each test names the upstream line.

Lines are in kubeflow/trainer v1.9.4 (branch ``release-1.9``). The pure tests drive ``reconcile_job`` (and, for the
order of writes, ``Operator.execute`` with fake API objects); the ``cluster`` tests run the same cases through the
real kube-apiserver 1.20 and the simulators.
"""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from typing import Any

import pytest

from tests.cluster import sim_operator as so
from tests.cluster_tests import test_sim_operator as base
from tests.cluster_tests.test_sim_operator import (
    IMAGE,
    NOW,
    Cluster,
    condition,
    conditions,
    job,
    pod,
    replica,
    unique,
    wait_for,
)

api = base.api  # the fixtures of the operator's own tests
cluster = base.cluster
SLEEP = ["python", "-c", "import time; time.sleep(300)"]


def running_since(seconds_ago: float) -> dict[str, Any]:
    return {"startTime": so.to_rfc3339(NOW - seconds_ago), "conditions": []}


def poke(cluster: Cluster, pod_name: str) -> None:
    """A pod event: a new annotation, so a new resourceVersion (OnDependentUpdateFunc ignores same-RV resyncs)."""
    patch = {"metadata": {"annotations": {"test.torchelastic.dev/poke": str(time.time())}}}
    cluster.core.patch_namespaced_pod(pod_name, cluster.namespace, patch)


# ----------------------------------------------------------------------------------------------------------------
# 1. activeDeadlineSeconds only on events
# ----------------------------------------------------------------------------------------------------------------


def test_deadline_is_checked_only_on_a_pass_and_never_requeued() -> None:
    """``pkg/controller.v1/common/job.go:211`` checks the deadline inside a pass; the re-check at the deadline is
    queued on a no-op FakeWorkQueue (``pkg/controller.v1/pytorch/pytorchjob_controller.go:82, 365``)."""
    j = job(worker=replica(), run_policy={"activeDeadlineSeconds": 60}, status=running_since(10))
    first = so.reconcile_job(j, [pod(j, "Worker", 0, "Running")], [], NOW)
    assert first.requeue_after is None and "Failed" not in conditions(first.status)
    assert first.status["startTime"] == so.to_rfc3339(NOW - 10)

    # A brand-new job (the pass that sets startTime, pytorchjob_controller.go:359-366) queues nothing either.
    fresh = job(worker=replica(), run_policy={"activeDeadlineSeconds": 60})
    assert so.reconcile_job(fresh, [], [], NOW).requeue_after is None

    # Long past the deadline, nothing happened until some event causes this pass: then it fails.
    later = so.reconcile_job(
        job(worker=replica(), run_policy={"activeDeadlineSeconds": 60}, status=first.status),
        [pod(j, "Worker", 0, "Running")],
        [],
        NOW + 3600,
    )
    assert (
        condition(later.status, "Failed")["message"]
        == "Job train has failed because it was active longer than specified deadline"
    )


def test_the_periodic_resync_is_controller_runtimes_ten_hours() -> None:
    """No SyncPeriod is set (``cmd/training-operator.v1/main.go:141-153``): controller-runtime's default of 10 h is
    the only periodic reconcile of a quiet job, so it cannot enforce a deadline of seconds or minutes."""
    assert so.RESYNC_SECONDS == 10 * 3600


@pytest.mark.cluster
def test_a_quiet_job_overruns_its_deadline_until_a_pod_event(cluster: Cluster) -> None:
    """``pkg/controller.v1/common/job.go:211`` (checked on a pass) and ``pytorchjob_controller.go:365`` (the
    deadline requeue goes to the FakeWorkQueue): a quiet Running job overruns; a pod event after it fails the job."""
    name = unique("deadline")
    deadline = 6
    cluster.create_job(job(name, worker=replica(command=SLEEP), run_policy={"activeDeadlineSeconds": deadline}))
    status = cluster.wait_condition(name, "Running", timeout=60)
    started = so.from_rfc3339(status["startTime"])
    time.sleep(max(0.0, started + deadline + 4 - time.time()))
    status = cluster.get_job(name)["status"]
    assert "Failed" not in conditions(status), status  # 4 s past the deadline, still Running
    assert conditions(status)["Running"] == "True"

    poke(cluster, f"{name}-worker-0")
    failed = condition(cluster.wait_condition(name, "Failed", timeout=15), "Failed")
    assert failed["message"] == f"Job {name} has failed because it was active longer than specified deadline"


# ----------------------------------------------------------------------------------------------------------------
# 2. Success and failure in one pass
# ----------------------------------------------------------------------------------------------------------------


def test_elastic_success_does_not_skip_the_failure_check() -> None:
    """``pytorchjob_controller.go:409-443``: the Worker-only branch sets Succeeded without returning, and the
    failure check below runs in the same pass; under Never it adds Failed (``pkg/util/status.go`` keeps
    Succeeded, since only an existing Failed blocks further conditions)."""
    j = job(worker=replica(replicas=2, policy="Never"), elastic={"minReplicas": 1, "maxReplicas": 2})
    plan = so.reconcile_job(j, [pod(j, "Worker", 0, "Succeeded", 0), pod(j, "Worker", 1, "Failed", 1)], [], NOW)
    assert conditions(plan.status) == {"Created": "True", "Succeeded": "True", "Failed": "True"}
    assert (
        condition(plan.status, "Failed")["message"] == "PyTorchJob train is failed because 1 Worker replica(s) failed."
    )
    assert [e.reason for e in plan.events if e.reason.startswith("PyTorchJob")] == [
        "PyTorchJobSucceeded",
        "PyTorchJobFailed",
    ]

    # Under OnFailure the same check gives Restarting next to Succeeded.
    j2 = job(worker=replica(replicas=2, policy="OnFailure"), elastic={"minReplicas": 1, "maxReplicas": 2})
    plan2 = so.reconcile_job(j2, [pod(j2, "Worker", 0, "Succeeded", 0), pod(j2, "Worker", 1, "Failed", 1)], [], NOW)
    assert conditions(plan2.status) == {"Created": "True", "Succeeded": "True", "Restarting": "True"}

    # Not elastic: one success is not enough (expected != 0), so only Failed.
    j3 = job(worker=replica(replicas=2, policy="Never"))
    plan3 = so.reconcile_job(j3, [pod(j3, "Worker", 0, "Succeeded", 0), pod(j3, "Worker", 1, "Failed", 1)], [], NOW)
    assert conditions(plan3.status) == {"Created": "True", "Failed": "True"}


# ----------------------------------------------------------------------------------------------------------------
# 3. Replica order randomised
# ----------------------------------------------------------------------------------------------------------------


def master_succeeded_worker_failed() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    j = job(master=replica(policy="Never"), worker=replica(policy="Never"))
    return j, [pod(j, "Master", 0, "Succeeded", 0), pod(j, "Worker", 0, "Failed", 1)]


@pytest.mark.parametrize(
    ("order", "outcome"),
    [(("Master", "Worker"), {"Succeeded": "True"}), (("Worker", "Master"), {"Failed": "True"})],
)
def test_master_success_and_worker_failure_depend_on_map_order(order: tuple[str, str], outcome: dict[str, str]) -> None:
    """``pytorchjob_controller.go:369`` ranges over the replica map (random order): the Master's success returns at
    once (``:390-400``), so a Worker failure counts only if the Worker came first (``:428-443``); once Failed is
    set, the Master's Succeeded is a no-op (``pkg/util/status.go`` setCondition)."""
    j, pods = master_succeeded_worker_failed()
    plan = so.reconcile_job(j, pods, [], NOW, order=order)
    assert plan.order == plan.status_order == order
    assert {k: v for k, v in conditions(plan.status).items() if k != "Created"} == outcome


def test_the_order_is_random_per_map_iteration() -> None:
    """Two independent map iterations per pass: ``common/job.go:338`` (pods/Services) and
    ``pytorchjob_controller.go:369`` (status). About half the passes end Failed."""
    j, pods = master_succeeded_worker_failed()
    rng = random.Random(7)
    outcomes = ["Failed" in conditions(so.reconcile_job(j, pods, [], NOW, rng=rng).status) for _ in range(400)]
    assert 0.4 < sum(outcomes) / len(outcomes) < 0.6
    orders = {so.reconcile_job(j, [], [], NOW, rng=rng).order for _ in range(50)}
    assert orders == {("Master", "Worker"), ("Worker", "Master")}
    # Reproducible from the seed.
    first = [so.reconcile_job(j, pods, [], NOW, rng=random.Random(42)).status_order for _ in range(3)]
    assert len(set(first)) == 1


def test_the_operator_seeds_its_order_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The running operator's rng: ``TORCHELASTIC_SIM_SEED`` if set (it is logged at start), else random."""
    from kubernetes import client

    monkeypatch.setenv("TORCHELASTIC_SIM_SEED", "1234")
    operator = so.Operator(client.ApiClient())
    assert operator.seed == 1234
    assert operator.rng.random() == random.Random(1234).random()
    monkeypatch.delenv("TORCHELASTIC_SIM_SEED")
    assert len({so.replica_seed() for _ in range(5)}) > 1


# ----------------------------------------------------------------------------------------------------------------
# 4. Unnamed ports
# ----------------------------------------------------------------------------------------------------------------


def unnamed_port_job(name: str = "train", command: list[str] | None = None) -> dict[str, Any]:
    worker = replica(command=command)
    worker["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 8080}]
    return job(name, worker=worker)


def test_every_pytorch_port_becomes_a_service_port_unnamed_too() -> None:
    """``pkg/core/service.go:83-99`` (GetPortsFromJob: a name -> port map of every port of the ``pytorch``
    container) and ``pkg/controller.v1/common/service.go:238-241`` (one ServicePort each, name as it is)."""
    j = so.apply_defaults(unnamed_port_job())
    assert so.render_service(j, "Worker", 0)["spec"]["ports"] == [
        {"port": 8080},  # ServicePort.Name is omitempty
        {"name": "pytorchjob-port", "port": 23456},
    ]
    # Two unnamed ports share the map key "": the last one wins.
    two = unnamed_port_job()
    two["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["ports"] += [
        {"containerPort": 9090}
    ]
    ports = so.render_service(so.apply_defaults(two), "Worker", 0)["spec"]["ports"]
    assert ports == [{"port": 9090}, {"name": "pytorchjob-port", "port": 23456}]
    # Other containers' ports are not exposed.
    other = job(worker=replica())
    other["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"].append(
        {"name": "sidecar", "image": IMAGE, "ports": [{"name": "metrics", "containerPort": 9100}]}
    )
    assert so.render_service(so.apply_defaults(other), "Worker", 0)["spec"]["ports"] == [
        {"name": "pytorchjob-port", "port": 23456}
    ]


def test_pods_then_services_per_replica_type_in_order() -> None:
    """``common/job.go:338-351``: for each replica type, ReconcilePods then ReconcileServices; an error from either
    returns before UpdateJobStatus (``:354-362``), which is why a rejected Service leaves the status unwritten."""
    j = job(master=replica(), worker=replica())
    plan = so.reconcile_job(j, [], [], NOW, order=("Worker", "Master"))
    writes = [(kind, item["metadata"]["name"]) for kind, item in plan.steps if kind.startswith("create")]
    assert writes == [
        ("create_pod", "train-worker-0"),
        ("create_service", "train-worker-0"),
        ("create_pod", "train-master-0"),
        ("create_service", "train-master-0"),
    ]


class FakeApiError(Exception):
    pass


class Recorder:
    """Stands in for CoreV1Api/CustomObjectsApi: records calls; ``fail`` maps a method name to an exception."""

    def __init__(self, calls: list[str], fail: dict[str, Exception] | None = None) -> None:
        self.calls = calls
        self.fail = fail or {}

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(method)
            if method in self.fail:
                raise self.fail[method]

            named = (a for a in args if isinstance(a, dict) and "name" in (a.get("metadata") or {}))

            class Resp:
                data = json.dumps(next(named, {"metadata": {"name": "x", "namespace": "ns"}})).encode()

            return Resp()

        return call


def fake_operator(fail: dict[str, Exception] | None = None) -> tuple[so.Operator, list[str]]:
    from kubernetes import client

    operator = so.Operator(client.ApiClient(), seed=0)
    calls: list[str] = []
    operator.core = Recorder(calls, fail)  # type: ignore[assignment]
    operator.custom = Recorder(calls, fail)  # type: ignore[assignment]
    return operator, calls


def test_a_rejected_service_create_is_a_warning_and_no_status_write() -> None:
    """``pkg/controller.v1/control/service_control.go:95-98``: a failed create records ``FailedCreateService``
    "Error creating: <the API error>" and returns the error; ReconcileJobs returns it before the status update."""
    from kubernetes.client.rest import ApiException

    rejected = ApiException(status=422, reason="Unprocessable Entity")
    rejected.body = json.dumps(
        {"kind": "Status", "message": 'Service "train-worker-0" is invalid: spec.ports[0].name: Required value'}
    )
    operator, calls = fake_operator({"create_namespaced_service": rejected})
    raw = unnamed_port_job()
    raw["metadata"]["uid"] = "job-uid"
    plan = so.reconcile_job(raw, [], [], NOW)
    with pytest.raises(so.ReconcileError, match=r"spec\.ports"):
        operator.execute(raw, plan)
    assert "patch_namespaced_custom_object_status" not in calls
    events = [c for c in calls if c == "create_namespaced_event"]
    assert calls.index("create_namespaced_pod") < calls.index("create_namespaced_service")
    assert len(events) == 2  # SuccessfulCreatePod, FailedCreateService


@pytest.mark.cluster
def test_an_unnamed_port_is_rejected_by_the_apiserver_and_the_job_never_progresses(cluster: Cluster) -> None:
    """``pkg/core/service.go:83-99`` keeps the unnamed port; the API server (1.20) rejects a Service with an unnamed
    port among several (422); ``service_control.go:95-98`` records the Warning, and the pass ends before the
    status write (``common/job.go:345-350``)."""
    name = unique("port")
    body = unnamed_port_job(name, command=SLEEP)
    cluster.create_job(body)

    # The rendered Service, straight to the API server: 422.
    from kubernetes.client.rest import ApiException

    created = cluster.get_job(name)
    svc = so.render_service(so.apply_defaults(created), "Worker", 0)
    svc["metadata"]["name"] = f"{name}-direct"
    with pytest.raises(ApiException) as rejected:
        cluster.core.create_namespaced_service(cluster.namespace, svc)
    assert rejected.value.status == 422
    assert "spec.ports[0].name: Required value" in json.loads(rejected.value.body)["message"]

    event = wait_for(
        lambda: next((e for e in cluster.events(name) if e["reason"] == "FailedCreateService"), None),
        30,
        "the FailedCreateService Warning",
    )
    assert event["type"] == "Warning"
    assert event["message"].startswith(f'Error creating: Service "{name}-worker-0" is invalid: ')
    assert "spec.ports[0].name: Required value" in event["message"]
    time.sleep(3)
    # The pod was created (pods come first), but the status was never written: not even Created or startTime.
    assert [p["metadata"]["name"] for p in cluster.pods(name)] == [f"{name}-worker-0"]
    assert not (cluster.get_job(name).get("status") or {}).get("conditions")
    assert not (cluster.get_job(name).get("status") or {}).get("startTime")
    assert not cluster.core.list_namespaced_service(
        cluster.namespace, label_selector=f"training.kubeflow.org/job-name={name}"
    ).items


# ----------------------------------------------------------------------------------------------------------------
# 5. TTL 0
# ----------------------------------------------------------------------------------------------------------------


def test_ttl_zero_deletes_before_the_failed_status_is_written() -> None:
    """``pkg/controller.v1/common/job.go:233`` (CleanupJob deletes the job: its completionTime was set this very
    pass, so ``time.Now()`` is after it plus 0 s) runs before ``:247`` (UpdateJobStatusInApiServer)."""
    run_policy = {"activeDeadlineSeconds": 5, "ttlSecondsAfterFinished": 0}
    j = job(worker=replica(), run_policy=run_policy, status=running_since(10))
    j["metadata"]["uid"] = "job-uid"
    plan = so.reconcile_job(j, [pod(j, "Worker", 0, "Running")], [], NOW)
    assert plan.delete_job and condition(plan.status, "Failed")["status"] == "True"

    operator, calls = fake_operator()
    operator.execute(j, plan)
    assert calls.index("delete_namespaced_custom_object") < calls.index("patch_namespaced_custom_object_status")

    # A TTL of 1 s: nothing is deleted or requeued in this pass (CleanupJob's AddAfter is the FakeWorkQueue's);
    # the next pass, after the status write, requeues for the rest.
    one = copy.deepcopy(j)
    one["spec"]["runPolicy"]["ttlSecondsAfterFinished"] = 1
    plan1 = so.reconcile_job(one, [pod(one, "Worker", 0, "Running")], [], NOW)
    assert not plan1.delete_job and plan1.requeue_after is None
    one["status"] = plan1.status
    assert so.reconcile_job(one, [], [], NOW + 0.5).requeue_after == pytest.approx(0.5)

    # Backoff failures take the same path (job.go:206-210).
    backoff = job(worker=replica(), run_policy={"backoffLimit": 1, "ttlSecondsAfterFinished": 0})
    assert so.reconcile_job(backoff, [pod(backoff, "Worker", 0, "Running", restarts=1)], [], NOW).delete_job


def test_a_finished_job_with_ttl_zero_is_deleted_on_the_next_pass() -> None:
    """``common/job.go:122-140``: a job that finished in UpdateJobStatus had its status written first; the next
    pass (its status event) runs CleanupJob (``:420-439``, ``currentTime.After(expireTime)``)."""
    j = job(worker=replica(policy="Never"), run_policy={"ttlSecondsAfterFinished": 0})
    done = so.reconcile_job(j, [pod(j, "Worker", 0, "Succeeded", 0)], [], NOW)
    assert conditions(done.status)["Succeeded"] == "True" and not done.delete_job
    j["status"] = done.status
    assert so.reconcile_job(j, [], [], NOW + 0.1).delete_job


@pytest.mark.cluster
def test_ttl_zero_deadline_failure_deletes_the_job_before_failed_is_seen(cluster: Cluster) -> None:
    """``pkg/controller.v1/common/job.go:233`` before ``:247``: a watcher sees the job deleted, never Failed."""
    from kubernetes import client, watch

    name = unique("ttl0")
    seen: list[tuple[str, dict[str, Any]]] = []
    done = threading.Event()

    def watch_job() -> None:
        custom = client.CustomObjectsApi(cluster.custom.api_client)
        w = watch.Watch()
        for event in w.stream(
            custom.list_namespaced_custom_object,
            "kubeflow.org",
            "v1",
            cluster.namespace,
            "pytorchjobs",
            field_selector=f"metadata.name={name}",
            timeout_seconds=90,
        ):
            seen.append((event["type"], copy.deepcopy(event["object"].get("status") or {})))
            if event["type"] == "DELETED":
                break
        done.set()

    watcher = threading.Thread(target=watch_job, daemon=True)
    watcher.start()
    time.sleep(0.5)
    deadline = 4
    cluster.create_job(
        job(
            name,
            worker=replica(command=SLEEP),
            run_policy={"activeDeadlineSeconds": deadline, "ttlSecondsAfterFinished": 0},
        )
    )
    status = cluster.wait_condition(name, "Running", timeout=60)
    time.sleep(max(0.0, so.from_rfc3339(status["startTime"]) + deadline + 1 - time.time()))
    poke(cluster, f"{name}-worker-0")
    wait_for(lambda: not cluster.job_exists(name), 20, "the job deleted")
    assert done.wait(20), seen
    assert seen[-1][0] == "DELETED"
    assert all("Failed" not in conditions(s) for _, s in seen), seen
    assert any(conditions(s).get("Running") == "True" for _, s in seen)


# ----------------------------------------------------------------------------------------------------------------
# 7. Orphans are not adopted (the PyTorch reconciler's own GetPodsForJob/GetServicesForJob)
# ----------------------------------------------------------------------------------------------------------------


def orphan_of(j: dict[str, Any], obj: dict[str, Any], owner_uid: str | None = None) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    if owner_uid is None:
        obj["metadata"].pop("ownerReferences", None)
    else:
        obj["metadata"]["ownerReferences"][0]["uid"] = owner_uid
    return obj


def test_pods_need_the_labels_and_a_controller_reference_to_the_job() -> None:
    """``pytorchjob_controller.go:281-296`` lists pods by the job-name and operator-name labels
    (``common/job_controller.go:236-242``) and keeps those it controls (``JobControlledPodList``,
    ``pkg/common/util/util.go:43-55``, ``metav1.IsControlledBy``). It overrides ``JobController.GetPodsForJob``
    (``common/pod.go:219-254``, ClaimPods with adoption), so orphans are never adopted."""
    j = job(worker=replica(replicas=4))
    mine = pod(j, "Worker", 0, "Running")
    orphan = orphan_of(j, pod(j, "Worker", 1, "Running"))
    foreign = orphan_of(j, pod(j, "Worker", 2, "Running"), owner_uid="other-uid")
    relabelled = pod(j, "Worker", 3, "Running")
    relabelled["metadata"]["labels"]["training.kubeflow.org/job-name"] = "other"
    non_controller = pod(j, "Worker", 3, "Running")
    non_controller["metadata"]["ownerReferences"][0]["controller"] = False
    candidates = [mine, orphan, foreign, relabelled, non_controller]
    assert so.job_pods(j, candidates) == [mine]

    plan = so.reconcile_job(j, so.job_pods(j, candidates), [], NOW)
    # The orphan is neither adopted nor counted: its index gets a pod of its own (whose create will hit a 409).
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["train-worker-1", "train-worker-2", "train-worker-3"]
    assert plan.status["replicaStatuses"]["Worker"]["active"] == 1
    assert not [k for k, _ in plan.steps if k not in ("event", "create_pod", "create_service")]


def test_services_need_only_the_labels() -> None:
    """``pytorchjob_controller.go:298-314``: every Service with the job's labels, whoever owns it (no ownership
    check, no adoption); an orphan Service with the right index satisfies ReconcileServices."""
    j = job(worker=replica(replicas=2))
    defaulted = so.apply_defaults(j)
    orphan = orphan_of(j, so.render_service(defaulted, "Worker", 0))
    foreign = orphan_of(j, so.render_service(defaulted, "Worker", 1), owner_uid="other-uid")
    unlabelled = orphan_of(j, so.render_service(defaulted, "Worker", 1))
    unlabelled["metadata"]["labels"] = {}
    assert so.job_services(j, [orphan, foreign, unlabelled]) == [orphan, foreign]
    plan = so.reconcile_job(j, [], so.job_services(j, [orphan, foreign, unlabelled]), NOW)
    assert plan.create_services == []


def test_only_the_controller_owner_is_woken_by_a_dependents_event() -> None:
    """``pytorchjob_controller.go:198-207``: ``EnqueueRequestForOwner(..., OnlyControllerOwner())``; the predicates
    drop objects without a replica-type label (``pkg/common/util/reconciler.go:78-81``)."""
    j = job(worker=replica())
    mine = pod(j, "Worker", 0, "Running")
    assert so.controller_job_key(mine) == ("ns", "train")
    assert so.controller_job_key(orphan_of(j, mine)) is None
    unlabelled = copy.deepcopy(mine)
    del unlabelled["metadata"]["labels"]["training.kubeflow.org/replica-type"]
    assert so.controller_job_key(unlabelled) is None


@pytest.mark.cluster
def test_an_orphan_pod_is_not_adopted_and_blocks_its_name(cluster: Cluster) -> None:
    """``pytorchjob_controller.go:281-296`` (no adoption) and ``control/pod_control.go:152-154`` (a failed create,
    here 409 AlreadyExists, is a ``FailedCreatePod`` Warning and an error: retried with backoff)."""
    name = unique("orphan")
    orphan = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-worker-0", "labels": so.replica_labels(name, "Worker", 0)},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "pytorch", "image": IMAGE, "command": SLEEP}]},
    }
    cluster.core.create_namespaced_pod(cluster.namespace, orphan)
    try:
        cluster.create_job(job(name, worker=replica(command=SLEEP)))
        event = wait_for(
            lambda: next((e for e in cluster.events(name) if e["reason"] == "FailedCreatePod"), None),
            30,
            "the FailedCreatePod Warning",
        )
        assert event["type"] == "Warning"
        assert event["message"] == f'Error creating: pods "{name}-worker-0" already exists'
        time.sleep(2)
        current = cluster.core.read_namespaced_pod(f"{name}-worker-0", cluster.namespace)
        assert not current.metadata.owner_references  # not adopted
        status = cluster.get_job(name).get("status") or {}
        assert "Running" not in conditions(status)
        assert not status.get("replicaStatuses")  # the pass fails before the status write
    finally:
        cluster.core.delete_namespaced_pod(f"{name}-worker-0", cluster.namespace, grace_period_seconds=0)


@pytest.mark.cluster
def test_the_operator_logs_its_replica_order_seed(kube_cluster: Any) -> None:
    """The randomised order (``pytorchjob_controller.go:369``, ``common/job.go:338``) is reproducible from the seed
    in the log."""
    text = (kube_cluster.state_dir / "logs" / "sim-operator.log").read_text()
    assert "replica order seed: " in text
