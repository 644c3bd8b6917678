"""The committed CRD derivatives (PyTorchJob; TrainJob, ClusterTrainingRuntime, JobSet) and the torch-distributed
runtime's: equal to what ``scripts/derive_crd.py`` makes of upstream, and still working schemas.

The repository has to pass on a fresh clone, so it carries ``tests/crds/*.derived.yaml`` instead of reading the
upstream files from ``../shared``. Where an upstream file is there (as in CI), its derivative is derived again and
compared byte for byte, so it can neither drift nor be edited by hand; without it those tests skip and the rest check
the derivatives on their own.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest

from airflow_provider_torchelastic.core.config import Elastic
from tests.contract.builders import render, workload
from tests.contract.schemas import REPO_ROOT, crd_jsonschema, load_crd
from tests.contract.trainjob_schemas import crd_schema

SCRIPT = REPO_ROOT / "scripts" / "derive_crd.py"
REGENERATE = "regenerate it with `make crd` (python scripts/derive_crd.py) and commit the result"


def _load_script() -> ModuleType:
    # scripts/ is not a package: load the file itself, as `python scripts/derive_crd.py` would run it.
    spec = importlib.util.spec_from_file_location("derive_crd", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first, as an import would: its dataclasses look their module up while being made.
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


derive_crd = _load_script()
DERIVED: Path = derive_crd.DERIVED_PATH
DERIVATIONS = {derivation.name: derivation for derivation in derive_crd.DERIVATIONS}
CRDS = [name for name, derivation in DERIVATIONS.items() if derivation.what.endswith(" CRD")]


def _needs_upstream(derivation: Any) -> pytest.MarkDecorator:
    upstream = derivation.default_upstream_path()
    return pytest.mark.skipif(
        not upstream.is_file(),
        reason=f"upstream CRD not at {upstream} (../shared/crds/ from the repository root, or "
        f"${derive_crd.UPSTREAM_DIR_ENV}): the derivative cannot be compared with it here",
    )


def each(names: list[str]) -> pytest.MarkDecorator:
    """Parametrize over derivations by name, each skipping where its upstream file is absent."""
    return pytest.mark.parametrize(
        "name", [pytest.param(name, marks=_needs_upstream(DERIVATIONS[name]), id=name) for name in names]
    )


@functools.cache
def derived_doc_of(name: str) -> dict[str, Any]:
    """The committed derivative, parsed once (libyaml where present: the files are hundreds of KB); not to modify."""
    doc: dict[str, Any] = derive_crd._load(DERIVATIONS[name].derived_path.read_bytes())
    return doc


@functools.cache
def upstream_doc_of(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = derive_crd._load(DERIVATIONS[name].default_upstream_path().read_bytes())
    return doc


@pytest.fixture(scope="module")
def derived_doc() -> dict[str, Any]:
    return derived_doc_of("pytorchjob")


# ------------------------------------------------------------------------------ against upstream, where it is


@each(list(DERIVATIONS))
def test_committed_derivative_is_what_the_script_derives_from_upstream(name: str) -> None:
    derivation = DERIVATIONS[name]
    derived = derivation.derived_path
    expected = derive_crd.derive_file(derivation.default_upstream_path(), derivation)
    actual = derived.read_bytes().decode() if derived.is_file() else ""
    if actual.encode() != expected.encode():
        pytest.fail(
            f"{derived.relative_to(REPO_ROOT)} is not what scripts/derive_crd.py derives from "
            f"{derivation.default_upstream_path()}; {REGENERATE}.\n"
            + derive_crd._describe_difference(expected, actual, derived.name),
            pytrace=False,
        )


@each(CRDS)
@pytest.mark.parametrize("strict", [True, False])
def test_derivative_validates_exactly_like_upstream(name: str, strict: bool) -> None:
    assert crd_schema(derived_doc_of(name), strict=strict) == crd_schema(upstream_doc_of(name), strict=strict)


@each(["pytorchjob"])
def test_check_mode_reports_a_hand_edit(name: str, tmp_path: Path) -> None:
    edited = tmp_path / "edited.yaml"
    edited.write_text(DERIVED.read_text().replace("format: int32", "format: int64", 1))
    ok = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("is up to date") == len(DERIVATIONS)
    stale = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--only", name, "--output", str(edited)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert stale.returncode == 1
    assert "make crd" in stale.stdout
    assert "format: int64" in stale.stdout and "format: int32" in stale.stdout  # the diff shows the edit


@each(["trainjob"])
def test_a_file_of_another_release_is_refused(name: str, tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_bytes(DERIVATIONS[name].default_upstream_path().read_bytes() + b"\n")
    said: list[str] = []
    assert derive_crd.main(["--only", name, str(other), "--check"], out=said.append) == 2
    assert "kubeflow/trainer v2.3.0" in said[0] and "sha256" in said[0]


# ------------------------------------------------------------------------------ the derivative on its own


def test_check_mode_without_upstream_says_where_it_looked(tmp_path: Path) -> None:
    said: list[str] = []
    assert derive_crd.main(["--only", "pytorchjob", str(tmp_path / "absent.yaml"), "--check"], out=said.append) == 2
    assert "absent.yaml" in said[0]


def test_a_path_needs_to_say_which_derivative_it_is(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        derive_crd.main([str(tmp_path / "some.yaml")])


@pytest.mark.parametrize("name", list(DERIVATIONS))
def test_derivative_has_no_descriptions(name: str) -> None:
    doc = derived_doc_of(name)
    assert derive_crd.schema_annotations(doc) == []
    assert "annotations" not in doc["metadata"]


@pytest.mark.parametrize("name", list(DERIVATIONS))
def test_derivative_is_in_the_form_the_script_writes(name: str) -> None:
    # Deriving a derivative changes nothing, so this holds without upstream and catches most hand edits.
    derivation = DERIVATIONS[name]
    text = derivation.derived_path.read_text()
    assert text.startswith(derivation.header), f"header changed by hand; {REGENERATE}"
    assert derivation.sha256 in derivation.header
    assert derive_crd.render(derive_crd.derive(derived_doc_of(name)), derivation) == text, f"edited; {REGENERATE}"


@pytest.mark.parametrize("name", ["trainjob", "clustertrainingruntime", "torch-distributed"])
def test_a_kubeflow_derivative_repeats_the_upstream_licence_notice(name: str) -> None:
    text = DERIVATIONS[name].derived_path.read_text()
    assert "# Copyright The Kubeflow Authors." in text and "Apache License, Version 2.0" in text


def test_the_pytorchjob_derivative_keeps_the_path_the_test_cluster_installs() -> None:
    assert DERIVED == REPO_ROOT / "tests" / "crds" / "kubeflow.org_pytorchjobs.derived.yaml"
    assert DERIVATIONS["pytorchjob"].derived_path == DERIVED


def test_trainer_derivatives_keep_what_the_api_server_acts_on() -> None:
    (version,) = derived_doc_of("trainjob")["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert {
        "rule": "size(self.metadata.name) <= 63",
        "message": "metadata.name must be no more than 63 characters",
    } in (schema["x-kubernetes-validations"])
    spec = schema["properties"]["spec"]
    assert spec["required"] == ["runtimeRef"]
    assert spec["properties"]["trainer"]["x-kubernetes-validations"] == [
        {"message": "field is immutable", "rule": "self == oldSelf"}
    ]
    assert spec["properties"]["runtimePatches"]["x-kubernetes-list-map-keys"] == ["manager"]
    assert version["subresources"] == {"status": {}}
    (jobset,) = derived_doc_of("jobset")["spec"]["versions"]
    assert jobset["name"] == "v1alpha2"
    (runtime,) = derived_doc_of("clustertrainingruntime")["spec"]["versions"]
    assert derived_doc_of("clustertrainingruntime")["spec"]["scope"] == "Cluster" and runtime["name"] == "v1alpha1"


def test_derivative_keeps_what_the_api_server_acts_on(derived_doc: dict[str, Any]) -> None:
    (version,) = derived_doc["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["pytorchReplicaSpecs"]
    run_policy = spec["properties"]["runPolicy"]["properties"]
    assert run_policy["suspend"]["default"] is False
    assert run_policy["schedulingPolicy"]["properties"]["queue"]["x-kubernetes-validations"] == [
        {"message": "spec.runPolicy.schedulingPolicy.queue is immutable", "rule": "self == oldSelf"}
    ]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.pytorchReplicaSpecs.Worker.replicas"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "nprocPerNode"), 2),
        (("spec", "pytorchReplicaSpecs", "Worker", "replicas"), "two"),
        (("spec", "runPolicy", "backoffLimit"), "3"),
        (("spec", "elasticPolicy", "maxReplica"), 3),
    ],
)
def test_derivative_rejects_known_bad_objects(path: tuple[str, ...], value: Any) -> None:
    # load_crd(DERIVED), not validate_pytorchjob: TORCHELASTIC_CRD_PATH may point the other tests elsewhere.
    validator = jsonschema.Draft4Validator(crd_jsonschema(load_crd(DERIVED)))
    job = workload(render(Elastic(nnodes=2)))
    validator.validate(job)
    target = job
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(job)


# ------------------------------------------------------------------------------ the script's rules


def _crd(schema: dict[str, Any], **version: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.com", "annotations": {"controller-gen.kubebuilder.io/version": "v0"}},
        "spec": {
            "group": "example.com",
            "versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}, **version}],
        },
    }


def test_a_property_named_description_is_a_field_and_stays() -> None:
    upstream = _crd(
        {
            "description": "A thing.",
            "type": "object",
            "required": ["description"],
            "properties": {
                "description": {"description": "What the thing is.", "type": "string", "default": "none"},
                "labels": {"type": "object", "default": {"description": "kept: a default is data"}},
            },
        },
        additionalPrinterColumns=[{"name": "Desc", "type": "string", "jsonPath": ".description", "description": "x"}],
    )
    before = copy.deepcopy(upstream)
    derived = derive_crd.derive(upstream)
    assert upstream == before
    (version,) = derived["spec"]["versions"]
    assert version["schema"]["openAPIV3Schema"] == {
        "type": "object",
        "required": ["description"],
        "properties": {
            "description": {"type": "string", "default": "none"},
            "labels": {"type": "object", "default": {"description": "kept: a default is data"}},
        },
    }
    assert version["additionalPrinterColumns"] == [{"name": "Desc", "type": "string", "jsonPath": ".description"}]
    assert "annotations" not in derived["metadata"]
    assert derive_crd.schema_annotations(derived) == []
    assert derive_crd.schema_annotations(upstream) == [
        ".spec.versions[0].schema.openAPIV3Schema.description",
        ".spec.versions[0].schema.openAPIV3Schema.properties.description.description",
        ".spec.versions[0].additionalPrinterColumns[0].description",
    ]


def test_an_unknown_schema_key_needs_a_decision() -> None:
    with pytest.raises(derive_crd.UnknownSchemaKey, match="x-new-marker"):
        derive_crd.derive(_crd({"type": "object", "properties": {"a": {"type": "string", "x-new-marker": True}}}))


def test_output_depends_only_on_content(derived_doc: dict[str, Any]) -> None:
    first = derive_crd.render(derive_crd.derive(derived_doc))
    assert derive_crd.render(derive_crd.derive(copy.deepcopy(derived_doc))) == first

    def reversed_keys(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: reversed_keys(node[key]) for key in reversed(list(node))}
        if isinstance(node, list):
            return [reversed_keys(item) for item in node]
        return node

    assert derive_crd.render(derive_crd.derive(reversed_keys(derived_doc))) == first
