"""TrainJobs on the real node (issue 33, item 1): the simulated Trainer (tests/cluster/sim_trainer.py, beside the real
node) goes TrainJob -> JobSet -> indexed Job -> pods, and the real kube-scheduler, kubelet and containerd run the
pods from the runner image. What the simulated kubelet plays here happens for real: the rendezvous at
``<tj>-node-0-0.<tj>`` (``PET_MASTER_ADDR``) goes through the cluster DNS and the JobSet's headless Service to a pod
IP, and each node's pod has an IP of its own on the node's bridge.

The DAGs are tests/dags/k8s_trainjob.py's, as tests/e2e/test_trainjob.py runs them on the simulated kubelet. Kept
there, and why: the OOM-killed node (a kill that lands at a chosen moment of a chosen node, once per DAG run, is an
injected fault; the real kernel's OOM is tests/e2e/test_root_cause_on_node.py's) and the suspended TrainJob (the
test plays Kueue's resume from another thread at a moment of its choosing, against the simulated Trainer's sped-up
clock; nothing of the node is involved while it is suspended).
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.pytest_plugin import RealNodeCluster
from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import Cluster, run_dag, wait_for
from tests.e2e.test_trainjob import Trainer

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("airflow_db", "clean_namespace")]
# The real node's fixtures, bound here so that pytest finds them.
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, real_node_image = on_node.real_node_env, on_node.node_dag_env, on_node.real_node_image


@pytest.fixture
def trainer(cluster: Cluster) -> Iterator[Trainer]:
    trainer = Trainer(cluster)
    yield trainer
    trainer.delete_all()


class UiListing:
    """What the UI plugin's source (``plugin.sources.KubeJobs``, through ``kubernetes_default``) lists of the
    namespace's TrainJobs while a DAG runs: each TrainJob's name with its pods' names and IPs, once it has 2 pods
    with an IP (the pods are deleted with their TrainJob before the run returns)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.seen: dict[str, dict[str, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ui-listing", daemon=True)

    def _watch(self) -> None:
        from airflow_provider_torchelastic.plugin.sources import KubeJobs

        while not self._stop.wait(1.0):
            # A new KubeJobs each time: its lists are cached for LIST_TTL seconds.
            for job in KubeJobs("kubernetes_default").jobs(self.namespace):
                ips = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in job.pods}
                if job.kind == "TrainJob" and len(ips) == 2 and all(ips.values()):
                    self.seen.setdefault(job.name, {name: str(ip) for name, ip in ips.items()})

    def __enter__(self) -> UiListing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_the_same_dag_runs_as_a_pytorchjob_and_as_a_trainjob_by_changing_one_option(
    real_node_cluster: RealNodeCluster,
    trainer: Trainer,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    results = {}
    with UiListing(real_node_cluster.namespace) as listing:
        for option in ("pytorchjob", "auto"):
            monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__JOB_KIND", option)
            result = run_dag("k8s_two_node_training")
            assert result.state == "success", result
            results[option] = result
    pytorchjob, trainjob = results["pytorchjob"], results["auto"]
    assert pytorchjob.xcom(key="job_kind") == "PyTorchJob"
    # auto: this cluster serves TrainJob (API discovery), and two fixed nodes fit one.
    assert trainjob.xcom(key="job_kind") == "TrainJob"
    log = "".join(capfd.readouterr())
    assert "Job kind: TrainJob (job_kind='auto': the cluster serves TrainJob" in log
    for result in (pytorchjob, trainjob):
        value = result.xcom()
        assert value["world_size"] == 2 and value["rank"] == 0 and value["node_rank"] == 0, value
        assert value["loss"] < 1.0, value
    assert trainjob.xcom()["loss"] == pytest.approx(pytorchjob.xcom()["loss"]), "the same training, the same result"
    manifest = trainjob.xcom(key="manifests")[1]
    assert manifest["kind"] == "TrainJob" and manifest["spec"]["trainer"]["numNodes"] == 2
    name = trainjob.xcom(key="job_name")
    # The UI's listing found the TrainJob with its two nodes' pods (through its JobSet and Jobs), each with a pod IP
    # of its own on the node's bridge: the rendezvous above went through the cluster DNS to one of them.
    pods = listing.seen.get(name)
    assert pods is not None, listing.seen
    assert sorted(pod.rsplit("-", 1)[0] for pod in pods) == [f"{name}-node-0-0", f"{name}-node-0-1"], pods
    bridge = ipaddress.ip_network(real_node_cluster.layout.subnet)
    assert len(set(pods.values())) == 2 and all(ipaddress.ip_address(ip) in bridge for ip in pods.values()), pods
    # Succeeded: deleted with its JobSet, Jobs and pods (on_finish_action's default).
    wait_for(lambda: trainer.get(name) is None, 30, f"TrainJob {name} to be deleted")


def test_a_failing_node_fails_the_task_at_once_naming_its_pod_and_rank(trainer: Trainer, failure_dir: Path) -> None:
    result = run_dag("k8s_trainjob_node_fails")
    assert result.state == "failed", result
    assert result.tasks == {("train", -1): ("failed", 1)}, "an exception of the function is not retried"
    error = (failure_dir / "k8s_trainjob_node_fails.train.try1.txt").read_text()
    assert error.startswith("airflow_provider_torchelastic.operators.UserCodeFailedError: "), error
    assert "rank 1" in error and "ValueError: shard 3 has a corrupt header" in error, error
    name = result.xcom(key="job_name")
    assert f"{name}-node-0-1-" in error, "the failing node's pod is named"
    # Stopped rather than left restarting in place up to the Job's backoff limit.
    wait_for(lambda: trainer.get(name) is None, 30, f"TrainJob {name} to be deleted")
