"""Fixtures of the e2e modules whose DAGs run on the real node (``real_node_cluster``, tests/cluster/pytest_plugin.py:
a kubelet, kube-scheduler and kube-controller-manager with containerd, pods running the runner image built from
docker/Dockerfile). Bind them in a module (``cluster = real_node_support.cluster``: pytest finds fixtures by module
attribute, and a name bound so, unlike an import, may be a test's argument too); tests/conftest.py runs every such
test in the one pytest worker that owns the node.

- ``cluster`` (module): :class:`~tests.e2e.test_kubernetes.Cluster` on the node's cluster;
- ``clean_namespace``: empties the test namespace after a test;
- ``failure_dir``: where the DAGs' failure callbacks write each failed try's exception;
- ``node_dag_env``: what the DAG files and the tasks read: the connection, the image, the shared folder
  (:data:`~tests.dag_support.SHARED_DIR_ENV`), the failure dir; ``real_node_env`` is the same, autouse, for a
  module whose every test runs on the node;
- ``real_node_image``: the image the pods run; a module whose pods need s3fs binds :func:`storage_image` as
  ``real_node_image`` instead;
- ``s3`` (session): the S3-compatible test server (tests/s3_server.py's, whose ``s3`` it replaces in the modules that
  import this one) listening on the node's address, its bridge's gateway: the one address of this machine that both
  the pods and the Airflow side reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.pytest_plugin import RealNodeCluster, airflow_connection_json
from tests.dag_support import IMAGE_ENV, OUT_DIR_ENV, SHARED_DIR_ENV
from tests.e2e.test_kubernetes import Cluster
from tests.s3_server import S3Server, serve_s3


def node_env(node: RealNodeCluster, out_dir: Path, image: str) -> dict[str, str]:
    """What the DAG file and the tasks read: the connection, the image, the shared folder, the failure files."""
    return {
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": airflow_connection_json(node.kubeconfig, node.namespace),
        # What the folder's DAGs without an image of their own take (tests/e2e/conftest.py sets it per test).
        "AIRFLOW__TORCH_ELASTIC__IMAGE": image,
        IMAGE_ENV: image,
        SHARED_DIR_ENV: str(node.shared_dir),
        OUT_DIR_ENV: str(out_dir),
    }


@pytest.fixture(scope="module")
def cluster(real_node_cluster: RealNodeCluster) -> Cluster:
    return Cluster(real_node_cluster.kubeconfig, real_node_cluster.namespace)


@pytest.fixture
def clean_namespace(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.delete_everything()


@pytest.fixture
def failure_dir(tmp_path: Path) -> Path:
    out = tmp_path / "failures"
    out.mkdir()
    return out


@pytest.fixture
def real_node_image(real_node_cluster: RealNodeCluster) -> str:
    return real_node_cluster.image


@pytest.fixture
def storage_image(real_node_cluster: RealNodeCluster) -> str:
    """The ``STORAGE=1`` runner image (s3fs and the other [storage] file systems)."""
    return real_node_cluster.storage_image


@pytest.fixture
def node_dag_env(
    real_node_cluster: RealNodeCluster, real_node_image: str, failure_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in node_env(real_node_cluster, failure_dir, real_node_image).items():
        monkeypatch.setenv(name, value)


@pytest.fixture(autouse=True)
def real_node_env(node_dag_env: None) -> None:
    """``node_dag_env`` for every test of the module that binds it."""


@pytest.fixture(scope="session")
def s3(real_node_cluster: RealNodeCluster) -> Iterator[S3Server]:
    with serve_s3(real_node_cluster.layout.gateway) as server:
        yield server
