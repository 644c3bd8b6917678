"""The preflight's smoke job on the real node (issue 33, item 3): the simulated kubelet runs every image as the runner
env, so only a real kubelet and containerd can tell an image that runs the runner from one that does not.

With deploy/rbac.yaml bound to the cluster's service account, as tests/e2e/test_preflight.py does on the simulated
kubelet (where the preflight's other rows are tested): ``python -m airflow_provider_torchelastic.preflight --smoke``
with the runner image passes, and with an image the node already has that lacks the runner (the ``alpine:3.10``
stand-in of the PyTorchJob's init container, tests/cluster/image.py: no Python at all) fails its smoke row with the
fix; either way nothing is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml

from tests.cluster.image import ALPINE_REF
from tests.cluster.pytest_plugin import RealNodeCluster
from tests.conftest import REPO_ROOT
from tests.e2e import real_node_support as on_node
from tests.e2e.test_kubernetes import MANAGED, Cluster, _sa_can_get_pods, set_connection, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("clean_namespace", "deploy_rbac_on_node")]
# The real node's fixtures, bound here so that pytest finds them.
cluster, clean_namespace, failure_dir = on_node.cluster, on_node.clean_namespace, on_node.failure_dir
real_node_env, node_dag_env, real_node_image = on_node.real_node_env, on_node.node_dag_env, on_node.real_node_image


@pytest.fixture
def deploy_rbac_on_node(
    cluster: Cluster, real_node_cluster: RealNodeCluster, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """deploy/rbac.yaml bound to the service account, and ``kubernetes_default`` pointed at that identity."""
    from kubernetes.client.exceptions import ApiException

    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / "rbac.yaml").read_text())}
    ns, sa_kubeconfig = cluster.namespace, real_node_cluster.info.sa_kubeconfig
    cluster.rbac.create_namespaced_role(ns, docs["Role"])
    cluster.rbac.create_namespaced_role_binding(ns, docs["RoleBinding"])
    try:
        wait_for(lambda: _sa_can_get_pods(cluster, sa_kubeconfig), 10, "the RoleBinding to take effect")
        set_connection(monkeypatch, sa_kubeconfig, ns)
        yield
    finally:
        for delete, kind in (
            (cluster.rbac.delete_namespaced_role_binding, "RoleBinding"),
            (cluster.rbac.delete_namespaced_role, "Role"),
        ):
            try:
                delete(docs[kind]["metadata"]["name"], ns)
            except ApiException as e:
                if e.status != 404:
                    raise


def _nothing_left(cluster: Cluster) -> None:
    wait_for(lambda: cluster.pods(MANAGED) == [] and cluster.payloads() == [], 60, "the smoke job to be deleted")


def test_smoke_runs_the_runner_image_and_leaves_nothing(cluster: Cluster, real_node_image: str) -> None:
    command = ["-m", "airflow_provider_torchelastic.preflight", "--smoke", "--image", real_node_image, "--json"]
    done = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    doc = json.loads(done.stdout)
    smoke = [c for c in doc["checks"] if c["check"].startswith("smoke:")]
    assert smoke == [
        {
            "check": f"smoke: one-pod job of {real_node_image}",
            "result": "ok",
            "required": True,
            "detail": "the runner read the payload and ran it",
            "fix": "",
        }
    ], done.stderr
    assert "[smoke] created Pod" in done.stderr
    _nothing_left(cluster)


def test_smoke_with_an_image_without_the_runner_fails_its_row_with_the_fix(cluster: Cluster) -> None:
    from airflow_provider_torchelastic.core.version import __version__
    from airflow_provider_torchelastic.kubernetes.preflight import Result
    from airflow_provider_torchelastic.preflight import run_preflight

    report = run_preflight(smoke=True, image=ALPINE_REF, smoke_timeout=120, log=lambda line: None)
    assert report.exit_code == 1, report.to_table()
    (row,) = report.failing  # the smoke row, and only it: the Role is the provider's whole Role
    assert row.name == f"smoke: one-pod job of {ALPINE_REF}", report.to_table()
    assert row.result is Result.MISSING and row.required, row
    assert row.fix.startswith(f"rebuild {ALPINE_REF} with airflow-provider-torchelastic {__version__}"), row.fix
    # containerd could not exec the runner's python: its StartError (exit 128) is the image's fault, not a kill.
    assert "exited with code 128 (StartError)" in row.detail, row.detail
    assert "could not start its command" in row.detail and "killed from outside" not in row.detail, row.detail
    assert "not ready: 1 check the provider needs failed" in report.to_table()
    _nothing_left(cluster)
