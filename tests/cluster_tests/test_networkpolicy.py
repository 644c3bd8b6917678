"""deploy/networkpolicy.yaml against the local cluster's API server: the namespace-wide policy and both per-job
templates (PyTorchJob and TrainJob), filled with a job's name as its header says, are accepted; the unfilled
templates are refused, so they are never applied selecting nothing. Nothing here enforces NetworkPolicies (the
simulated kubelet runs pods as host processes, and the real node's bridge plugin enforces none): what the policies
admit is checked against rendered pods' labels in tests/contract/test_least_privilege.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.cluster.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster

POLICY_FILE = Path(__file__).resolve().parents[2] / "deploy" / "networkpolicy.yaml"


def documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def test_the_policies_are_accepted_and_the_unfilled_templates_refused(kube_cluster: KubeCluster) -> None:
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api:
        net = client.NetworkingV1Api(api)
        filled = documents(POLICY_FILE.read_text().replace("JOB_NAME", "train-abc"))
        names = []
        for policy in filled:
            # A dry run: admitted and validated as a create would be, and nothing left behind.
            created = net.create_namespaced_network_policy(kube_cluster.namespace, policy, dry_run="All")
            names.append(created.metadata.name)
        assert names == ["torchelastic-isolate", "train-abc-peers", "train-abc-trainjob-peers"]
        refused = []
        for policy in documents(POLICY_FILE.read_text())[1:]:
            with pytest.raises(ApiException) as error:
                net.create_namespaced_network_policy(kube_cluster.namespace, policy, dry_run="All")
            refused.append((error.value.status, policy["metadata"]["name"]))
        assert refused == [(422, "JOB_NAME-peers"), (422, "JOB_NAME-trainjob-peers")]
