"""The TrainJob admission rules a 1.20 API server drops (tests/cluster/sim_trainer_webhook.py); no cluster needed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster import sim_trainer_webhook as wh

CRD = Path(__file__).resolve().parents[2] / "tests" / "crds" / "trainer.kubeflow.org_trainjobs.derived.yaml"
RUNTIME = yaml.safe_load((CRD.parent / "torch-distributed.runtime.derived.yaml").read_text())


def trainjob(name: str = "tj", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {"image": "img", "command": ["python"], "numNodes": 2},
            **spec,
        },
    }


def patch(container: dict[str, Any], rjob: str = "node", manager: str = "example.com/m") -> dict[str, Any]:
    return {
        "manager": manager,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": rjob, "template": {"spec": {"template": {"spec": {"containers": [container]}}}}}
                    ]
                }
            }
        },
    }


def crd_rules() -> set[tuple[str, str, str]]:
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    found: set[tuple[str, str, str]] = set()

    def walk(node: dict[str, Any], path: str) -> None:
        for rule in node.get("x-kubernetes-validations") or []:
            found.add((path, rule["rule"], rule["message"]))
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    return {r for r in found if not r[0].startswith(".status")}


def test_cel_rules_are_the_crds() -> None:
    """Every CEL rule of the derived CRD (the status subresource's aside) is enforced here, and no other."""
    assert set(wh.CEL_RULES) == crd_rules()


def test_a_valid_trainjob_is_admitted() -> None:
    assert wh.validate_trainjob(trainjob(), runtime=RUNTIME) == []


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("1abc", "metadata.name must match RFC 1035 DNS label format"),
        ("a.b", "metadata.name must match RFC 1035 DNS label format"),
        ("a" * 64, "metadata.name must be no more than 63 characters"),
    ],
)
def test_name_rules(name: str, fragment: str) -> None:
    errors = wh.validate_trainjob(trainjob(name))
    assert errors == [f'<nil>: Invalid value: "object": {fragment}']


def test_managed_by() -> None:
    assert wh.validate_trainjob(trainjob(managedBy="kueue.x-k8s.io/multikueue")) == []
    assert wh.validate_trainjob(trainjob(managedBy="me/x")) == [
        'spec.managedBy: Invalid value: "string": ManagedBy must be trainer.kubeflow.org/trainjob-controller or '
        "kueue.x-k8s.io/multikueue if set"
    ]


def test_reserved_env() -> None:
    obj = trainjob()
    obj["spec"]["trainer"]["env"] = [{"name": "PET_NNODES", "value": "2:4"}, {"name": "OK", "value": "1"}]
    errors = wh.validate_trainjob(obj)
    assert len(errors) == 1 and errors[0].startswith("spec.trainer.env: Invalid value")
    assert "reserved envs" in errors[0] and "PET_NNODES" in errors[0]


def test_immutable_fields_on_update() -> None:
    old = trainjob(activeDeadlineSeconds=60)
    new = copy.deepcopy(old)
    new["spec"]["trainer"]["numNodes"] = 3
    new["spec"]["runtimeRef"]["name"] = "other"
    new["spec"]["activeDeadlineSeconds"] = 120
    assert wh.validate_trainjob(new, old) == [
        'spec.activeDeadlineSeconds: Invalid value: "integer": field is immutable',
        'spec.runtimeRef: Invalid value: "object": field is immutable',
        'spec.trainer: Invalid value: "object": field is immutable',
    ]
    # suspend is mutable (Kueue), and a field absent before may be added: transition rules need both sides.
    new = copy.deepcopy(old)
    new["spec"]["suspend"] = True
    new["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    assert wh.validate_trainjob(new, old) == []
    # On CREATE there is no oldSelf.
    assert wh.validate_trainjob(trainjob(activeDeadlineSeconds=5)) == []


def test_runtime_patch_immutability_pairs_items_by_manager() -> None:
    first = patch({"name": "node", "volumeMounts": [{"name": "a", "mountPath": "/a"}]}, manager="a.io/x")
    second = patch({"name": "node"}, manager="b.io/y")
    old = trainjob(runtimePatches=[first])
    reordered = trainjob(runtimePatches=[second, first])  # a new manager's patch and the old one moved: allowed
    assert wh.validate_trainjob(reordered, old) == []
    changed = copy.deepcopy(old)
    changed["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"
    ]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] = "/b"
    assert wh.validate_trainjob(changed, old) == [
        "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec"
        '.containers: Invalid value: "array": field is immutable'
    ]


@pytest.mark.parametrize("container", ["node", "dataset-initializer", "model-initializer"])
def test_container_patch_env_is_refused_on_api_containers(container: str) -> None:
    obj = trainjob(runtimePatches=[patch({"name": container, "env": [{"name": "X", "value": "1"}]})])
    errors = wh.validate_trainjob(obj)
    assert len(errors) == 1
    assert errors[0].startswith(
        "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec"
        f".containers[0].env: Invalid value: '{container}': env can't be set for container with the name: {container}"
    )
    # volumeMounts and securityContext are fine on node.
    ok = trainjob(runtimePatches=[patch({"name": "node", "securityContext": {"runAsNonRoot": True}})])
    assert wh.validate_trainjob(ok, runtime=RUNTIME) == []


def test_patched_containers_and_jobs_must_exist_in_the_runtime() -> None:
    obj = trainjob(runtimePatches=[patch({"name": "sidecar"}), patch({"name": "node"}, rjob="launcher", manager="b/c")])
    errors = wh.validate_trainjob(obj, runtime=RUNTIME)
    assert any(".containers[0].name: Invalid value: 'sidecar': must exist in the runtime" in e for e in errors)
    assert any("replicatedJobs[0].name: Invalid value: 'launcher': must exist in the runtime" in e for e in errors)
    assert wh.validate_trainjob(obj) == []  # without the runtime, nothing to compare with


def test_missing_runtime_is_denied() -> None:
    errors = wh.validate_trainjob(trainjob(), runtime_exists=False)
    assert errors == [
        "not found ClusterTrainingRuntime specified in TrainJob: clustertrainingruntimes.trainer.kubeflow.org "
        '"torch-distributed" not found'
    ]
    assert wh.DENIED_STATUS == 403


def test_storage_uri_rule() -> None:
    assert wh.validate_trainjob(trainjob(initializer={"dataset": {"storageUri": "hf://x"}})) == []
    errors = wh.validate_trainjob(trainjob(initializer={"model": {"storageUri": "nope"}}))
    assert errors == [
        'spec.initializer.model.storageUri: Invalid value: "string": storageUri may be empty, or it must be a valid '
        "URI (scheme://...)"
    ]
