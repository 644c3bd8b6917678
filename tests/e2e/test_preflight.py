"""The preflight against the local cluster: the full Role, a Role short of one verb, and a kind whose CRD is missing.
``--smoke`` runs on the real node (tests/e2e/test_preflight_on_node.py): the simulated kubelet runs any image as the
runner env, so only a real node tells an image without the runner from the runner image.

The cluster's service account has no rights until a Role is bound; the tests bind deploy/rbac.yaml
(``deploy_rbac``) or a Role built from it, and point ``kubernetes_default`` at that identity.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import fake_kind
from tests.conftest import REPO_ROOT
from tests.e2e import test_kubernetes as k8s
from tests.e2e.test_kubernetes import Cluster, set_connection, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("clean_namespace")]

# test_kubernetes's fixtures: the admin client, the namespace emptied after each test, deploy/rbac.yaml bound.
cluster = k8s.cluster
clean_namespace = k8s.clean_namespace
deploy_rbac = k8s.deploy_rbac


def _rows(report: Any) -> dict[str, Any]:
    return {check.name: check for check in report.checks}


@pytest.fixture
def bind_role(cluster: Cluster, kube_cluster: Any) -> Iterator[Callable[[list[dict[str, Any]]], None]]:
    """Bind deploy/rbac.yaml's Role with other ``rules`` to the service account (its RoleBinding as it is)."""
    from kubernetes.client.exceptions import ApiException

    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / "rbac.yaml").read_text())}
    ns = cluster.namespace

    def bind(rules: list[dict[str, Any]]) -> None:
        role = copy.deepcopy(docs["Role"])
        role["rules"] = rules
        cluster.rbac.create_namespaced_role(ns, role)
        cluster.rbac.create_namespaced_role_binding(ns, docs["RoleBinding"])
        wait_for(
            lambda: k8s._sa_can_get_pods(cluster, kube_cluster.sa_kubeconfig), 10, "the RoleBinding to take effect"
        )

    yield bind
    for delete, kind in (
        (cluster.rbac.delete_namespaced_role_binding, "RoleBinding"),
        (cluster.rbac.delete_namespaced_role, "Role"),
    ):
        with contextlib.suppress(ApiException):
            delete(docs[kind]["metadata"]["name"], ns)


def test_the_full_role_is_everything_the_provider_needs(
    kube_cluster: Any, deploy_rbac: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from airflow_provider_torchelastic.kubernetes.preflight import Result
    from airflow_provider_torchelastic.preflight import main, run_preflight

    set_connection(monkeypatch, kube_cluster.sa_kubeconfig, kube_cluster.namespace)
    report = run_preflight(queue="team-a")
    table = report.to_table()
    assert report.exit_code == 0, table
    rows = _rows(report)
    assert rows["Pod API v1 (pods)"].result is Result.OK
    assert rows["PyTorchJob API kubeflow.org/v1 (pytorchjobs)"].result is Result.OK
    assert rows["RBAC pods/log: get"].result is Result.OK
    assert rows["RBAC kubeflow.org/pytorchjobs: create get list watch patch delete"].result is Result.OK
    # retry_resources' cap, and the admitted-but-suspended check (RBAC is asked even where Kueue is not installed).
    assert rows["RBAC limitranges: list"].result is Result.OK
    assert rows["RBAC kueue.x-k8s.io/workloads: list"].result is Result.OK
    # A namespaced Role cannot grant reading CRDs (cluster-scoped): said, not failed.
    assert rows["PyTorchJob CRD pytorchjobs.kubeflow.org"].detail == "unknown (no permission)"
    # The UI's Role is a subset of the provider's.
    assert all(c.result is Result.OK for c in report.checks if c.name.startswith("UI RBAC")), table
    kueue = rows[f"Kueue LocalQueue {kube_cluster.namespace}/team-a"]
    assert (kueue.result, kueue.required) == (Result.MISSING, False)
    assert kueue.detail.startswith("Kueue not installed")
    assert rows["Kubernetes server version"].detail.startswith("v1.20.2: nothing special")
    capsys.readouterr()  # what Airflow logged while it loaded, above
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["CHECK", "RESULT", "DETAIL", "FIX"]
    assert "ready: everything the provider needs is there" in out


def test_a_role_without_pods_log_fails_that_row_with_its_fix(
    kube_cluster: Any, bind_role: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from airflow_provider_torchelastic.kubernetes.preflight import Result
    from airflow_provider_torchelastic.preflight import main, run_preflight

    rules = yaml.safe_load((REPO_ROOT / "deploy" / "rbac.yaml").read_text().split("\n---")[0])["rules"]
    bind_role([rule for rule in rules if rule["resources"] != ["pods/log"]])
    set_connection(monkeypatch, kube_cluster.sa_kubeconfig, kube_cluster.namespace)
    report = run_preflight()
    assert report.exit_code == 1
    assert [check.name for check in report.failing] == ["RBAC pods/log: get"], report.to_table()
    row = report.failing[0]
    assert (row.result, row.detail) == (Result.MISSING, "denied: get")
    assert 'resources: ["pods/log"], verbs: ["get"]' in row.fix
    assert _rows(report)["UI RBAC pods/log: get"].result is Result.MISSING  # optional: it did not fail the run alone
    assert main(["--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 1
    assert [c["check"] for c in doc["checks"] if c["result"] != "ok" and c["required"]] == ["RBAC pods/log: get"]


def test_a_kind_whose_crd_is_missing_is_not_served(
    kube_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider_torchelastic.kubernetes.preflight import Result
    from airflow_provider_torchelastic.preflight import run_preflight

    # The admin identity: every verb allowed, and the CRDs readable.
    set_connection(monkeypatch, kube_cluster.kubeconfig, kube_cluster.namespace)
    with fake_kind.plugged(tmp_path):
        report = run_preflight()
    rows = _rows(report)
    api = rows["FakeJob API example.dev/v1 (fakejobs)"]
    assert (api.result, api.detail) == (Result.MISSING, "example.dev/v1 not served")
    assert "install the CRD fakejobs.example.dev" in api.fix
    assert report.failing == (api,), report.to_table()
    assert report.exit_code == 1
    assert rows["FakeJob CRD fakejobs.example.dev"].detail == "not installed"
    assert rows["PyTorchJob CRD pytorchjobs.kubeflow.org"].detail == "served versions: v1"
    # No rules are asked for a kind the cluster does not serve: its API row says what to install first.
    assert not any("fakejobs" in name for name in rows if name.startswith("RBAC"))
