"""The simulated kubelet under PyTorchJobs (``@pytest.mark.cluster``): who may host the c10d rendezvous store, and a
Worker template's Unschedulable fault aimed at ``<job>-worker-0`` alone.

On a real cluster ``PET_RDZV_ENDPOINT=<job>-worker-0:23456`` resolves to worker-0's pod IP, so only worker-0's agent
hosts the TCPStore; here every pod shares 127.0.0.1, and the kubelet tells each agent with ``is_host=1|0``. These
tests run plain torchrun (the provider's runner is covered by the end-to-end tests) through the simulated operator.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster import sim_kubelet as sk
from tests.cluster_tests.test_sim_operator import wait_for

IMAGE = "registry.example/torchelastic-test:1"
# What each worker process prints: its rank and the rendezvous config its agent was given.
PROBE = (
    "import os\n"
    "print(f\"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
    "conf={os.environ.get('PET_RDZV_CONF')}\", flush=True)\n"
)
STORE_FAILED = "The connection to the C10d store has failed"


class Jobs:
    """Creates PyTorchJobs (and a ConfigMap with the probe script) in the test namespace; removes them at the end."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.jobs: list[str] = []
        self.script = f"rdzv-probe-{uuid.uuid4().hex[:6]}"
        self.core.create_namespaced_config_map(namespace, {"metadata": {"name": self.script}, "data": {"p.py": PROBE}})

    def create_elastic(self, name: str, *, torchrun_args: list[str], annotations: dict[str, str] | None) -> None:
        """Two Workers, nnodes 2:2, c10d; each runs ``torchrun [args] p.py`` under restartPolicy Never."""
        template: dict[str, Any] = {
            "spec": {
                "containers": [
                    {
                        "name": "pytorch",
                        "image": IMAGE,
                        "command": ["torchrun", *torchrun_args, "/etc/probe/p.py"],
                        "volumeMounts": [{"name": "probe", "mountPath": "/etc/probe"}],
                    }
                ],
                "volumes": [{"name": "probe", "configMap": {"name": self.script}}],
                "terminationGracePeriodSeconds": 3,
            }
        }
        if annotations:
            template["metadata"] = {"annotations": annotations}
        body = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": name},
            "spec": {
                "nprocPerNode": "1",
                "elasticPolicy": {"minReplicas": 2, "maxReplicas": 2, "rdzvBackend": "c10d"},
                "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "restartPolicy": "Never", "template": template}},
            },
        }
        self.custom.create_namespaced_custom_object("kubeflow.org", "v1", self.namespace, "pytorchjobs", body)
        self.jobs.append(name)

    def pod(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.rest import ApiException

        try:
            resp = self.core.read_namespaced_pod(name, self.namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return dict(json.loads(resp.data))

    def phase(self, name: str) -> str | None:
        pod = self.pod(name)
        return None if pod is None else (pod.get("status") or {}).get("phase")

    def log(self, name: str) -> str:
        resp = self.core.read_namespaced_pod_log(name, self.namespace, container="pytorch", _preload_content=False)
        return str(resp.data.decode())

    def pod_events(self, name: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}", _preload_content=False
        )
        return [e for e in json.loads(resp.data)["items"] if e["involvedObject"]["kind"] == "Pod"]

    def cleanup(self) -> None:
        from kubernetes.client.rest import ApiException

        for name in self.jobs:
            try:
                self.custom.delete_namespaced_custom_object("kubeflow.org", "v1", self.namespace, "pytorchjobs", name)
            except ApiException as err:
                if err.status != 404:
                    raise
            # No garbage collector in the test cluster: the pods go explicitly (the operator may already have).
            self.core.delete_collection_namespaced_pod(
                self.namespace, label_selector=f"training.kubeflow.org/job-name={name}", grace_period_seconds=0
            )
        self.core.delete_namespaced_config_map(self.script, self.namespace)


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Iterator[Any]:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kube_cluster.kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def jobs(api: Any, kube_cluster: Any) -> Iterator[Jobs]:
    helper = Jobs(api, kube_cluster.namespace)
    yield helper
    helper.cleanup()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.mark.cluster
def test_elastic_job_rendezvous_through_worker_0s_store(jobs: Jobs) -> None:
    """Both agents rendezvous; only worker-0's was told to host the store (``PET_RDZV_CONF`` created)."""
    name = unique("rdzv")
    jobs.create_elastic(name, torchrun_args=[], annotations=None)
    pods = [f"{name}-worker-{i}" for i in range(2)]
    wait_for(lambda: all(jobs.phase(p) in ("Succeeded", "Failed") for p in pods), 120, "both workers to end")
    assert [jobs.phase(p) for p in pods] == ["Succeeded", "Succeeded"], [jobs.log(p) for p in pods]
    outputs = [next(line for line in jobs.log(p).splitlines() if line.startswith("rank=")) for p in pods]
    assert [line.split(" conf=")[1] for line in outputs] == ["is_host=1", "is_host=0"], outputs
    assert sorted(line.split(" conf=")[0] for line in outputs) == ["rank=0 world=2", "rank=1 world=2"]


@pytest.mark.cluster
def test_worker_1_cannot_host_the_store_while_worker_0_is_unschedulable(jobs: Jobs) -> None:
    """The annotations an elastic job's Worker template needs so that only worker-0 never schedules; worker-1 then
    waits for worker-0's store as a client (``read_timeout``) and fails, instead of hosting the store itself (which
    would leave it waiting for a second node for the join timeout)."""
    name = unique("rdzv0")
    annotations = {sk.ANN_FAIL: "Unschedulable", sk.ANN_FAIL_INDEXES: "0"}
    # --rdzv-conf on the command line (is_host goes there, as for the provider's runner), with a short read timeout.
    jobs.create_elastic(name, torchrun_args=["--rdzv-conf", "read_timeout=3"], annotations=annotations)
    worker0, worker1 = f"{name}-worker-0", f"{name}-worker-1"
    wait_for(lambda: jobs.phase(worker1) in ("Succeeded", "Failed"), 90, "worker-1 to end")
    log = jobs.log(worker1)
    assert jobs.phase(worker1) == "Failed", log
    assert STORE_FAILED in log and "rank=" not in log, log

    # worker-0: Pending, never bound, as a real scheduler leaves a pod that no node fits.
    pod = jobs.pod(worker0)
    assert pod is not None
    status = pod["status"]
    assert status["phase"] == "Pending" and not pod["spec"].get("nodeName")
    (cond,) = status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"], cond["message"]) == (
        "PodScheduled",
        "False",
        "Unschedulable",
        "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
    )
    assert "containerStatuses" not in status and "podIP" not in status
    event = next(e for e in jobs.pod_events(worker0) if e["reason"] == "FailedScheduling")
    assert (event["type"], event["source"]["component"], event["message"]) == (
        "Warning",
        "default-scheduler",
        cond["message"],
    )
    # worker-1 was spared by fail-indexes: scheduled and run.
    spared = jobs.pod(worker1)
    assert spared is not None and spared["spec"]["nodeName"] == sk.NODE_NAME
    assert not [e for e in jobs.pod_events(worker1) if e["reason"] == "FailedScheduling"]
