"""A refused submission, from the real API server: an admission webhook's 403 is told apart from RBAC's 403.

The local cluster registers the simulated training operator's validating webhook (a real
ValidatingWebhookConfiguration, served over TLS), so the API server itself turns the webhook's denial into the
Status the client sees, as on a real cluster. The provider tells the two apart by that Status, never by its text.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytestmark = pytest.mark.cluster


def _job(name: str, namespace: str, *, masters: int) -> dict[str, Any]:
    container = {"name": "pytorch", "image": "local/torchelastic-runner:test", "command": ["python", "-c", "pass"]}
    template = {"spec": {"containers": [container]}}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "pytorchReplicaSpecs": {
                # The webhook wants Master.replicas to be exactly 1 (pytorchjob_webhook.go); the schema allows 2.
                "Master": {"replicas": masters, "restartPolicy": "Never", "template": template},
                "Worker": {"replicas": 1, "restartPolicy": "Never", "template": copy.deepcopy(template)},
            }
        },
    }


def test_a_webhook_denial_is_an_admission_refusal_and_rbac_is_a_permission_refusal(kube_cluster: Any) -> None:
    from kubernetes import config

    from airflow_provider_torchelastic.errors import KubeError
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef
    from airflow_provider_torchelastic.operators.backends.kubernetes import _submit_error

    namespace = kube_cluster.namespace
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as admin:
        with pytest.raises(KubeError) as denied:
            SyncKube(admin).create(_job("refused-by-webhook", namespace, masters=2))
        assert SyncKube(admin).get("PyTorchJob", "refused-by-webhook", namespace) is None, "refused: never created"
    nobody = config.new_client_from_config(config_file=str(kube_cluster.sa_kubeconfig))
    with nobody, pytest.raises(KubeError) as forbidden:
        SyncKube(nobody).create(_job("refused-by-rbac", namespace, masters=1))

    assert (denied.value.status, denied.value.reason) == (403, "Forbidden"), denied.value
    assert (forbidden.value.status, forbidden.value.reason) == (403, "Forbidden"), forbidden.value
    assert denied.value.denied_by_admission and not forbidden.value.denied_by_admission
    ref = JobRef(kind="PyTorchJob", name="x", namespace=namespace)
    webhook_error, rbac_error = str(_submit_error(ref, denied.value)), str(_submit_error(ref, forbidden.value))
    assert "admission webhook refused the object" in webhook_error and "permission" not in webhook_error
    assert "lacks permission" in rbac_error and "admission" not in rbac_error


def test_a_trainjob_naming_a_missing_runtime_is_refused_at_submit_with_the_hint(kube_cluster: Any) -> None:
    """As on a Trainer v2.3.0 cluster: its webhook reads the runtime the TrainJob names, and one the cluster lacks is
    a 403 at submit (``...must be created before the TrainJob is created``), not a TrainJob that never gets pods."""
    from kubernetes import config

    from airflow_provider_torchelastic import Elastic
    from airflow_provider_torchelastic.errors import KubeError
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.kubernetes.kinds import trainjob
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef
    from airflow_provider_torchelastic.operators.backends.kubernetes import _submit_error
    from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
    from tests.contract.test_trainjob_render import render

    namespace = kube_cluster.namespace
    job = render(Elastic(nnodes=2), runtime=trainjob.Runtime(name="no-such-runtime"))[1]
    job["metadata"]["namespace"] = namespace
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as admin:
        with pytest.raises(KubeError) as denied:
            SyncKube(admin).create(job)
        assert SyncKube(admin).get("TrainJob", job["metadata"]["name"], namespace) is None, "refused: never created"
    assert (denied.value.status, denied.value.reason) == (403, "Forbidden") and denied.value.denied_by_admission
    error = _submit_error(JobRef(kind="TrainJob", name=job["metadata"]["name"], namespace=namespace), denied.value)
    assert isinstance(error, ConfigurationError)
    message = str(error)
    assert 'clustertrainingruntimes.trainer.kubeflow.org "no-such-runtime" not found: specified ' in message
    assert "clusterTrainingRuntime must be created before the TrainJob is created" in message
    assert "kubectl get clustertrainingruntimes" in message and "(a retry will not help)" in message


def test_a_pytorchjob_whose_pods_the_api_server_would_refuse_is_refused_at_submit(kube_cluster: Any) -> None:
    """The API server checks a PyTorchJob against its CRD's schema only: a pod template it refuses as a Pod (here a
    sidecar that runs as user -1, which the provider does not check when the DAG is parsed) is created, and its pods
    never are; the task would wait without pods. Each template is created first as a dry-run Pod, and that refusal
    fails the try before anything is created."""
    from kubernetes import config

    from airflow_provider_torchelastic import Elastic, PodOptions
    from airflow_provider_torchelastic.kubernetes import submit
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.kubernetes.render import check_renderable
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef

    namespace = kube_cluster.namespace
    sidecar = {"name": "metrics", "image": "registry.example.com/ml/metrics:1.0", "securityContext": {"runAsUser": -1}}
    options = PodOptions(pod_template={"spec": {"containers": [sidecar]}})
    secret, job = check_renderable(Elastic(nnodes=2), image="registry.example.com/ml/train:1.0", pod_options=options)
    for manifest in (secret, job):
        manifest["metadata"]["namespace"] = namespace
    ref = JobRef(kind="PyTorchJob", name=job["metadata"]["name"], namespace=namespace)
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as admin:
        kube = SyncKube(admin)
        # Without the check: the API server takes the job as it is.
        kube.create(job, dry_run=True)
        answer = submit.create_or_reattach(
            kube, ref, secret, job, token=submit.new_token(), remembered=None, remember=None, info=print, warning=print
        )
        assert isinstance(answer, submit.Refusal) and not answer.recoverable, answer
        assert (
            f"Cannot create PyTorchJob {namespace}/{ref.name}: the API server refuses its Worker pods" in answer.message
        )
        assert "runAsUser: Invalid value: -1: must be between 0 and 2147483647" in answer.message
        assert "the Kubeflow training operator could never create them" in answer.message
        assert (
            kube.get("PyTorchJob", ref.name, namespace) is None
            and kube.get("Secret", secret["metadata"]["name"], namespace) is None
        )


def test_pods_the_api_server_refuses_at_admission_fail_the_wait_or_are_waited_for_as_a_quota(kube_cluster: Any) -> None:
    """The training operator's pod creates are refused at admission (a LimitRange, a ResourceQuota), which the job
    shows only as FailedCreatePod Warnings: the wait reads them once the job has had no pods for
    pending_grace_seconds. In a namespace of its own: its LimitRange and ResourceQuota must touch no other test."""
    import dataclasses
    import time
    import uuid

    from kubernetes import client, config

    from airflow_provider_torchelastic import Elastic, PodOptions
    from airflow_provider_torchelastic.core import causes
    from airflow_provider_torchelastic.kubernetes.client import SyncKube
    from airflow_provider_torchelastic.kubernetes.render import check_renderable
    from airflow_provider_torchelastic.kubernetes.wait import drive_sync, wait_for_job
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, WaitPolicy

    namespace = f"refusals-{uuid.uuid4().hex[:8]}"
    image = "registry.example.com/ml/train:1.0"
    with config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as admin:
        core, kube = client.CoreV1Api(admin), SyncKube(admin)
        core.create_namespace({"metadata": {"name": namespace}})
        try:

            def wait(options: PodOptions, policy: WaitPolicy) -> tuple[Any, list[str]]:
                # A deadline, so that a wait that does not see the refusal fails here instead of hanging.
                policy = dataclasses.replace(policy, deadline=time.time() + 60)
                job = check_renderable(Elastic(nnodes=2), image=image, pod_options=options, namespace=namespace)[-1]
                kube.create(job)
                ref = JobRef(kind="PyTorchJob", name=job["metadata"]["name"], namespace=namespace)
                lines: list[str] = []
                try:
                    return drive_sync(wait_for_job(ref, policy), kube, lines.append), lines
                finally:
                    kube.delete("PyTorchJob", ref.name, namespace)

            limit = {"type": "Container", "max": {"cpu": "1"}}
            core.create_namespaced_limit_range(namespace, {"metadata": {"name": "max"}, "spec": {"limits": [limit]}})
            decision, _ = wait(PodOptions(limits={"cpu": "2"}), WaitPolicy(poll_interval=1, pending_grace_seconds=2))
            assert decision.verdict is not None and decision.verdict.cause == causes.CONFIGURATION, decision
            assert "the Kubeflow training operator cannot create its pods: Error creating: " in decision.verdict.detail
            assert "maximum cpu usage per Container is 1, but limit is 2" in decision.verdict.detail
            core.delete_namespaced_limit_range("max", namespace)

            # No quota controller runs beside the simulated kubelet: the quota's usage is written as it would.
            quota = {"metadata": {"name": "compute"}, "spec": {"hard": {"pods": "0"}}}
            core.create_namespaced_resource_quota(namespace, quota)
            status = {**quota, "status": {"hard": {"pods": "0"}, "used": {"pods": "0"}}}
            core.replace_namespaced_resource_quota_status("compute", namespace, status)
            policy = WaitPolicy(poll_interval=1, pending_grace_seconds=2, scheduling_timeout=6)
            decision, lines = wait(PodOptions(), policy)
            assert decision.verdict is not None and decision.verdict.cause == causes.UNSCHEDULABLE, decision
            assert decision.verdict.recoverable and "exceeded quota: compute" in decision.verdict.detail
            assert any(
                "waiting for capacity: the Kubeflow training operator cannot create its pods" in line for line in lines
            ), lines
        finally:
            core.delete_namespace(namespace)
