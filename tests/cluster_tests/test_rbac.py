"""RBAC is enforced: the Airflow service-account identity starts with no rights and gets exactly what a Role grants;
the simulators have what they need and are not cluster-admin."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.cluster.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster

T = TypeVar("T")


def api_for(kubeconfig: Path) -> client.ApiClient:
    # One kubeconfig per identity: swapping Configuration.api_key after loading is undone by the refresh hook.
    return config.new_client_from_config(config_file=str(kubeconfig))


def status_of(call: Callable[[], Any]) -> int:
    try:
        call()
    except ApiException as e:
        return int(e.status)
    return 200


def eventually(call: Callable[[], T], timeout: float = 10.0) -> T:
    """RBAC changes reach the authorizer through an informer: allow a moment before they apply."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except ApiException as e:
            if e.status != 403 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture
def admin(kube_cluster: KubeCluster) -> Iterator[client.ApiClient]:
    with api_for(kube_cluster.kubeconfig) as api:
        yield api


def test_airflow_sa_is_forbidden_until_a_role_is_bound(kube_cluster: KubeCluster, admin: client.ApiClient) -> None:
    ns = kube_cluster.namespace
    rbac = client.RbacAuthorizationV1Api(admin)
    name = f"airflow-torchelastic-{uuid.uuid4().hex[:6]}"
    with api_for(kube_cluster.sa_kubeconfig) as sa_api:
        sa_core = client.CoreV1Api(sa_api)
        sa_custom = client.CustomObjectsApi(sa_api)
        # Authenticated, but no permissions: 403 (not 401).
        assert status_of(lambda: sa_core.list_namespaced_pod(ns)) == 403
        assert (
            status_of(lambda: sa_custom.list_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs")) == 403
        )
        try:
            sa_core.list_namespaced_pod(ns)
        except ApiException as e:
            assert e.reason == "Forbidden"

        rbac.create_namespaced_role(
            ns,
            {
                "metadata": {"name": name},
                "rules": [
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                    {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["get", "list", "watch"]},
                ],
            },
        )
        rbac.create_namespaced_role_binding(
            ns,
            {
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                # A ServiceAccount subject matches the token user system:serviceaccount:<ns>:airflow-torchelastic.
                "subjects": [{"kind": "ServiceAccount", "name": kube_cluster.sa_name, "namespace": ns}],
            },
        )
        try:
            eventually(lambda: sa_core.list_namespaced_pod(ns))
            eventually(lambda: sa_custom.list_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs"))
            # Only what the Role says: other verbs, subresources, namespaces stay forbidden.
            assert status_of(lambda: sa_core.delete_collection_namespaced_pod(ns)) == 403
            assert status_of(lambda: sa_core.list_namespaced_pod("default")) == 403
            assert status_of(lambda: sa_core.list_namespaced_config_map(ns)) == 403
        finally:
            rbac.delete_namespaced_role_binding(name, ns)
            rbac.delete_namespaced_role(name, ns)


def test_simulator_identities_have_what_they_need_but_are_not_admin(kube_cluster: KubeCluster) -> None:
    ns = kube_cluster.namespace
    with api_for(kube_cluster.info.operator_kubeconfig) as op_api:
        op_core, op_custom = client.CoreV1Api(op_api), client.CustomObjectsApi(op_api)
        assert status_of(lambda: op_custom.list_cluster_custom_object("kubeflow.org", "v1", "pytorchjobs")) == 200
        assert status_of(lambda: op_core.list_pod_for_all_namespaces()) == 200
        assert status_of(lambda: op_core.list_service_for_all_namespaces()) == 200
        assert status_of(lambda: op_core.list_namespaced_secret(ns)) == 200  # it garbage-collects owned Secrets
        assert status_of(lambda: op_core.list_node()) == 403
        assert status_of(lambda: client.RbacAuthorizationV1Api(op_api).list_cluster_role()) == 403
    with api_for(kube_cluster.info.kubelet_kubeconfig) as kl_api:
        kl_core = client.CoreV1Api(kl_api)
        assert status_of(lambda: kl_core.list_node()) == 200
        assert status_of(lambda: kl_core.list_pod_for_all_namespaces()) == 200
        assert status_of(lambda: kl_core.list_namespaced_config_map(ns)) == 200
        assert status_of(lambda: kl_core.create_namespaced_pod(ns, {"metadata": {"name": "x"}, "spec": {}})) == 403
        assert status_of(lambda: client.RbacAuthorizationV1Api(kl_api).list_cluster_role()) == 403
