"""The simulated PyTorchJob admission webhook: its rules and messages, its AdmissionReview answers, its TLS server,
and what the real kube-apiserver 1.20 then answers the client.

Upstream: kubeflow/trainer v1.9.4 (``pkg/webhooks/pytorch/pytorchjob_webhook.go``, ``manifests/base/webhook/``) and
controller-runtime v0.24.1 (``pkg/webhook/admission/``), the version that release builds with.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster import sim_operator as so
from tests.cluster import sim_trainer_webhook as twh
from tests.cluster import sim_webhook as sw
from tests.cluster_tests import test_sim_operator as base
from tests.cluster_tests.test_sim_operator import Cluster, job, replica, unique

api = base.api  # the fixtures of the operator's own tests
cluster = base.cluster

DENIED_BY = 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied the request: '


def admission_review(obj: dict[str, Any], operation: str = "CREATE", old: dict[str, Any] | None = None) -> Any:
    request: dict[str, Any] = {"uid": "req-1", "operation": operation, "object": obj}
    if old is not None:
        request["oldObject"] = old
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def valid_job(name: str = "train") -> dict[str, Any]:
    return job(name, master=replica(), worker=replica(replicas=2))


# ----------------------------------------------------------------------------------------------------------------
# Pure: the rules and their messages
# ----------------------------------------------------------------------------------------------------------------


def containers(j: dict[str, Any], rtype: str) -> list[dict[str, Any]]:
    return list(j["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["containers"])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        # pytorchjob_webhook.go:79-81 (apimachinery's IsDNS1035Label messages)
        (
            lambda j: j["metadata"].update(name="bad.name"),
            'metadata.name: Invalid value: "bad.name": should match: a DNS-1035 label must consist of lower case '
            "alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric "
            "character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')",
        ),
        # pkg/common/util/webhooks.go:15-25 (called at pytorchjob_webhook.go:85)
        (
            lambda j: j["spec"].setdefault("runPolicy", {}).update(managedBy="me"),
            'spec.runPolicy.managedBy: Unsupported value: "me": supported values: "kubeflow.org/training-operator", '
            '"kueue.x-k8s.io/multikueue"',
        ),
        # pytorchjob_webhook.go:95-100
        (
            lambda j: j["spec"].update(elasticPolicy={}) or j["spec"]["pytorchReplicaSpecs"].pop("Worker"),
            "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is used",
        ),
        # pytorchjob_webhook.go:101-107
        (
            lambda j: j["spec"].update(elasticPolicy={"nProcPerNode": 2}, nprocPerNode="2"),
            "spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode",
        ),
        # pytorchjob_webhook.go:129-131
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief=replica()),
            'spec.pytorchReplicaSpecs[Chief]: Unsupported value: "Chief": supported values: "Master", "Worker"',
        ),
        # pytorchjob_webhook.go:139-142
        (
            lambda j: containers(j, "Worker")[0].pop("image"),
            "spec.pytorchReplicaSpecs[Worker].template.spec.containers[0].image: Required value: must be required",
        ),
        # pytorchjob_webhook.go:147-150
        (
            lambda j: containers(j, "Worker")[0].update(name="main"),
            "spec.pytorchReplicaSpecs[Worker].template.spec.containers: Required value: must have at least one "
            "container with name pytorch",
        ),
        # pytorchjob_webhook.go:151-154: nil is rejected too
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].pop("replicas"),
            "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1",
        ),
        # pytorchjob_webhook.go:155-157
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=0),
            "spec.pytorchReplicaSpecs[Worker].replicas: Forbidden: must be at least 1",
        ),
    ],
)
def test_each_rule_with_upstreams_message(mutate: Any, message: str) -> None:
    j = valid_job()
    assert so.validate_job(j) == []
    mutate(j)
    assert so.validate_job(j) == [message]


def test_no_containers_gives_both_container_errors() -> None:
    """``pytorchjob_webhook.go:133-150``: an empty container list is "must be specified" and, since no container
    is named pytorch either, "must have at least one container" as well."""
    j = valid_job()
    j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"] = []
    path = "spec.pytorchReplicaSpecs[Worker].template.spec.containers"
    assert so.validate_job(j) == [
        f"{path}: Required value: must be specified",
        f"{path}: Required value: must have at least one container with name pytorch",
    ]


def test_the_webhook_checks_only_what_upstream_checks() -> None:
    """An empty (non-nil) replica map and a missing Worker ``replicas`` pass (``pytorchjob_webhook.go:117-119``,
    ``:155``); only the deprecated ``elasticPolicy.nProcPerNode`` warns (``:101-104``)."""
    empty = job()
    assert empty["spec"]["pytorchReplicaSpecs"] == {} and so.validate_job(empty) == []
    assert so.validate_job(job(worker=replica(replicas=None))) == []
    deprecated = job(worker=replica(), elastic={"nProcPerNode": 2})
    assert so.validate_job(deprecated) == []
    assert so.validation_warnings(deprecated) == [
        "spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead"
    ]


# ----------------------------------------------------------------------------------------------------------------
# Pure: the AdmissionReview answers
# ----------------------------------------------------------------------------------------------------------------


def test_a_denial_is_controller_runtimes_denied() -> None:
    """``validator_custom.go:147-150``: a field.ErrorList aggregate is not an APIStatus, so ``Denied(err.Error())``
    = ``ValidationResponse(false, msg)`` (``response.go:35-37, 63-83``): code 403, reason Forbidden."""
    bad = valid_job()
    del bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"]
    assert sw.review(admission_review(bad)) == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {
            "uid": "req-1",
            "allowed": False,
            "status": {
                "metadata": {},
                "code": 403,
                "reason": "Forbidden",
                "message": "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1",
            },
        },
    }


def test_several_errors_are_one_aggregate_message() -> None:
    """``field.ErrorList.ToAggregate`` (``pytorchjob_webhook.go:59``): several errors print as ``[a, b]``."""
    bad = valid_job("bad.name")
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 0
    message = sw.review(admission_review(bad))["response"]["status"]["message"]
    assert message.startswith('[metadata.name: Invalid value: "bad.name": should match: a DNS-1035 label')
    assert message.endswith(", spec.pytorchReplicaSpecs[Worker].replicas: Forbidden: must be at least 1]")


def test_allowed_update_delete_and_warnings() -> None:
    """``admission.Allowed("")`` with the validator's warnings (``validator_custom.go:153``); UPDATE validates the
    new object (``pytorchjob_webhook.go:62-69``); DELETE is not validated (``:71-73``)."""
    assert sw.review(admission_review(valid_job()))["response"] == {
        "uid": "req-1",
        "allowed": True,
        "status": {"metadata": {}, "code": 200},
    }
    bad = valid_job()
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    assert not sw.review(admission_review(bad, "UPDATE", old=valid_job()))["response"]["allowed"]
    # managedBy immutability is never enforced: the new object is compared with itself.
    moved = valid_job()
    moved["spec"]["runPolicy"] = {"managedBy": "kueue.x-k8s.io/multikueue"}
    assert sw.review(admission_review(moved, "UPDATE", old=valid_job()))["response"]["allowed"]
    assert sw.review(admission_review(bad, "DELETE"))["response"]["allowed"]
    warned = job(worker=replica(), elastic={"nProcPerNode": 2})
    assert sw.review(admission_review(warned))["response"]["warnings"] == [
        "spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead"
    ]


def test_a_null_replica_spec_is_a_recovered_panic() -> None:
    """``pytorchjob_webhook.go:133-139`` dereferences a nil spec; controller-runtime recovers the panic into
    ``Errored(500, ...)`` (``webhook.go:155-168``). (The API server drops such nulls before admission, so this is
    only reachable by a direct call.)"""
    bad = valid_job()
    bad["spec"]["pytorchReplicaSpecs"]["Worker"] = None
    response = sw.review(admission_review(bad))["response"]
    assert response["allowed"] is False and response["status"]["code"] == 500
    assert response["status"]["message"].startswith("panic: runtime error")


def test_the_configuration_is_upstreams() -> None:
    """``manifests/base/webhook/manifests.yaml:47-66`` (name, path, rules, failurePolicy, sideEffects) and
    ``patch.yaml:16-18`` (the configuration's name), with a URL clientConfig for the local cluster."""
    cfg = sw.webhook_configuration("https://127.0.0.1:1234/validate-kubeflow-org-v1-pytorchjob", b"PEM")
    assert cfg["metadata"] == {"name": "validator.training-operator.kubeflow.org"}
    hook, trainjobs = cfg["webhooks"]
    assert trainjobs["rules"] == [
        {
            "apiGroups": ["trainer.kubeflow.org"],
            "apiVersions": ["v1alpha1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["trainjobs"],
        }
    ]
    assert trainjobs["clientConfig"]["url"] == "https://127.0.0.1:1234/validate-trainer-kubeflow-org-v1alpha1-trainjob"
    assert hook == {
        "name": "validator.pytorchjob.training-operator.kubeflow.org",
        "admissionReviewVersions": ["v1"],
        "clientConfig": {"url": "https://127.0.0.1:1234/validate-kubeflow-org-v1-pytorchjob", "caBundle": "UEVN"},
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "rules": [
            {
                "apiGroups": ["kubeflow.org"],
                "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["pytorchjobs"],
            }
        ],
    }


# ----------------------------------------------------------------------------------------------------------------
# The TLS server, in process
# ----------------------------------------------------------------------------------------------------------------


def post(url: str, ca_file: Path, body: bytes, content_type: str = "application/json") -> tuple[int, Any]:
    tls = ssl.create_default_context(cafile=str(ca_file))
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_the_server_answers_over_tls_with_its_own_ca(tmp_path: Path) -> None:
    server = sw.WebhookServer(tmp_path).start()
    try:
        endpoint = sw.read_endpoint(tmp_path, -1)
        assert endpoint is None  # not written yet, and never another process's
        server.write_endpoint()
        import os

        endpoint = sw.read_endpoint(tmp_path, os.getpid())
        assert endpoint is not None and endpoint["url"] == server.url
        assert server.url.startswith("https://127.0.0.1:") and server.url.endswith(sw.WEBHOOK_PATH)
        bad = valid_job()
        del bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"]
        code, answer = post(server.url, server.ca_file, json.dumps(admission_review(bad)).encode())
        assert code == 200 and answer["response"]["status"]["code"] == 403
        code, answer = post(server.url, server.ca_file, json.dumps(admission_review(valid_job())).encode())
        assert code == 200 and answer["response"]["allowed"] is True
        code, answer = post(server.url, server.ca_file, b"{}", content_type="text/plain")
        assert answer["response"]["status"]["code"] == 400
        code, _ = post(server.url.replace(sw.WEBHOOK_PATH, "/other"), server.ca_file, b"{}")
        assert code == 404
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------------------------------------------
# Cluster: what the API server answers the client
# ----------------------------------------------------------------------------------------------------------------


def raw_call(kube_cluster: Any, token: str, method: str, path: str, body: Any, content_type: str) -> Any:
    tls = ssl.create_default_context(cafile=str(kube_cluster.ca_file))
    request = urllib.request.Request(
        kube_cluster.api_url + path,
        data=json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
    )
    try:
        with urllib.request.urlopen(request, timeout=30, context=tls) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get_all("Warning") or []
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers.get_all("Warning") or []


@pytest.mark.cluster
def test_the_apiserver_answers_a_rejected_create_with_a_403_status_without_details(
    cluster: Cluster, kube_cluster: Any
) -> None:
    """The apiserver (``ValidatingAdmissionWebhook``, on by default in 1.20) calls the registered webhook and turns
    its denial into a 403 Status (k8s.io/apiserver ``webhook/errors/statuserror.go`` ToStatusErr): the webhook's
    code, reason and message, the message prefixed with the webhook's name, and no ``details``; an RBAC 403 has
    ``details``. The webhook name is upstream's (``manifests/base/webhook/manifests.yaml:55``)."""
    name = unique("invalid")
    bad = job(name, master=replica(replicas=None), worker=replica())
    bad["metadata"] = {"name": name, "namespace": cluster.namespace}
    path = f"/apis/kubeflow.org/v1/namespaces/{cluster.namespace}/pytorchjobs"
    code, body, _ = raw_call(kube_cluster, kube_cluster.admin_token, "POST", path, bad, "application/json")
    assert (code, body) == (
        403,
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": DENIED_BY + "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1",
            "reason": "Forbidden",
            "code": 403,
        },
    )
    assert not cluster.job_exists(name)

    # The other 403 a client can get at create: RBAC (the SA identity has no Role here). It has details.
    code, rbac, _ = raw_call(kube_cluster, kube_cluster.sa_token, "POST", path, bad, "application/json")
    assert (code, rbac["reason"], rbac["details"]) == (
        403,
        "Forbidden",
        {"group": "kubeflow.org", "kind": "pytorchjobs"},
    )
    assert rbac["message"].startswith("pytorchjobs.kubeflow.org is forbidden: User ")

    # Through the Python client (what the product uses): an ApiException with status 403 and that body.
    from kubernetes.client.rest import ApiException

    with pytest.raises(ApiException) as raised:
        cluster.create_job(bad)
    assert raised.value.status == 403
    assert json.loads(raised.value.body) == body


@pytest.mark.cluster
def test_updates_are_validated_status_writes_are_not_and_warnings_reach_the_client(
    cluster: Cluster, kube_cluster: Any
) -> None:
    """Rules CREATE and UPDATE on ``pytorchjobs`` only (``manifests.yaml:56-66``): an invalid update is a 403,
    ``pytorchjobs/status`` is not a matched resource; admission warnings come back as ``Warning: 299`` headers."""
    name = unique("update")
    path = f"/apis/kubeflow.org/v1/namespaces/{cluster.namespace}/pytorchjobs"
    body = job(name, worker=replica(command=["python", "-c", "import time; time.sleep(60)"]))
    body["metadata"] = {"name": name, "namespace": cluster.namespace}
    body["spec"]["elasticPolicy"] = {"nProcPerNode": 1}
    code, _, warnings = raw_call(kube_cluster, kube_cluster.admin_token, "POST", path, body, "application/json")
    cluster.jobs.append(name)
    assert code == 201
    assert warnings == ['299 - "spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead"']

    patch = {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 0}}}}
    merge = "application/merge-patch+json"
    code, denied, _ = raw_call(kube_cluster, kube_cluster.admin_token, "PATCH", f"{path}/{name}", patch, merge)
    assert (code, denied["message"]) == (
        403,
        DENIED_BY + "spec.pytorchReplicaSpecs[Worker].replicas: Forbidden: must be at least 1",
    )
    status = {"status": {"conditions": [{"type": "Created", "status": "True", "reason": "x", "message": "x"}]}}
    code, _, _ = raw_call(kube_cluster, kube_cluster.admin_token, "PATCH", f"{path}/{name}/status", status, merge)
    assert code == 200


@pytest.mark.cluster
def test_the_control_plane_registered_the_webhook(kube_cluster: Any) -> None:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kube_cluster.kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        registered = client.AdmissionregistrationV1Api(api_client).read_validating_webhook_configuration(
            sw.CONFIGURATION_NAME
        )
    hook, trainjobs = registered.webhooks
    assert (hook.name, hook.failure_policy, hook.side_effects) == (sw.WEBHOOK_NAME, "Fail", "None")
    endpoint = json.loads((kube_cluster.state_dir / "webhook" / "endpoint.json").read_text())
    assert hook.client_config.url == endpoint["url"]
    assert trainjobs.name == sw.TRAINJOB_WEBHOOK_NAME
    assert trainjobs.client_config.url == endpoint["url"].replace(sw.WEBHOOK_PATH, sw.TRAINJOB_WEBHOOK_PATH)


def test_trainjobs_get_the_trainer_webhooks_rules_that_a_1_20_api_server_drops() -> None:
    """The provider's own TrainJob is admitted; one setting a reserved PET_* name, or changing its trainer block on
    update, is denied with the Trainer's message."""
    from airflow_provider_torchelastic import Elastic
    from tests.contract.test_trainjob_render import render

    trainjob = render(Elastic(nnodes=2))[1]
    request = {"operation": "CREATE", "resource": {"resource": "trainjobs"}, "object": trainjob}
    runtime = yaml.safe_load(
        (Path(__file__).parents[1] / "crds" / "torch-distributed.runtime.derived.yaml").read_text()
    )
    looked_up: list[str | None] = []

    def found(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        looked_up.append(twh.runtime_path(obj))
        return runtime, None

    assert sw.admission_response(request, found)["allowed"], sw.admission_response(request, found)
    assert looked_up == ["/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/torch-distributed"]
    reserved = json.loads(json.dumps(trainjob))
    reserved["spec"]["trainer"].setdefault("env", []).append({"name": "PET_NNODES", "value": "4"})
    denied = sw.admission_response({**request, "object": reserved}, found)
    assert not denied["allowed"] and "PET_NNODES" in denied["status"]["message"]
    # A runtime the API does not have: refused at submit with the API's error in upstream's sentence.
    missing = sw.admission_response(request, lambda _obj: (None, 'clustertrainingruntimes... "x" not found'))
    assert (missing["allowed"], missing["status"]["code"]) == (False, 403)
    assert missing["status"]["message"].startswith("spec.RuntimeRef: Invalid value: ")
    assert missing["status"]["message"].endswith(
        'clustertrainingruntimes... "x" not found: specified clusterTrainingRuntime must be created before the '
        "TrainJob is created"
    )
    changed = json.loads(json.dumps(trainjob))
    changed["spec"]["trainer"]["numNodes"] = 3
    update = {"operation": "UPDATE", "resource": {"resource": "trainjobs"}, "object": changed, "oldObject": trainjob}
    assert not sw.admission_response(update)["allowed"]
