"""Least-privileged pods (issue 20, item 6): no service account token unless asked for, and the NetworkPolicy example
of ``deploy/networkpolicy.yaml`` checked against the Kubernetes schema and against the labels rendered pods carry."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from airflow_provider_torchelastic.core.config import Elastic, Master, PyTorch, TaskConfig, Worker
from airflow_provider_torchelastic.core.naming import LABEL_MANAGED_BY, MANAGED_BY
from airflow_provider_torchelastic.core.pod_options import PodOptions
from airflow_provider_torchelastic.kubernetes.kinds.pytorchjob import POD_LABEL
from airflow_provider_torchelastic.kubernetes.kinds.trainjob import JOBSET_NAME_LABEL, TOKEN_MOUNT_PATH
from airflow_provider_torchelastic.kubernetes.pod_template import DEFAULT_PORT
from airflow_provider_torchelastic.kubernetes.render import check_renderable
from tests.cluster.sim_operator import render_pod
from tests.contract.builders import pod_specs, render, trainjob_pods_of, workload
from tests.contract.schemas import KUBERNETES_VERSIONS, REPO_ROOT, validate_rendered

TOKEN = "automountServiceAccountToken"
CONFIGS: dict[str, TaskConfig] = {
    "single_pod": Elastic(nproc_per_node=2),
    "elastic": Elastic(nnodes="2:4"),
    "master_worker": PyTorch(master=Master(), worker=Worker(replicas=2)),
}


def automount(config: TaskConfig, options: PodOptions | None = None) -> dict[str, object]:
    """Replica type (or "Pod") -> the pod's ``automountServiceAccountToken``, ``"unset"`` where it has none."""
    manifests = render(config, pod_options=options)
    validate_rendered(manifests)
    return {key: spec.get(TOKEN, "unset") for key, spec in pod_specs(workload(manifests)).items()}


# ------------------------------------------------------------------------------------------- service account token


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_no_token_by_default(case: str) -> None:
    assert set(automount(CONFIGS[case]).values()) == {False}


@pytest.mark.parametrize(
    "options",
    [
        PodOptions(service_account_name="trainer"),
        PodOptions(pod_template={"spec": {"serviceAccountName": "trainer"}}),
        # the deprecated spelling, which the API server still copies into serviceAccountName
        PodOptions(pod_template={"spec": {"serviceAccount": "trainer"}}),
    ],
    ids=["option", "template", "deprecated-field"],
)
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_named_service_account_decides_itself(case: str, options: PodOptions) -> None:
    # Left unset: the ServiceAccount's own automountServiceAccountToken (true when it has none) applies.
    assert set(automount(CONFIGS[case], options).values()) == {"unset"}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (PodOptions(automount_service_account_token=True), True),
        (PodOptions(automount_service_account_token=True, service_account_name="trainer"), True),
        (PodOptions(automount_service_account_token=False, service_account_name="trainer"), False),
        (PodOptions(pod_template={"spec": {TOKEN: True}}), True),
        (PodOptions(pod_template={"spec": {TOKEN: False, "serviceAccountName": "trainer"}}), False),
        (PodOptions(automount_service_account_token=True, pod_template={"spec": {TOKEN: True}}), True),
    ],
    ids=["opt-in", "opt-in-with-account", "opt-out-with-account", "template", "template-opt-out", "both-agree"],
)
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_an_explicit_choice_is_kept(case: str, options: PodOptions, expected: bool) -> None:
    assert set(automount(CONFIGS[case], options).values()) == {expected}


def test_a_replica_opts_in_alone() -> None:
    config = PyTorch(master=Master(), worker=Worker(replicas=2, pod=PodOptions(automount_service_account_token=True)))
    assert automount(config) == {"Master": False, "Worker": True}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            PodOptions(automount_service_account_token=True, pod_template={"spec": {TOKEN: False}}),
            r"spec\.automountServiceAccountToken: the pod_template sets False but "
            r"PodOptions\.automount_service_account_token sets True",
        ),
        (PodOptions(pod_template={"spec": {TOKEN: "false"}}), r"automountServiceAccountToken: expected true or false"),
    ],
    ids=["conflict", "not-a-bool"],
)
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_wrong_token_setting_fails_when_the_dag_is_parsed(case: str, options: PodOptions, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_renderable(CONFIGS[case], image="registry.example.com/ml/train:1.0", pod_options=options)


# --------------------------------------------------------------------------------------------------- NetworkPolicy

POLICY_FILE = REPO_ROOT / "deploy" / "networkpolicy.yaml"
PLACEHOLDER = "JOB_NAME"
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")


def policies(job_name: str | None = None) -> dict[str, dict[str, Any]]:
    """The file's policies by name, the placeholder replaced by ``job_name`` as its header says (sed)."""
    text = POLICY_FILE.read_text()
    if job_name is not None:
        text = text.replace(PLACEHOLDER, job_name)
    docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    return {doc["metadata"]["name"]: doc for doc in docs}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector as the API server evaluates it (matchLabels and matchExpressions, ANDed)."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True


def admitted(policy: dict[str, Any], source: dict[str, str]) -> bool:
    """Whether ``policy`` admits ingress from a pod of the same namespace with the labels ``source``."""
    return any(
        any(selects(peer["podSelector"], source) for peer in rule.get("from") or [] if set(peer) == {"podSelector"})
        for rule in policy["spec"].get("ingress") or []
    )


def pods_of(config: TaskConfig, **identity: Any) -> tuple[str, list[dict[str, str]]]:
    """The job's name and the labels of every pod it gets: the Pod as rendered, or, for a PyTorchJob, the pods the
    training operator creates from its templates (the simulated operator, which adds its labels as v1.9 does)."""
    job = workload(render(config, **identity))
    if job["kind"] == "Pod":
        return job["metadata"]["name"], [job["metadata"]["labels"]]
    job["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    pods = [
        render_pod(job, replica_type, index)
        for replica_type, replica in job["spec"]["pytorchReplicaSpecs"].items()
        for index in range(replica["replicas"])
    ]
    return job["metadata"]["name"], [pod["metadata"]["labels"] for pod in pods]


def token_mounts(pod: dict[str, Any]) -> list[tuple[str, str]]:
    """(container, volume) of every mount at the service account token's path."""
    return [
        (container["name"], mount["name"])
        for key in ("initContainers", "containers")
        for container in pod["spec"].get(key) or []
        for mount in container.get("volumeMounts") or []
        if mount["mountPath"] == TOKEN_MOUNT_PATH
    ]


def test_a_trainjobs_pods_mask_the_token() -> None:
    # A runtime patch has no automountServiceAccountToken: every container of the node pods mounts an empty folder
    # at the token's path, where ServiceAccount admission then mounts no token (the real API server's behaviour is
    # checked on the real node: tests/e2e/test_real_node_e2e.py).
    _, pods = trainjob_pods_of(Elastic(nnodes=2))
    assert len(pods) == 2
    for pod in pods:
        mounts = token_mounts(pod)
        assert mounts and {volume for _, volume in mounts} == {"torchelastic-no-token"}
        containers = {c["name"] for key in ("initContainers", "containers") for c in pod["spec"].get(key) or []}
        assert {container for container, _ in mounts} == containers
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "torchelastic-no-token"]
        assert set(volume) == {"name", "emptyDir"}  # nothing in it


def test_a_trainjob_with_a_named_service_account_keeps_its_token_setting() -> None:
    _, pods = trainjob_pods_of(Elastic(nnodes=2), pod_options=PodOptions(service_account_name="trainer"))
    assert all(token_mounts(pod) == [] and pod["spec"]["serviceAccountName"] == "trainer" for pod in pods)


def test_the_policies_meet_the_kubernetes_schema() -> None:
    job_name, _ = pods_of(Elastic(nnodes=2))
    filled = policies(job_name)
    assert set(filled) == {"torchelastic-isolate", f"{job_name}-peers", f"{job_name}-trainjob-peers"}
    for policy in filled.values():
        assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
        assert _DNS_1123_SUBDOMAIN.match(policy["metadata"]["name"])
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(policy, version, strict=True)
    # Unfilled, the template's name is refused by the API server, so it is never applied selecting nothing.
    assert not _DNS_1123_SUBDOMAIN.match(f"{PLACEHOLDER}-peers")


def test_the_selectors_name_the_labels_the_pods_carry() -> None:
    assert (LABEL_MANAGED_BY, MANAGED_BY, POD_LABEL) == (
        "app.kubernetes.io/managed-by",
        "airflow-provider-torchelastic",
        "training.kubeflow.org/job-name",
    )
    assert f"port {DEFAULT_PORT}" in POLICY_FILE.read_text()
    job_name, job_pods = pods_of(Elastic(nnodes=2))
    _, single = pods_of(Elastic())
    _, trainjob_pods = trainjob_pods_of(Elastic(nnodes=2))
    assert len(job_pods) == 2 and all(pod[POD_LABEL] == job_name for pod in job_pods)
    keys = set().union(*job_pods, *single, *(pod["metadata"]["labels"] for pod in trainjob_pods))
    for policy in policies(job_name).values():
        spec = policy["spec"]
        named = [spec["podSelector"]] + [p["podSelector"] for rule in spec["ingress"] for p in rule["from"]]
        for selector in named:
            assert set(selector.get("matchLabels") or {}) <= keys
            assert {e["key"] for e in selector.get("matchExpressions") or []} <= keys


def test_a_single_pod_admits_nothing() -> None:
    job_name, job_pods = pods_of(Elastic(nnodes=2))
    _, [single] = pods_of(Elastic())
    isolate = policies(job_name)["torchelastic-isolate"]
    assert selects(isolate["spec"]["podSelector"], single)
    assert isolate["spec"]["policyTypes"] == ["Ingress"] and not isolate["spec"]["ingress"]
    # It leaves PyTorchJob pods to their job's policy, so applying it alone cannot break a rendezvous.
    assert not any(selects(isolate["spec"]["podSelector"], pod) for pod in job_pods)
    peers = policies(job_name)[f"{job_name}-peers"]
    assert not selects(peers["spec"]["podSelector"], single) and not admitted(peers, single)


@pytest.mark.parametrize(
    "config", [Elastic(nnodes="2:4"), PyTorch(master=Master(), worker=Worker(replicas=2))], ids=["elastic", "mw"]
)
def test_a_jobs_pods_admit_only_each_other(config: TaskConfig) -> None:
    job_name, job_pods = pods_of(config)
    _, other_try = pods_of(config, try_number=2)
    _, other_run = pods_of(config, run_id="manual__2026-01-02")
    _, [single] = pods_of(Elastic())
    peers = policies(job_name)[f"{job_name}-peers"]
    assert peers["spec"]["policyTypes"] == ["Ingress"]
    # Every pod of the job is selected and admits every other; no port list: gloo and NCCL pick ports at random.
    assert all(selects(peers["spec"]["podSelector"], pod) for pod in job_pods)
    assert all(admitted(peers, pod) for pod in job_pods)
    assert all("ports" not in rule for rule in peers["spec"]["ingress"])
    for stranger in [*other_try, *other_run, single, {"app": "anything"}]:
        assert not admitted(peers, stranger) and not selects(peers["spec"]["podSelector"], stranger)


def test_without_the_exemption_every_provider_pod_is_isolated() -> None:
    """The header's stricter setup: once every PyTorchJob gets its policy, the isolating policy covers them too."""
    job_name, job_pods = pods_of(Elastic(nnodes=2))
    _, single = pods_of(Elastic())
    selector = policies(job_name)["torchelastic-isolate"]["spec"]["podSelector"]
    strict = {"matchExpressions": [e for e in selector["matchExpressions"] if e["operator"] != "DoesNotExist"]}
    assert strict["matchExpressions"] and all(selects(strict, pod) for pod in [*job_pods, *single])
    assert not selects(strict, {"app": "anything"})


def test_a_trainjobs_pods_admit_only_each_other_and_are_left_alone_by_the_isolating_policy() -> None:
    config = Elastic(nnodes=2)
    job_name, pods = trainjob_pods_of(config)
    job_pods = [pod["metadata"]["labels"] for pod in pods]
    _, other_try = trainjob_pods_of(config, try_number=2)
    _, [single] = pods_of(Elastic())
    assert all(pod[JOBSET_NAME_LABEL] == job_name for pod in job_pods)
    filled = policies(job_name)
    # Isolated without their job's policy, node 0's rendezvous would be cut off from the other nodes.
    assert not any(selects(filled["torchelastic-isolate"]["spec"]["podSelector"], pod) for pod in job_pods)
    peers = filled[f"{job_name}-trainjob-peers"]
    assert all(selects(peers["spec"]["podSelector"], pod) and admitted(peers, pod) for pod in job_pods)
    for stranger in [*(pod["metadata"]["labels"] for pod in other_try), single, {"app": "anything"}]:
        assert not admitted(peers, stranger) and not selects(peers["spec"]["podSelector"], stranger)
    # The PyTorchJob's template, applied by the same sed, selects none of them.
    assert not any(selects(filled[f"{job_name}-peers"]["spec"]["podSelector"], pod) for pod in job_pods)
