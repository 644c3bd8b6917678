"""The simulated training operator: its pure decisions, then real PyTorchJobs on the local cluster.

The pure tests pin the controller rules from ``../shared/notes/pytorchjob-controller.md`` (defaults, env, labels,
the status decision). The ``@pytest.mark.cluster`` tests run real torch jobs (gloo all_reduce across pods) and the
failure paths through a real kube-apiserver, the simulated operator and the simulated kubelet.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from tests.cluster import sim_operator as so

T = TypeVar("T")
IMAGE = "registry.example/torchelastic-test:1"
NOW = 1_700_000_000.0

# ----------------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------------


def replica(
    replicas: int | None = 1, policy: str | None = None, command: list[str] | None = None, **template_meta: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "template": {
            "spec": {
                "containers": [{"name": "pytorch", "image": IMAGE, "command": command or ["python", "-c", "pass"]}]
            }
        }
    }
    if template_meta:
        spec["template"]["metadata"] = template_meta
    if replicas is not None:
        spec["replicas"] = replicas
    if policy is not None:
        spec["restartPolicy"] = policy
    return spec


def job(
    name: str = "train",
    *,
    master: dict[str, Any] | None = None,
    worker: dict[str, Any] | None = None,
    elastic: dict[str, Any] | None = None,
    run_policy: dict[str, Any] | None = None,
    status: dict[str, Any] | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    replicas = {}
    if master is not None:
        replicas["Master"] = master
    if worker is not None:
        replicas["Worker"] = worker
    spec: dict[str, Any] = {"pytorchReplicaSpecs": replicas, **spec_extra}
    if elastic is not None:
        spec["elasticPolicy"] = elastic
    if run_policy is not None:
        spec["runPolicy"] = run_policy
    obj: dict[str, Any] = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": "ns", "uid": "job-uid"},
        "spec": spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def pod(
    j: dict[str, Any], rtype: str, index: int, phase: str, exit_code: int | None = None, restarts: int = 0
) -> dict[str, Any]:
    """A pod as the operator would have created it, with a kubelet-written status."""
    rendered = so.render_pod(so.apply_defaults(j), rtype, index)
    rendered["metadata"]["uid"] = f"uid-{rtype}-{index}-{phase}"
    cs: dict[str, Any] = {"name": "pytorch", "restartCount": restarts, "state": {"running": {}}}
    if exit_code is not None:
        cs["state"] = {"terminated": {"exitCode": exit_code}}
    rendered["status"] = {"phase": phase, "containerStatuses": [cs]}
    return rendered


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions") or []}


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def env_of(p: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]}


# ----------------------------------------------------------------------------------------------------------------
# Pure: defaults, rendering, env
# ----------------------------------------------------------------------------------------------------------------


def _script_lines(log: str) -> list[str]:
    """The lines the test scripts print (``rank=...``), without what torch logs around them."""
    return [line for line in log.splitlines() if line.startswith("rank=")]


def test_defaults_are_applied_in_memory_only() -> None:
    raw = job(worker=replica(replicas=None), elastic={"minReplicas": 2})
    defaulted = so.apply_defaults(raw)
    worker = defaulted["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert (worker["replicas"], worker["restartPolicy"]) == (1, "OnFailure")
    assert defaulted["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 2}
    assert defaulted["spec"]["nprocPerNode"] == "auto"
    assert defaulted["spec"]["runPolicy"]["cleanPodPolicy"] == "None"
    assert worker["template"]["spec"]["containers"][0]["ports"] == [
        {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}
    ]
    assert "ports" not in raw["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def test_master_mode_pod_render() -> None:
    j = so.apply_defaults(job(master=replica(), worker=replica(replicas=2, policy="ExitCode")))
    worker = so.render_pod(j, "Worker", 1)
    meta = worker["metadata"]
    assert meta["name"] == "train-worker-1"
    assert meta["labels"] == {
        "training.kubeflow.org/operator-name": "pytorchjob-controller",
        "training.kubeflow.org/job-name": "train",
        "training.kubeflow.org/replica-type": "worker",
        "training.kubeflow.org/replica-index": "1",
    }
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "name": "train",
            "uid": "job-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert worker["spec"]["restartPolicy"] == "Never"  # ExitCode
    (init,) = worker["spec"]["initContainers"]
    assert (init["name"], init["image"]) == ("init-pytorch", "alpine:3.10")
    assert "nslookup train-master-0" in init["command"][-1]
    assert env_of(worker) == {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": "23456",
        "PET_MASTER_PORT": "23456",
        "MASTER_ADDR": "train-master-0",
        "PET_MASTER_ADDR": "train-master-0",
        "WORLD_SIZE": "3",
        "RANK": "2",
        "PET_NODE_RANK": "2",
        "PET_NPROC_PER_NODE": "auto",
        "PET_NNODES": "3",
    }
    master = so.render_pod(j, "Master", 0)
    assert master["metadata"]["labels"]["training.kubeflow.org/job-role"] == "master"
    assert "initContainers" not in master["spec"]
    assert env_of(master)["RANK"] == "0"


def test_elastic_env_and_template_metadata_are_kept() -> None:
    j = so.apply_defaults(
        job(
            worker=replica(replicas=2, labels={"team": "a"}, annotations={"sim.torchelastic.dev/fail": "OOMKilled"}),
            elastic={"minReplicas": 1, "maxReplicas": 2, "maxRestarts": 3, "rdzvConf": [{"key": "k", "value": "v"}]},
            nprocPerNode="2",
        )
    )
    w0 = so.render_pod(j, "Worker", 0)
    assert env_of(w0) == {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ENDPOINT": "train-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:2",
        "PET_MAX_RESTARTS": "3",
        "PET_RDZV_CONF": "k=v",
    }
    assert w0["metadata"]["labels"]["team"] == "a"
    assert w0["metadata"]["labels"]["training.kubeflow.org/job-role"] == "master"  # Worker-0 without a Master
    assert w0["metadata"]["annotations"] == {"sim.torchelastic.dev/fail": "OOMKilled"}
    assert "initContainers" not in w0["spec"]


def test_fail_indexes_reaches_only_the_listed_replicas_pods() -> None:
    """The template's annotations land on every pod; its replica-index label is what the kubelet aims faults by."""
    from tests.cluster import sim_kubelet as sk

    annotations = {sk.ANN_FAIL: "OOMKilled", sk.ANN_FAIL_INDEXES: "1"}
    j = so.apply_defaults(
        job(master=replica(annotations=annotations), worker=replica(replicas=3, annotations=annotations))
    )
    targeted = {
        so.render_pod(j, rtype, index)["metadata"]["name"]
        for rtype, count in (("Master", 1), ("Worker", 3))
        for index in range(count)
        if sk.faults_target(so.render_pod(j, rtype, index)["metadata"])
    }
    assert targeted == {"train-worker-1"}  # the Master is index 0 of its own type


def test_worker_only_env_and_service_render() -> None:
    j = so.apply_defaults(job(worker=replica(replicas=2)))
    assert env_of(so.render_pod(j, "Worker", 1)) == {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": "auto",
        "PET_NNODES": "2",
    }
    svc = so.render_service(j, "Worker", 1)
    assert svc["metadata"]["name"] == "train-worker-1"
    assert svc["spec"] == {
        "clusterIP": "None",
        "selector": {
            "training.kubeflow.org/operator-name": "pytorchjob-controller",
            "training.kubeflow.org/job-name": "train",
            "training.kubeflow.org/replica-type": "worker",
            "training.kubeflow.org/replica-index": "1",
        },
        "ports": [{"name": "pytorchjob-port", "port": 23456}],
    }


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda j: j["metadata"].update(name="Bad_Name"), "DNS-1035"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].pop("replicas"), "must be 1"),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(name="x"),
            "pytorch",
        ),
        (lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief=replica()), "Unsupported value"),
        (lambda j: j["spec"].update(elasticPolicy={}) or j["spec"]["pytorchReplicaSpecs"].pop("Worker"), "Worker"),
    ],
)
def test_webhook_rules(mutate: Callable[[dict[str, Any]], Any], fragment: str) -> None:
    j = job(master=replica(), worker=replica())
    assert so.validate_job(j) == []
    mutate(j)
    errors = so.validate_job(j)
    assert any(fragment in e for e in errors), errors


# ----------------------------------------------------------------------------------------------------------------
# Pure: conditions and the status decision
# ----------------------------------------------------------------------------------------------------------------


def test_set_condition_rules() -> None:
    status: dict[str, Any] = {}
    so.set_condition(status, "Running", "True", "PyTorchJobRunning", "running", "t1")
    so.set_condition(status, "Restarting", "True", "PyTorchJobRestarting", "restarting", "t2")
    assert conditions(status) == {"Restarting": "True"}  # Restarting replaces Running
    so.set_condition(status, "Running", "True", "PyTorchJobRunning", "running", "t3")
    so.set_condition(status, "Succeeded", "True", "PyTorchJobSucceeded", "done", "t4")
    assert conditions(status) == {"Running": "False", "Succeeded": "True"}
    so.set_condition(status, "Failed", "True", "PyTorchJobFailed", "x", "t5")
    so.set_condition(status, "Running", "True", "PyTorchJobRunning", "again", "t6")
    assert conditions(status)["Running"] == "False"  # nothing changes once Failed


def test_new_job_creates_pods_and_services_and_becomes_created() -> None:
    plan = so.reconcile_job(job(master=replica(), worker=replica(replicas=2)), [], [], NOW)
    assert sorted(p["metadata"]["name"] for p in plan.create_pods) == [
        "train-master-0",
        "train-worker-0",
        "train-worker-1",
    ]
    assert len(plan.create_services) == 3
    assert conditions(plan.status) == {"Created": "True"}
    assert condition(plan.status, "Created")["message"] == "PyTorchJob train is created."
    assert plan.status["startTime"] == so.to_rfc3339(NOW)
    assert plan.status["replicaStatuses"]["Worker"] == {
        "active": 0,
        "succeeded": 0,
        "failed": 0,
        "selector": "training.kubeflow.org/job-name=train,training.kubeflow.org/operator-name=pytorchjob-controller,"
        "training.kubeflow.org/replica-type=worker",
    }


def test_master_decides_success() -> None:
    j = job(master=replica(), worker=replica(replicas=2))
    pods = [pod(j, "Master", 0, "Succeeded", 0), pod(j, "Worker", 0, "Running"), pod(j, "Worker", 1, "Failed", 1)]
    plan = so.reconcile_job(j, pods, [], NOW)
    assert conditions(plan.status)["Succeeded"] == "True"
    assert condition(plan.status, "Succeeded")["reason"] == "PyTorchJobSucceeded"
    assert plan.status["completionTime"] == so.to_rfc3339(NOW)


@pytest.mark.parametrize(("elastic", "succeeded"), [(None, False), ({"minReplicas": 1, "maxReplicas": 2}, True)])
def test_worker_only_success_needs_all_workers_unless_elastic(elastic: dict[str, Any] | None, succeeded: bool) -> None:
    j = job(worker=replica(replicas=2), elastic=elastic)
    plan = so.reconcile_job(j, [pod(j, "Worker", 0, "Succeeded", 0), pod(j, "Worker", 1, "Running")], [], NOW)
    assert conditions(plan.status).get("Succeeded") == ("True" if succeeded else None)
    if not succeeded:
        assert condition(plan.status, "Running")["message"] == "PyTorchJob ns/train is running."


def test_never_policy_fails_the_job() -> None:
    j = job(master=replica(policy="Never"), worker=replica(policy="Never"))
    plan = so.reconcile_job(j, [pod(j, "Master", 0, "Failed", 137), pod(j, "Worker", 0, "Running")], [], NOW)
    failed = condition(plan.status, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "PyTorchJobFailed")
    assert failed["message"] == "PyTorchJob train is failed because 1 Master replica(s) failed."
    assert plan.delete_pods == []  # Never: no restart
    assert plan.status["completionTime"]


@pytest.mark.parametrize(("code", "restart"), [(137, True), (143, True), (1, False), (127, False), (0, False)])
def test_exit_code_policy(code: int, restart: bool) -> None:
    j = job(master=replica(policy="ExitCode"))
    plan = so.reconcile_job(j, [pod(j, "Master", 0, "Failed", code)], [], NOW)
    if restart:
        assert plan.delete_pods == ["train-master-0"]
        assert conditions(plan.status)["Restarting"] == "True"
        assert "Failed" not in conditions(plan.status)
    else:
        assert plan.delete_pods == []
        assert (
            condition(plan.status, "Failed")["message"] == 'job "train" is failing because "Master" replica(s) failed.'
        )
        assert "completionTime" not in plan.status  # the permanent path leaves it nil
    assert any(e.reason == "ExitedWithCode" and e.message.endswith(f"exited with code {code}") for e in plan.events)


def test_on_failure_recreates_failed_pods() -> None:
    j = job(worker=replica(replicas=2))
    plan = so.reconcile_job(j, [pod(j, "Worker", 0, "Failed", 1), pod(j, "Worker", 1, "Running")], [], NOW)
    assert plan.delete_pods == ["train-worker-0"]
    # ReconcilePods says "job ... is restarting", then UpdateJobStatus sets Running (worker-1 runs), which drops
    # Restarting, and Restarting again with its own message: the real controller's sequence.
    assert (
        condition(plan.status, "Restarting")["message"]
        == "PyTorchJob train is restarting because 1 Worker replica(s) failed."
    )
    assert "Running" not in conditions(plan.status)


def test_backoff_limit_counts_restarts_of_running_pods() -> None:
    j = job(worker=replica(replicas=2), run_policy={"backoffLimit": 2})
    pods = [pod(j, "Worker", 0, "Running", restarts=1), pod(j, "Worker", 1, "Running", restarts=1)]
    plan = so.reconcile_job(j, pods, [], NOW)
    failed = condition(plan.status, "Failed")
    assert failed["message"] == "Job train has failed because it has reached the specified backoff limit"
    assert plan.delete_pods == []  # cleanPodPolicy None


def test_active_deadline() -> None:
    started = {"startTime": so.to_rfc3339(NOW - 10), "conditions": []}
    j = job(worker=replica(), run_policy={"activeDeadlineSeconds": 5, "cleanPodPolicy": "All"}, status=started)
    plan = so.reconcile_job(j, [pod(j, "Worker", 0, "Running")], [], NOW)
    assert (
        condition(plan.status, "Failed")["message"]
        == "Job train has failed because it was active longer than specified deadline"
    )
    assert plan.delete_pods == ["train-worker-0"]
    j2 = job(worker=replica(), run_policy={"activeDeadlineSeconds": 60}, status=started)
    plan2 = so.reconcile_job(j2, [pod(j2, "Worker", 0, "Running")], [], NOW)
    # No requeue at the deadline: upstream's goes to a no-op FakeWorkQueue (pytorchjob_controller.go:82, 365).
    assert "Failed" not in conditions(plan2.status) and plan2.requeue_after is None


@pytest.mark.parametrize(
    ("policy", "deleted"),
    [("None", []), ("Running", ["train-worker-1"]), ("All", ["train-worker-0", "train-worker-1"])],
)
def test_clean_pod_policy_and_ttl(policy: str, deleted: list[str]) -> None:
    done = {
        "conditions": [{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}],
        "completionTime": so.to_rfc3339(NOW - 30),
        "replicaStatuses": {"Worker": {"active": 1, "succeeded": 1, "failed": 0}},
    }
    j = job(
        worker=replica(replicas=2), run_policy={"cleanPodPolicy": policy, "ttlSecondsAfterFinished": 60}, status=done
    )
    plan = so.reconcile_job(j, [pod(j, "Worker", 0, "Succeeded", 0), pod(j, "Worker", 1, "Running")], [], NOW)
    assert plan.delete_pods == deleted
    assert plan.status["replicaStatuses"]["Worker"]["succeeded"] == 2  # active moves to succeeded
    assert (plan.delete_job, plan.requeue_after) == (False, pytest.approx(30))
    assert so.reconcile_job(j, [], [], NOW + 31).delete_job


def test_suspend_and_resume() -> None:
    j = job(worker=replica(), run_policy={"suspend": True})
    plan = so.reconcile_job(j, [pod(j, "Worker", 0, "Running")], [], NOW)
    assert plan.delete_pods == ["train-worker-0"]
    assert conditions(plan.status)["Suspended"] == "True"
    resumed = job(worker=replica(), run_policy={"suspend": False}, status=copy.deepcopy(plan.status))
    plan2 = so.reconcile_job(resumed, [], [], NOW + 5)
    suspended = condition(plan2.status, "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("False", "PyTorchJobResumed")
    assert plan2.status["startTime"] == so.to_rfc3339(NOW + 5)
    assert [p["metadata"]["name"] for p in plan2.create_pods] == ["train-worker-0"]


def test_the_operator_does_not_validate() -> None:
    """The webhook rejects invalid jobs at admission (tests/cluster/sim_webhook.py); the controller has no validation
    of its own (``pytorchjob_controller.go:124-179`` goes straight to defaulting and ReconcileJobs), so a job that got
    past admission is reconciled as it is."""
    raw = job(master=replica(replicas=2))
    assert so.validate_job(raw) == ["spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1"]
    plan = so.reconcile_job(raw, [], [], NOW)
    assert "Failed" not in conditions(plan.status)
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["train-master-0", "train-master-1"]


# ----------------------------------------------------------------------------------------------------------------
# Cluster
# ----------------------------------------------------------------------------------------------------------------

DDP_SCRIPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank={rank} world={world} allreduce={t.item()}", flush=True)
dist.destroy_process_group()
"""


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.3) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class Cluster:
    """Thin helpers over the sync client for one test; deletes the jobs it created at the end."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.jobs: list[str] = []

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"].pop("uid", None)
        body["metadata"]["namespace"] = self.namespace
        created = self.custom.create_namespaced_custom_object("kubeflow.org", "v1", self.namespace, "pytorchjobs", body)
        self.jobs.append(body["metadata"]["name"])
        return dict(created)

    def get_job(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object("kubeflow.org", "v1", self.namespace, "pytorchjobs", name))

    def job_exists(self, name: str) -> bool:
        from kubernetes.client.rest import ApiException

        try:
            self.get_job(name)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def delete_job(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.custom.delete_namespaced_custom_object("kubeflow.org", "v1", self.namespace, "pytorchjobs", name)
        except ApiException as err:
            if err.status != 404:
                raise

    def wait_condition(self, name: str, ctype: str, timeout: float = 90) -> dict[str, Any]:
        """Wait until condition ``ctype`` is True; fails early if the job finishes the other way."""
        terminal = {"Succeeded", "Failed"} - {ctype}

        def check() -> dict[str, Any] | None:
            status = self.get_job(name).get("status") or {}
            true = {c["type"] for c in status.get("conditions") or [] if c["status"] == "True"}
            if true & terminal:
                raise AssertionError(f"job {name} ended {true & terminal}, not {ctype}: {json.dumps(status, indent=1)}")
            return status if ctype in true else None

        return wait_for(check, timeout, f"{name} {ctype}")

    def pods(self, job_name: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"training.kubeflow.org/job-name={job_name}", _preload_content=False
        )
        return list(json.loads(resp.data)["items"])

    def log(self, pod_name: str) -> str:
        resp = self.core.read_namespaced_pod_log(pod_name, self.namespace, container="pytorch", _preload_content=False)
        return str(resp.data.decode())

    def events(self, job_name: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={job_name}", _preload_content=False
        )
        return [e for e in json.loads(resp.data)["items"] if e["involvedObject"]["kind"] == "PyTorchJob"]

    def cleanup(self) -> None:
        for name in self.jobs:
            self.delete_job(name)


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Iterator[Any]:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kube_cluster.kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def cluster(api: Any, kube_cluster: Any) -> Iterator[Cluster]:
    helper = Cluster(api, kube_cluster.namespace)
    yield helper
    helper.cleanup()


@pytest.fixture
def ddp_script(cluster: Cluster) -> Iterator[str]:
    name = f"ddp-script-{uuid.uuid4().hex[:6]}"
    cluster.core.create_namespaced_config_map(
        cluster.namespace, {"metadata": {"name": name}, "data": {"ddp.py": DDP_SCRIPT}}
    )
    yield name
    cluster.core.delete_namespaced_config_map(name, cluster.namespace)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def torch_replica(script_cm: str, replicas: int, policy: str, command: list[str]) -> dict[str, Any]:
    """A replica that runs the DDP script from a ConfigMap mounted at /etc/ddp."""
    spec = replica(replicas=replicas, policy=policy, command=command)
    pod_spec = spec["template"]["spec"]
    pod_spec["containers"][0]["volumeMounts"] = [{"name": "script", "mountPath": "/etc/ddp"}]
    pod_spec["volumes"] = [{"name": "script", "configMap": {"name": script_cm}}]
    return spec


@pytest.mark.cluster
def test_master_worker_ddp_job_succeeds(cluster: Cluster, ddp_script: str) -> None:
    name = unique("ddp")
    command = ["python", "-m", "torch.distributed.run", "/etc/ddp/ddp.py"]
    body = job(
        name,
        master=torch_replica(ddp_script, 1, "Never", command),
        worker=torch_replica(ddp_script, 1, "Never", command),
        nprocPerNode="1",
    )
    start = time.monotonic()
    cluster.create_job(body)
    status = cluster.wait_condition(name, "Succeeded", timeout=120)
    assert time.monotonic() - start < 120
    assert status["replicaStatuses"]["Master"]["succeeded"] == 1
    assert status["completionTime"] and status["startTime"]
    assert conditions(status)["Running"] == "False"
    # The script's own last line: torch may log after it (a peer that hosted the store and left first makes c10d
    # warn "recvValueWithTimeout failed").
    assert _script_lines(cluster.log(f"{name}-master-0"))[-1] == "rank=0 world=2 allreduce=3.0"
    assert _script_lines(cluster.log(f"{name}-worker-0"))[-1] == "rank=1 world=2 allreduce=3.0"
    services = json.loads(
        cluster.core.list_namespaced_service(
            cluster.namespace, label_selector=f"training.kubeflow.org/job-name={name}", _preload_content=False
        ).data
    )["items"]
    assert sorted((s["metadata"]["name"], s["spec"]["clusterIP"]) for s in services) == [
        (f"{name}-master-0", "None"),
        (f"{name}-worker-0", "None"),
    ]
    worker = next(p for p in cluster.pods(name) if p["metadata"]["name"].endswith("worker-0"))
    assert worker["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert any(e["reason"] == "ExitedWithCode" for e in cluster.events(name))


@pytest.mark.cluster
def test_elastic_worker_only_job_succeeds(cluster: Cluster, ddp_script: str) -> None:
    name = unique("elastic")
    body = job(
        name,
        worker=torch_replica(ddp_script, 2, "OnFailure", ["torchrun", "/etc/ddp/ddp.py"]),
        elastic={"minReplicas": 2, "maxReplicas": 2, "rdzvBackend": "c10d"},
        nprocPerNode="1",
    )
    cluster.create_job(body)
    cluster.wait_condition(name, "Succeeded", timeout=120)
    wait_for(lambda: all(p["status"]["phase"] == "Succeeded" for p in cluster.pods(name)), 30, "both pods done")
    # The script's own line: torch elastic may log after it (the agent warns it "failed to shutdown the rendezvous").
    outputs = sorted(_script_lines(cluster.log(f"{name}-worker-{i}"))[-1] for i in range(2))
    assert outputs == ["rank=0 world=2 allreduce=3.0", "rank=1 world=2 allreduce=3.0"]


@pytest.mark.cluster
def test_exit_code_policy_fails_permanently_on_exit_1(cluster: Cluster) -> None:
    name = unique("exit1")
    cluster.create_job(job(name, master=replica(policy="ExitCode", command=["python", "-c", "raise SystemExit(1)"])))
    status = cluster.wait_condition(name, "Failed", timeout=60)
    failed = condition(status, "Failed")
    assert (failed["reason"], failed["message"]) == (
        "PyTorchJobFailed",
        f'job "{name}" is failing because "Master" replica(s) failed.',
    )
    assert "completionTime" not in status
    assert len(cluster.pods(name)) == 1  # not restarted
    assert any(e["message"].endswith("exited with code 1") for e in cluster.events(name))


@pytest.mark.cluster
def test_exit_code_policy_restarts_after_oom_kill(cluster: Cluster) -> None:
    name = unique("oom")
    annotations = {
        "sim.torchelastic.dev/fail": "OOMKilled",
        "sim.torchelastic.dev/fail-after-seconds": "0.5",
        "sim.torchelastic.dev/fail-times": "1",
    }
    command = ["python", "-c", "import time; time.sleep(1.5); print('done')"]
    cluster.create_job(job(name, master=replica(policy="ExitCode", command=command, annotations=annotations)))
    # Restarting lasts only until the new pod runs (Running replaces it), so the events are the record.
    status = cluster.wait_condition(name, "Succeeded", timeout=60)
    assert status["replicaStatuses"]["Master"]["succeeded"] == 1
    messages = [e["message"] for e in cluster.events(name)]
    assert any(m.endswith("exited with code 137") for m in messages)
    assert any(m == f"job {name} is restarting because Master replica(s) failed." for m in messages)


@pytest.mark.cluster
def test_never_policy_fails_the_job_on_oom(cluster: Cluster) -> None:
    name = unique("never")
    annotations = {"sim.torchelastic.dev/fail": "OOMKilled", "sim.torchelastic.dev/fail-after-seconds": "0.5"}
    command = ["python", "-c", "import time; time.sleep(30)"]
    cluster.create_job(
        job(
            name,
            master=replica(policy="Never", command=command, annotations=annotations),
            worker=replica(policy="Never", command=command),
        )
    )
    status = cluster.wait_condition(name, "Failed", timeout=60)
    assert condition(status, "Failed")["message"] == f"PyTorchJob {name} is failed because 1 Master replica(s) failed."
    assert status["completionTime"]


@pytest.mark.cluster
def test_fail_indexes_oom_kills_only_the_listed_worker(cluster: Cluster) -> None:
    name = unique("idx")
    annotations = {
        "sim.torchelastic.dev/fail": "OOMKilled",
        "sim.torchelastic.dev/fail-after-seconds": "0.5",
        "sim.torchelastic.dev/fail-indexes": "1",
    }
    command = ["python", "-c", "import time; time.sleep(2)"]
    cluster.create_job(job(name, worker=replica(replicas=3, policy="Never", command=command, annotations=annotations)))
    status = cluster.wait_condition(name, "Failed", timeout=60)
    assert condition(status, "Failed")["message"] == f"PyTorchJob {name} is failed because 1 Worker replica(s) failed."

    def ended() -> dict[str, dict[str, Any]] | None:
        pods = {p["metadata"]["name"]: p["status"] for p in cluster.pods(name)}
        return (
            pods if len(pods) == 3 and all(s.get("phase") in ("Succeeded", "Failed") for s in pods.values()) else None
        )

    pods = wait_for(ended, 30, "all three workers to end")
    outcome = {pod: (s["phase"], s["containerStatuses"][0]["state"]["terminated"]["reason"]) for pod, s in pods.items()}
    assert outcome == {
        f"{name}-worker-0": ("Succeeded", "Completed"),
        f"{name}-worker-1": ("Failed", "OOMKilled"),
        f"{name}-worker-2": ("Succeeded", "Completed"),
    }


@pytest.mark.cluster
def test_eviction_under_on_failure_recreates_the_pod(cluster: Cluster) -> None:
    name = unique("evict")
    annotations = {"sim.torchelastic.dev/evict-after-seconds": "1", "sim.torchelastic.dev/fail-times": "1"}
    command = ["python", "-c", "import time; time.sleep(2)"]
    cluster.create_job(job(name, worker=replica(policy="OnFailure", command=command, annotations=annotations)))
    cluster.wait_condition(name, "Succeeded", timeout=60)
    reasons = [(e["type"], e["reason"]) for e in cluster.events(name)]
    assert ("Warning", "PyTorchJobRestarting") in reasons
    assert reasons.count(("Normal", "SuccessfulCreatePod")) == 2  # the evicted pod was replaced


@pytest.mark.cluster
def test_image_pull_backoff_is_reported_on_the_job(cluster: Cluster) -> None:
    name = unique("pull")
    cluster.create_job(job(name, worker=replica(annotations={"sim.torchelastic.dev/fail": "ImagePullBackOff"})))
    event = wait_for(
        lambda: next((e for e in cluster.events(name) if e["reason"] == "ImagePullBackOff"), None), 60, "the Warning"
    )
    assert event["type"] == "Warning"
    assert "Back-off pulling image" in event["message"]
    assert "Running" not in conditions(cluster.get_job(name).get("status") or {})


@pytest.mark.cluster
def test_deleting_a_job_collects_its_pods_services_configmaps_and_processes(
    cluster: Cluster, kube_cluster: Any
) -> None:
    name = unique("gc")
    command = ["python", "-c", "import os, time; print(os.getpgid(0), flush=True); time.sleep(300)"]
    created = cluster.create_job(job(name, worker=replica(replicas=2, command=command)))
    payload = f"{name}-payload"
    cluster.core.create_namespaced_config_map(
        cluster.namespace,
        {
            "metadata": {
                "name": payload,
                "ownerReferences": [
                    {
                        "apiVersion": "kubeflow.org/v1",
                        "kind": "PyTorchJob",
                        "name": name,
                        "uid": created["metadata"]["uid"],
                    }
                ],
            },
            "data": {"x": "y"},
        },
    )
    cluster.wait_condition(name, "Running", timeout=60)
    pgids = wait_for(
        lambda: (
            [int(cluster.log(p["metadata"]["name"]).strip()) for p in cluster.pods(name)]
            if all(cluster.log(p["metadata"]["name"]).strip() for p in cluster.pods(name))
            else None
        ),
        30,
        "pgids",
    )
    cluster.delete_job(name)
    wait_for(lambda: not cluster.pods(name), 30, "pods gone")
    wait_for(
        lambda: (
            not cluster.core.list_namespaced_config_map(
                cluster.namespace, field_selector=f"metadata.name={payload}"
            ).items
        ),
        30,
        "payload gone",
    )
    assert not cluster.core.list_namespaced_service(
        cluster.namespace, label_selector=f"training.kubeflow.org/job-name={name}"
    ).items
    import os

    for pgid in pgids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


@pytest.mark.cluster
def test_clean_pod_policy_all_and_ttl_after_finished(cluster: Cluster) -> None:
    name = unique("ttl")
    cluster.create_job(job(name, worker=replica(), run_policy={"cleanPodPolicy": "All", "ttlSecondsAfterFinished": 2}))
    cluster.wait_condition(name, "Succeeded", timeout=60)
    wait_for(lambda: not cluster.pods(name), 30, "pods cleaned up")
    wait_for(lambda: not cluster.job_exists(name), 30, "the job deleted by its TTL")


@pytest.mark.cluster
def test_suspend_deletes_pods_and_resume_restarts(cluster: Cluster) -> None:
    name = unique("suspend")
    cluster.create_job(job(name, worker=replica(command=["python", "-c", "import time; time.sleep(300)"])))
    cluster.wait_condition(name, "Running", timeout=60)
    patch = {"spec": {"runPolicy": {"suspend": True}}}
    cluster.custom.patch_namespaced_custom_object("kubeflow.org", "v1", cluster.namespace, "pytorchjobs", name, patch)
    cluster.wait_condition(name, "Suspended", timeout=30)
    wait_for(lambda: not cluster.pods(name), 30, "pods deleted")
    patch = {"spec": {"runPolicy": {"suspend": False}}}
    cluster.custom.patch_namespaced_custom_object("kubeflow.org", "v1", cluster.namespace, "pytorchjobs", name, patch)
    cluster.wait_condition(name, "Running", timeout=60)
    assert condition(cluster.get_job(name)["status"], "Suspended")["reason"] == "PyTorchJobResumed"


# ----------------------------------------------------------------------------------------------------------------
# Pure: the informer's 410 handling, with the network faked at the response level
# ----------------------------------------------------------------------------------------------------------------


class FakeResponse:
    """What the client returns with ``_preload_content=False``: ``.data`` for a list, ``.stream()`` for a watch."""

    def __init__(self, body: dict[str, Any] | None = None, events: list[dict[str, Any]] | None = None) -> None:
        self.data = json.dumps(body or {}).encode()
        self._events = events or []

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        payload = b"".join(json.dumps(e).encode() + b"\n" for e in self._events)
        yield payload[:7]  # events split across chunks must still parse
        yield payload[7:]

    def release_conn(self) -> None:
        pass


def obj(name: str, rv: str, uid: str | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid or name, "resourceVersion": rv}}


def test_informer_relists_after_410_and_reports_vanished_objects() -> None:
    import threading

    stop = threading.Event()
    calls: list[dict[str, Any]] = []
    responses = iter(
        [
            FakeResponse({"metadata": {"resourceVersion": "5"}, "items": [obj("a", "4"), obj("b", "5")]}),
            FakeResponse(
                events=[{"type": "MODIFIED", "object": obj("a", "6")}, {"type": "ERROR", "object": {"code": 410}}]
            ),
            FakeResponse({"metadata": {"resourceVersion": "9"}, "items": [obj("a", "8")]}),  # b vanished meanwhile
            FakeResponse(events=[{"type": "BOOKMARK", "object": obj("", "10")}]),
        ]
    )

    def list_fn(**kwargs: Any) -> FakeResponse:
        calls.append(kwargs)
        try:
            return next(responses)
        except StopIteration:
            stop.set()
            raise RuntimeError("done") from None

    seen: list[tuple[str, str, str]] = []
    informer = so.Informer(
        "x", list_fn, lambda kind, o: seen.append((kind, o["metadata"]["name"], o["metadata"]["resourceVersion"]))
    )
    informer.run(stop)
    assert [c.get("resource_version") for c in calls] == [None, "5", None, "9", "10"]
    assert [c.get("watch", False) for c in calls] == [False, True, False, True, True]
    assert ("MODIFIED", "a", "6") in seen and ("DELETED", "b", "5") in seen
    assert [o["metadata"]["name"] for o in informer.items()] == ["a"]
