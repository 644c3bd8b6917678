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
    """torch.go:65-77: the reserved names, with the env as the bad value (apimachinery prints it as JSON)."""
    obj = trainjob()
    obj["spec"]["trainer"]["env"] = [{"name": "PET_NNODES", "value": "2:4"}, {"name": "OK", "value": "1"}]
    assert wh.validate_trainjob(obj, runtime=RUNTIME) == [
        'spec.trainer.env: Invalid value: [{"name":"PET_NNODES","value":"2:4"},{"name":"OK","value":"1"}]: '
        "must not have reserved envs, invalid envs configured: [PET_NNODES]"
    ]
    # Only a runtime with mlPolicy.torch runs the torch plugin's Validate.
    no_torch = copy.deepcopy(RUNTIME)
    no_torch["spec"]["mlPolicy"].pop("torch")
    assert wh.validate_trainjob(obj, runtime=no_torch) == []


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


def test_container_patch_env_is_refused_on_node() -> None:
    """jobset.go:203-206: env only through the Trainer/Initializer APIs; the bad value is the whole runtimePatches."""
    patches = [patch({"name": "node", "env": [{"name": "X", "value": "1"}]})]
    assert wh.validate_trainjob(trainjob(runtimePatches=patches), runtime=RUNTIME) == [
        f"spec.runtimePatches: Invalid value: {wh.go_json(patches)}: must not have envs for the dataset-initializer, "
        "model-initializer, node containers"
    ]
    # volumeMounts and securityContext are fine on node.
    ok = trainjob(runtimePatches=[patch({"name": "node", "securityContext": {"runAsNonRoot": True}})])
    assert wh.validate_trainjob(ok, runtime=RUNTIME) == []


def test_patched_containers_and_jobs_must_exist_in_the_runtime() -> None:
    """jobset.go:181-201, one error each (the identical ones once: ``ToAggregate`` drops duplicates)."""
    obj = trainjob(
        runtimePatches=[
            patch({"name": "sidecar"}),
            patch({"name": "other"}, manager="a.io/b"),
            patch({"name": "node"}, rjob="launcher", manager="b/c"),
        ]
    )
    bad = f"spec.runtimePatches: Invalid value: {wh.go_json(obj['spec']['runtimePatches'])}: "
    assert wh.validate_trainjob(obj, runtime=RUNTIME) == [
        bad + "must not have container that doesn't exist in the runtime job node",
        bad + "must not have replicated job that doesn't exist in the runtime job template",
    ]
    assert wh.validate_trainjob(obj) == []  # not looked up: nothing to compare with


def test_runtime_patches_change_only_around_a_suspension() -> None:
    """jobset.go:214-232 (its look at an active JobSet aside): Kueue may change runtimePatches where the TrainJob is
    suspended before or after the update."""
    old = trainjob(runtimePatches=[patch({"name": "node"})])
    new = trainjob(runtimePatches=[patch({"name": "node"}), patch({"name": "node"}, manager="kueue.x-k8s.io/m")])
    assert wh.validate_trainjob(new, old, runtime=RUNTIME) == [
        "spec.runtimePatches: Forbidden: RuntimePatches can only be modified when the TrainJob is suspended before "
        "or after the update"
    ]
    old["spec"]["suspend"] = True
    assert wh.validate_trainjob(new, old, runtime=RUNTIME) == []


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        (
            {"name": "torch-distributed"},
            'spec.RuntimeRef: Invalid value: {"name":"torch-distributed","apiGroup":"trainer.kubeflow.org",'
            '"kind":"ClusterTrainingRuntime"}: clustertrainingruntimes.trainer.kubeflow.org "torch-distributed" not '
            "found: specified clusterTrainingRuntime must be created before the TrainJob is created",
        ),
        (
            {"name": "mine", "kind": "TrainingRuntime"},
            'spec.runtimeRef: Invalid value: {"name":"mine","apiGroup":"trainer.kubeflow.org","kind":"TrainingRuntime"}'
            ': trainingruntimes.trainer.kubeflow.org "mine" not found: specified trainingRuntime must be created '
            "before the TrainJob is created",
        ),
    ],
)
def test_missing_runtime_is_denied(ref: dict[str, str], expected: str) -> None:
    """clustertrainingruntime.go:99-108 (``spec.RuntimeRef``, sic) and trainingruntime.go:304-314."""
    obj = trainjob(runtimeRef=ref)
    assert wh.runtime_path(obj) is not None
    assert wh.validate_trainjob(obj, runtime=None) == [expected]
    assert wh.DENIED_STATUS == 403


def test_unsupported_runtime_kind_is_denied_without_a_lookup() -> None:
    """trainjob_webhook.go:112-116: a kind outside the runtime registry is refused before any lookup."""
    obj = trainjob(runtimeRef={"name": "x", "apiGroup": "example.com", "kind": "Runtime"})
    assert wh.runtime_path(obj) is None
    assert wh.validate_trainjob(obj) == ["unsupported runtime: Runtime.example.com"]


def test_cel_errors_come_alone() -> None:
    """The API server's schema and CEL rules run before any validating webhook: their errors come alone."""
    obj = trainjob("1bad", runtimeRef={"name": "nope"})
    assert wh.validate_trainjob(obj, runtime=None) == [
        '<nil>: Invalid value: "object": metadata.name must match RFC 1035 DNS label format'
    ]


def test_storage_uri_rule() -> None:
    assert wh.validate_trainjob(trainjob(initializer={"dataset": {"storageUri": "hf://x"}})) == []
    errors = wh.validate_trainjob(trainjob(initializer={"model": {"storageUri": "nope"}}))
    assert errors == [
        'spec.initializer.model.storageUri: Invalid value: "string": storageUri may be empty, or it must be a valid '
        "URI (scheme://...)"
    ]
