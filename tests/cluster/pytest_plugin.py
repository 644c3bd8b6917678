"""pytest plugin for tests that need the local cluster. Load with ``pytest_plugins = ["tests.cluster.pytest_plugin"]``.

Fixtures:
- ``kube_apiserver_binary`` (session): the cached apiserver binary, built on first use.
- ``runner_env_python`` (session): the cached runner env's python (``scripts/build-runner-env.sh``), built on first
  use; each cluster layers this checkout on it, and its pods run with that layer (``KubeCluster.runner_python``).
- ``kube_cluster`` (session): a fresh cluster (etcd, kube-apiserver, CRD, RBAC, simulators) in a temporary dir, torn
  down at the end of the session, which also checks that no process survived.
- ``real_node_cluster`` (session): a cluster of its own on the real node (tests/cluster/real_node.py: kubelet,
  kube-scheduler, kube-controller-manager, containerd) with the runner image built from docker/Dockerfile, and a
  folder the pods mount by hostPath. Every test that uses it runs in one pytest worker (tests/conftest.py), which
  stops it after the last of them (:meth:`RealNodeCluster.stop`), checking that nothing survived on the host.
- ``fault_proxy`` (function): a started :class:`~tests.cluster.proxy.FaultProxy` in front of that cluster.
- ``kubernetes_default_connection`` (function): ``AIRFLOW_CONN_KUBERNETES_DEFAULT`` pointing at the admin kubeconfig
  and the test namespace.

Mark tests that use the cluster with ``@pytest.mark.cluster``. If the apiserver cannot be built or started, the
fixture errors with the reason; set ``TORCHELASTIC_SKIP_CLUSTER=1`` to skip cluster tests instead (without trying).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import control_plane as cp
from tests.cluster import real_node, registry, runner_env
from tests.cluster.proxy import FaultProxy

SKIP_ENV = "TORCHELASTIC_SKIP_CLUSTER"
#: The pytest-xdist group of every test of the real node (tests/conftest.py puts the users of ``real_node_cluster`` in
#: it): one worker owns the node.
REAL_NODE_GROUP = "real-node"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KubeCluster:
    """A running local cluster, as seen by a test."""

    info: cp.ClusterInfo

    @property
    def kubeconfig(self) -> Path:
        """Admin (system:masters) kubeconfig; no context namespace."""
        return self.info.kubeconfig

    @property
    def sa_kubeconfig(self) -> Path:
        """The ``system:serviceaccount:torchelastic-test:airflow-torchelastic`` identity; no permissions until a test
        binds a Role to ServiceAccount ``airflow-torchelastic``. Context namespace: torchelastic-test."""
        return self.info.sa_kubeconfig

    @property
    def state_dir(self) -> Path:
        return self.info.state_dir

    @property
    def runner_python(self) -> Path:
        """The interpreter the simulated kubelet runs containers' Pythons with (the runner image's, as a venv)."""
        return self.state_dir / runner_env.LAYER_DIRNAME / "bin" / "python"

    @property
    def namespace(self) -> str:
        return self.info.namespace

    @property
    def api_url(self) -> str:
        return self.info.api_url

    @property
    def ca_file(self) -> Path:
        return self.info.ca_file

    @property
    def admin_token(self) -> str:
        return self.info.admin_token

    @property
    def sa_token(self) -> str:
        return self.info.sa_token

    @property
    def operator_token(self) -> str:
        return self.info.operator_token

    @property
    def kubelet_token(self) -> str:
        return self.info.kubelet_token

    @property
    def sa_name(self) -> str:
        return cp.SA_NAME

    def start_fault_proxy(self) -> FaultProxy:
        """A started fault proxy in front of this cluster; stop it (or use it as a context manager) when done."""
        return FaultProxy.for_cluster(self.info).start()

    def proxied_kubeconfig(
        self, proxy: FaultProxy, path: Path, *, identity: str = "admin", namespace: str | None = None
    ) -> Path:
        """A kubeconfig for ``identity`` (``admin`` or ``sa``) that goes through ``proxy``."""
        tokens = {"admin": self.admin_token, "sa": self.sa_token}
        if identity not in tokens:
            raise ValueError(f"identity must be one of {sorted(tokens)}, got {identity!r}")
        if identity == "sa" and namespace is None:
            namespace = self.namespace
        return proxy.write_kubeconfig(path, token=tokens[identity], user=f"{identity}-via-proxy", namespace=namespace)


@dataclasses.dataclass(kw_only=True, eq=False)
class RealNodeCluster:
    """The real-node cluster, as a test sees it: the cluster, the node's derived names, the runner image, a folder of
    this machine the DAGs' pods mount by hostPath at the same path, and the apiserver's audit log."""

    info: cp.ClusterInfo
    layout: real_node.NodeLayout
    image: str
    #: The ``STORAGE=1`` variant: s3fs and the other [storage] file systems.
    storage_image: str
    #: A folder of this machine that pods mount by hostPath at the same path: storage they really share.
    shared_dir: Path
    audit_log: Path
    _plane: cp.ControlPlane = dataclasses.field(repr=False)
    _stopped: bool = dataclasses.field(default=False, repr=False)

    @property
    def kubeconfig(self) -> Path:
        return self.info.kubeconfig

    @property
    def namespace(self) -> str:
        return self.info.namespace

    def deleted_by(self, resource: str, name: str) -> list[str]:
        """The users whose deletion of ``resource``/``name`` succeeded, from the audit log."""
        users = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.audit_log.read_text().splitlines():
                event = json.loads(line)
                ref = event.get("objectRef") or {}
                if (
                    event.get("verb") == "delete"
                    and ref.get("resource") == resource
                    and ref.get("name") == name
                    and (event.get("responseStatus") or {}).get("code") == 200
                ):
                    users.append(event["user"]["username"])
        return users

    def stop(self) -> None:
        """Stop the cluster and check that nothing of it is left on the host; a second call does nothing (the
        worker stops it after its last test, the fixture's finalizer at the end of the session)."""
        if self._stopped:
            return
        self._stopped = True
        survivors = _stop_plane(self._plane, self.info.state_dir)
        assert not survivors, f"real-node cluster processes survived teardown: {survivors}"
        assert real_node.leftovers(self.layout) == [], "the real node left something on the host"


def _start_plane(plane: cp.ControlPlane, progress: list[str], what: str) -> cp.ClusterInfo:
    """``plane.start()``, or the test fails with why and the start's progress lines (``progress``, its log)."""
    try:
        return plane.start()
    except cp.ClusterError as e:
        pytest.fail(f"{what} could not start: {e}\n(progress: {'; '.join(progress)})", pytrace=False)


def _stop_plane(plane: cp.ControlPlane, state_dir: Path) -> list[str]:
    """``plane.stop()``; returns the processes that survived it."""
    survivors = plane.stop()
    # The etcd data dir (~60 MB of preallocated WAL) is not worth keeping in pytest's kept tmp dirs; logs are.
    shutil.rmtree(state_dir / "etcd", ignore_errors=True)
    return survivors


def _say(message: str) -> None:
    """Outside pytest's capture: a cold build and the node's start are the slow steps, and say so."""
    print(f"\n[real node] {message}", file=sys.__stderr__, flush=True)


def _real_node_preflight() -> tuple[str, str]:
    """Fail loudly, with the reason, where the node cannot run; returns the runner image's references (plain and
    ``STORAGE=1``)."""
    from tests.cluster import image

    try:
        real_node.check_cgroup_v1()
    except real_node.NodeError as e:
        pytest.fail(f"the real node cannot run here: {e}", pytrace=False)
    folder = real_node.node_binaries_dir()
    missing = [b for b in real_node.NODE_BINARIES if not (folder / b).is_file()]
    if missing:
        script = real_node.NODE_BUILD_SCRIPT.relative_to(cp.REPO_ROOT)
        pytest.fail(
            f"the real node's binaries are not built ({', '.join(missing)} missing in {folder}): run "
            f"`bash {script}` (scripts/test.sh does; 13 to 27 min cold)",
            pytrace=False,
        )
    try:  # about a second when current; after a code change only the package layers rebuild
        image.ensure_images(log=lambda line: _say(line) if line.startswith("[runner-image") else None)
    except image.ImageBuildError as e:
        pytest.fail(f"the runner image could not be built: {e}", pytrace=False)
    return image.runner_image_ref(), image.runner_image_ref(storage=True)


def airflow_connection_json(kubeconfig: Path, namespace: str) -> str:
    """An Airflow ``kubernetes`` connection in the JSON form accepted by ``AIRFLOW_CONN_*`` variables.

    The cncf.kubernetes KubernetesHook reads the extras ``kube_config_path``, ``namespace``, ``cluster_context`` and
    ``in_cluster``.
    """
    return json.dumps(
        {
            "conn_type": "kubernetes",
            "extra": {"kube_config_path": str(kubeconfig), "namespace": namespace},
        }
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster: needs the local kube-apiserver cluster (tests/cluster); ~10 s to start per session"
    )


def _skip_if_disabled() -> None:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: local cluster tests skipped")


@pytest.fixture(scope="session")
def kube_apiserver_binary() -> Path:
    """The cached kube-apiserver binary, built on first use (~5-9 min, once per machine; Debian packages only)."""
    _skip_if_disabled()
    cached = cp.cached_apiserver_path()

    def log(msg: str) -> None:  # the one slow step: say so outside pytest's output capture
        print(f"\n[kube_cluster] {msg}", file=sys.__stderr__, flush=True)

    try:
        return cp.ensure_apiserver_binary(log=log)
    except cp.ClusterError as e:
        pytest.fail(
            f"kube-apiserver is not available at {cached} and could not be built: {e}\n"
            f"Set {SKIP_ENV}=1 to skip cluster tests on a machine without the Debian mirror.",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def runner_env_python() -> Path:
    """The cached runner env's python, built on first use (about a minute, once per machine; local wheels only)."""
    _skip_if_disabled()

    def log(msg: str) -> None:  # only a cold build logs: say so outside pytest's output capture
        print(f"\n[kube_cluster] {msg}", file=sys.__stderr__, flush=True)

    try:
        return runner_env.ensure_base(log=log)
    except runner_env.RunnerEnvError as e:
        pytest.fail(f"the runner env could not be built: {e}", pytrace=False)


@pytest.fixture(scope="session")
def kube_cluster(
    kube_apiserver_binary: Path, runner_env_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KubeCluster]:
    state_dir = tmp_path_factory.mktemp("kube-cluster")
    progress: list[str] = []
    # TORCHELASTIC_NODE=real: a real kubelet, scheduler and controller-manager (real_node.py); default: simulated.
    plane = cp.ControlPlane(state_dir, log=progress.append, node=real_node.node_mode())
    info = _start_plane(plane, progress, "local cluster")
    try:
        yield KubeCluster(info=info)
    finally:
        survivors = _stop_plane(plane, state_dir)
    assert not survivors, f"cluster processes survived teardown: {survivors}"


@pytest.fixture(scope="session")
def real_node_cluster(
    kube_apiserver_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNodeCluster]:
    image_ref, storage_image_ref = _real_node_preflight()
    state_dir = tmp_path_factory.mktemp("real-node")
    shared_dir = tmp_path_factory.mktemp("real-node-shared")
    audit_log = state_dir / "audit.log"
    progress: list[str] = []
    plane = cp.ControlPlane(state_dir, node="real", audit_log=audit_log, log=progress.append)
    started = time.monotonic()
    info = _start_plane(plane, progress, "the real-node cluster")
    _say(f"node up in {time.monotonic() - started:.1f} s")
    layout = real_node.load_layout(state_dir)
    assert layout is not None
    # Pods pull the runner images from the node's registry (tests/cluster/registry.py), pushed there by the start.
    cluster = RealNodeCluster(
        info=info,
        layout=layout,
        image=registry.image_ref(layout, image_ref.rpartition(":")[2]),
        storage_image=registry.image_ref(layout, storage_image_ref.rpartition(":")[2]),
        shared_dir=shared_dir,
        audit_log=audit_log,
        _plane=plane,
    )
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def fault_proxy(kube_cluster: KubeCluster) -> Iterator[FaultProxy]:
    with kube_cluster.start_fault_proxy() as proxy:
        yield proxy


@pytest.fixture
def kubernetes_default_connection(kube_cluster: KubeCluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """Points Airflow's ``kubernetes_default`` connection at the cluster (admin identity, test namespace)."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT", airflow_connection_json(kube_cluster.kubeconfig, kube_cluster.namespace)
    )
    return "kubernetes_default"
