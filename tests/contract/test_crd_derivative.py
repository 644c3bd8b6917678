"""The committed PyTorchJob CRD derivative: equal to what ``scripts/derive_crd.py`` makes of upstream, and still a
working schema.

The repository has to pass on a fresh clone, so it carries ``tests/crds/kubeflow.org_pytorchjobs.derived.yaml``
instead of reading the upstream CRD from ``../shared``. Where the upstream file is there (as in CI), the derivative is
derived again and compared byte for byte, so it can neither drift nor be edited by hand; without it those tests skip
and the rest check the derivative on its own.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml

from airflow_provider_torchelastic.core.config import Elastic
from tests.contract.builders import render, workload
from tests.contract.schemas import REPO_ROOT, crd_jsonschema, load_crd

SCRIPT = REPO_ROOT / "scripts" / "derive_crd.py"
REGENERATE = "regenerate it with `make crd` (python scripts/derive_crd.py) and commit the result"


def _load_script() -> ModuleType:
    # scripts/ is not a package: load the file itself, as `python scripts/derive_crd.py` would run it.
    spec = importlib.util.spec_from_file_location("derive_crd", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


derive_crd = _load_script()
DERIVED: Path = derive_crd.DERIVED_PATH
UPSTREAM: Path = derive_crd.default_upstream_path()

needs_upstream = pytest.mark.skipif(
    not UPSTREAM.is_file(),
    reason=f"upstream CRD not at {UPSTREAM} (../shared/crds/ from the repository root, or "
    f"${derive_crd.UPSTREAM_PATH_ENV}): the derivative cannot be compared with it here",
)


@pytest.fixture(scope="module")
def derived_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(DERIVED.read_text())
    return doc


# ------------------------------------------------------------------------------ against upstream, where it is


@needs_upstream
def test_committed_derivative_is_what_the_script_derives_from_upstream() -> None:
    expected = derive_crd.derive_file(UPSTREAM)
    actual = DERIVED.read_bytes().decode() if DERIVED.is_file() else ""
    if actual.encode() != expected.encode():
        pytest.fail(
            f"{DERIVED.relative_to(REPO_ROOT)} is not what scripts/derive_crd.py derives from {UPSTREAM}; "
            f"{REGENERATE}.\n" + derive_crd._describe_difference(expected, actual, DERIVED.name),
            pytrace=False,
        )


@needs_upstream
@pytest.mark.parametrize("strict", [True, False])
def test_derivative_validates_exactly_like_upstream(strict: bool, derived_doc: dict[str, Any]) -> None:
    upstream = derive_crd._load(UPSTREAM.read_bytes())
    assert crd_jsonschema(derived_doc, strict=strict) == crd_jsonschema(upstream, strict=strict)


@needs_upstream
def test_check_mode_reports_a_hand_edit(tmp_path: Path) -> None:
    edited = tmp_path / "edited.yaml"
    edited.write_text(DERIVED.read_text().replace("format: int32", "format: int64", 1))
    ok = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    stale = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--output", str(edited)], capture_output=True, text=True, check=False
    )
    assert stale.returncode == 1
    assert "make crd" in stale.stdout
    assert "format: int64" in stale.stdout and "format: int32" in stale.stdout  # the diff shows the edit


# ------------------------------------------------------------------------------ the derivative on its own


def test_check_mode_without_upstream_says_where_it_looked(tmp_path: Path) -> None:
    said: list[str] = []
    assert derive_crd.main([str(tmp_path / "absent.yaml"), "--check"], out=said.append) == 2
    assert "absent.yaml" in said[0]


def test_derivative_has_no_descriptions(derived_doc: dict[str, Any]) -> None:
    assert derive_crd.schema_annotations(derived_doc) == []
    assert "annotations" not in derived_doc["metadata"]


def test_derivative_is_in_the_form_the_script_writes(derived_doc: dict[str, Any]) -> None:
    # Deriving a derivative changes nothing, so this holds without upstream and catches most hand edits.
    text = DERIVED.read_text()
    assert text.startswith(derive_crd.HEADER), f"header changed by hand; {REGENERATE}"
    assert derive_crd.UPSTREAM_SHA256 in derive_crd.HEADER
    assert derive_crd.render(derive_crd.derive(derived_doc)) == text, f"edited by hand; {REGENERATE}"


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
