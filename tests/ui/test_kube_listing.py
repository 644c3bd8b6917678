"""What the plugin costs the API server, on the local cluster: one list per job kind and one pod list per namespace,
shared by every page view for LIST_TTL seconds; a job's pods found from the one pod list."""

from __future__ import annotations

import pytest

from airflow_provider_torchelastic.plugin import sources
from airflow_provider_torchelastic.plugin.sources import KubeJobs

pytestmark = pytest.mark.cluster


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_page_views_share_one_list_per_kind_and_namespace(kube_cluster, kubernetes_default_connection: str) -> None:
    clock = FakeClock()
    kube = KubeJobs(kubernetes_default_connection, clock=clock)
    namespace = kube_cluster.namespace
    kinds = len(sources._kinds())  # Pod and PyTorchJob: the pod list serves both
    for _ in range(5):  # five page views within the TTL
        kube.jobs(namespace)
    assert kube.calls == kinds
    clock.now += sources.LIST_TTL
    kube.jobs(namespace)
    assert kube.calls == 2 * kinds
    # A log read of a pod that does not exist costs one call, and says nothing rather than failing the page.
    assert kube.log_tail(namespace, "no-such-pod") == ""
    assert kube.log_tail(namespace, "no-such-pod") == ""
    assert kube.calls == 2 * kinds + 1


def test_the_documented_read_only_role_is_enough_for_the_pages(kube_cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/rbac-ui.yaml, bound to the cluster's Airflow identity (which has no rights of its own), lets the plugin
    list jobs and pods and read a log; nothing more is needed, and without it the page says why."""
    import time
    import uuid
    from pathlib import Path

    import yaml
    from kubernetes import client, config

    from airflow_provider_torchelastic.errors import KubeError
    from tests.cluster.pytest_plugin import airflow_connection_json

    namespace = kube_cluster.namespace
    conn_id = f"ui_ro_{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{conn_id.upper()}", airflow_connection_json(kube_cluster.sa_kubeconfig, namespace)
    )
    role, binding = yaml.safe_load_all(Path("deploy/rbac-ui.yaml").read_text())
    name = f"{role['metadata']['name']}-{uuid.uuid4().hex[:6]}"
    role["metadata"]["name"] = binding["metadata"]["name"] = binding["roleRef"]["name"] = name
    binding["subjects"] = [{"kind": "ServiceAccount", "name": kube_cluster.sa_name, "namespace": namespace}]

    def kinds_listed() -> int:
        kube = KubeJobs(conn_id)
        kube.jobs(namespace)
        return kube.calls

    with pytest.raises(KubeError) as refused:
        kinds_listed()
    assert refused.value.status == 403
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_namespaced_role(namespace, role)
        rbac.create_namespaced_role_binding(namespace, binding)
        try:
            deadline = time.monotonic() + 10  # RBAC reaches the authorizer through an informer
            while True:
                try:
                    assert kinds_listed() == len(sources._kinds())
                    break
                except KubeError as e:
                    if e.status != 403 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            # pods/log is granted: a pod that does not exist is a 404, not a 403.
            with pytest.raises(KubeError) as missing:
                KubeJobs(conn_id).read_log_tail(namespace, "no-such-pod")
            assert missing.value.status == 404
            # A TrainJob, with the pods its JobSet and Jobs lead to: the role lists those too.
            _a_trainjob_lists_with_its_pods(admin, conn_id, namespace)
        finally:
            rbac.delete_namespaced_role_binding(name, namespace)
            rbac.delete_namespaced_role(name, namespace)


def _a_trainjob_lists_with_its_pods(admin: object, conn_id: str, namespace: str) -> None:
    """A TrainJob as the provider renders it, run by the cluster's simulated Trainer: the page lists it with its two
    nodes' pods, found through its JobSet and Jobs (their lists are the role's too)."""
    import time

    from kubernetes import client

    from airflow_provider_torchelastic import Elastic
    from airflow_provider_torchelastic.core.naming import RunIdentity
    from airflow_provider_torchelastic.kubernetes import kinds
    from airflow_provider_torchelastic.kubernetes.render import render_manifests

    identity = RunIdentity(dag_id="ui_trainjob", task_id="train", run_id="manual__ui")
    secret, trainjob = render_manifests(
        Elastic(nnodes=2),
        identity=identity,
        namespace=namespace,
        image="local/torchelastic-runner:test",
        payload=b"not a payload",
        renderer=kinds.TRAINJOB.render,
    )
    core, custom = client.CoreV1Api(admin), client.CustomObjectsApi(admin)
    group, version, plural = kinds.TRAINJOB.group, kinds.TRAINJOB.version, kinds.TRAINJOB.plural
    name = trainjob["metadata"]["name"]
    core.create_namespaced_secret(namespace, secret)
    custom.create_namespaced_custom_object(group, version, namespace, plural, trainjob)
    try:
        deadline = time.monotonic() + 60
        while True:
            listed = [job for job in KubeJobs(conn_id).jobs(namespace) if job.name == name]
            if listed and len(listed[0].pods) == 2:
                break
            assert time.monotonic() < deadline, f"TrainJob {name} listed with its 2 pods: {listed}"
            time.sleep(1)
        (job,) = listed
        assert job.kind == "TrainJob" and job.identity is not None and job.identity.dag_id == "ui_trainjob"
        assert sorted(p["metadata"]["name"].rsplit("-", 1)[0] for p in job.pods) == [
            f"{name}-node-0-0",
            f"{name}-node-0-1",
        ]
    finally:
        body = {"propagationPolicy": "Background"}
        custom.delete_namespaced_custom_object(group, version, namespace, plural, name, body=body)
        core.delete_namespaced_secret(secret["metadata"]["name"], namespace)
