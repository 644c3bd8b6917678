"""Derive the repository's description-free CRDs (and the one runtime object the tests use) from the upstream ones.

The upstream CRDs (kubeflow/trainer v1.9.4's PyTorchJob; kubeflow/trainer v2.3.0's TrainJob and
ClusterTrainingRuntime; kubernetes-sigs/jobset v0.12.0's JobSet) are mostly prose: field descriptions copied from
the Go types. That prose stays upstream; the repository keeps only what the API server and the contract tests act
on: structure, types, formats, enums, patterns, required fields, defaults, ``x-kubernetes-*`` markers and validation
rules (CEL ``rule`` and ``message``). The ``torch-distributed`` ClusterTrainingRuntime (kubeflow/trainer v2.3.0) has
no prose; its derivative is the same object without its comments. :data:`DERIVATIONS` lists them all; every one goes
through the same code path.

What is dropped, and why:

* ``description`` (and ``title``, ``externalDocs``, ``example``, none of which these files have) on every schema
  object and on printer columns: documentation, not validation.
* ``metadata.annotations`` of a CRD: upstream carries only ``controller-gen.kubebuilder.io/version``, which states
  how the upstream file was generated; on this file it would be false. The header comment records the provenance
  instead, and repeats the upstream file's licence notice where it has one (Apache-2.0 asks derivatives to keep it).
* ``status``: what an API server reported, not input.

A *property named* ``description`` (a key of ``properties``) is a field of the resource and is kept; the walk below
knows which mappings hold schemas and which hold field names, so it never confuses the two. An unknown key in a
schema object is an error rather than being copied or dropped silently: a new upstream must be looked at.

Usage (from the repository root)::

    python scripts/derive_crd.py                     # write every derivative under tests/crds/
    python scripts/derive_crd.py --check             # exit 1 and show the difference if a committed file is stale
    python scripts/derive_crd.py --only trainjob     # one of them (names: DERIVATIONS)
    python scripts/derive_crd.py --only pytorchjob PATH [--output PATH]

The upstream files are looked for under ``../shared/crds/`` relative to the repository root (override:
``TORCHELASTIC_UPSTREAM_CRDS_DIR``; the PyTorchJob file alone also by ``TORCHELASTIC_UPSTREAM_CRD_PATH``). Only the
standard library and PyYAML are used, so the script runs before the project's virtual environment exists.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import hashlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DERIVED_DIR = REPO_ROOT / "tests" / "crds"
UPSTREAM_DIR_ENV = "TORCHELASTIC_UPSTREAM_CRDS_DIR"
#: The PyTorchJob upstream file's own override (older than the directory one, kept for the setups that use it).
UPSTREAM_PATH_ENV = "TORCHELASTIC_UPSTREAM_CRD_PATH"

#: The licence notice at the top of kubeflow/trainer's files, which their derivatives repeat.
KUBEFLOW_NOTICE = """\
# Copyright The Kubeflow Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""


@dataclass(frozen=True, kw_only=True)
class Derivation:
    """One upstream file and its derivative. The header names one upstream release; a file with another digest is
    refused so the header cannot lie. Moving to a new release means changing ``ref`` and ``sha256``, regenerating
    and reviewing the diff."""

    #: What ``--only`` takes.
    name: str
    #: What the upstream file holds, for the header: "the PyTorchJob CRD".
    what: str
    #: Where the upstream file lies, relative to ``../shared/crds/``.
    upstream: str
    #: The upstream release and the file's path in its repository.
    ref: str
    upstream_file: str
    sha256: str
    #: The derivative's file name under ``tests/crds/``.
    derived: str
    #: The licence notice the upstream file opens with ("" for none); the derivative's header repeats it.
    notice: str = ""

    @property
    def derived_path(self) -> Path:
        return DERIVED_DIR / self.derived

    @property
    def header(self) -> str:
        change = (
            "Same schema with every description removed"
            if self.what.endswith(" CRD")
            else "Same object without its comments"
        )
        notice = f"# The upstream file's notice:\n{self.notice}" if self.notice else ""
        return (
            "# GENERATED FILE - DO NOT EDIT BY HAND. Regenerate with `make crd` (python scripts/derive_crd.py).\n"
            f"# Generated by scripts/derive_crd.py from {self.what} of {self.ref}\n"
            f"# ({self.upstream_file}, Apache-2.0,\n"
            f"# sha256 {self.sha256}).\n"
            f"# {change}; tests/contract/test_crd_derivative.py compares it with the\n"
            f"# upstream file whenever ../shared/crds/{self.upstream} is present.\n"
            f"{notice}"
        )

    def default_upstream_path(self) -> Path:
        configured = os.environ.get(UPSTREAM_PATH_ENV) if self.name == "pytorchjob" else None
        if configured:
            return Path(configured)
        base = os.environ.get(UPSTREAM_DIR_ENV)
        return (Path(base) if base else REPO_ROOT.parent / "shared" / "crds") / self.upstream


_TRAINER = "kubeflow/trainer v2.3.0"
DERIVATIONS: tuple[Derivation, ...] = (
    Derivation(
        name="pytorchjob",
        what="the PyTorchJob CRD",
        upstream="kubeflow.org_pytorchjobs.yaml",
        ref="kubeflow/trainer v1.9.4",
        upstream_file="manifests/base/crds/kubeflow.org_pytorchjobs.yaml",
        sha256="8b8a8a719cc94173169290251e817f7ac2bb425c20b6c2fa813397bcf4e932ed",
        derived="kubeflow.org_pytorchjobs.derived.yaml",
    ),
    Derivation(
        name="trainjob",
        what="the TrainJob CRD",
        upstream="trainer-v2.3.0/trainer.kubeflow.org_trainjobs.yaml",
        ref=_TRAINER,
        upstream_file="manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml",
        sha256="a742cafc5b5582640c7e0b7467c024fc237256fbca5ba0a9f0531dfb66d64416",
        derived="trainer.kubeflow.org_trainjobs.derived.yaml",
        notice=KUBEFLOW_NOTICE,
    ),
    Derivation(
        name="clustertrainingruntime",
        what="the ClusterTrainingRuntime CRD",
        upstream="trainer-v2.3.0/trainer.kubeflow.org_clustertrainingruntimes.yaml",
        ref=_TRAINER,
        upstream_file="manifests/base/crds/trainer.kubeflow.org_clustertrainingruntimes.yaml",
        sha256="ec84dc3388fcdbe8c61d3c247a773d14458dd9438e995bea8e50d2a18080eef9",
        derived="trainer.kubeflow.org_clustertrainingruntimes.derived.yaml",
        notice=KUBEFLOW_NOTICE,
    ),
    Derivation(
        name="jobset",
        what="the JobSet CRD",
        upstream="trainer-v2.3.0/jobset.x-k8s.io_jobsets.yaml",
        ref="kubernetes-sigs/jobset v0.12.0",
        upstream_file="config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml",
        sha256="d022b87624512cf0b6741b31b24a2bea9945b5a838b50713af29332c878bb6fe",
        derived="jobset.x-k8s.io_jobsets.derived.yaml",
    ),
    Derivation(
        name="torch-distributed",
        what="the torch-distributed ClusterTrainingRuntime",
        upstream="trainer-v2.3.0/torch_distributed.yaml",
        ref=_TRAINER,
        upstream_file="manifests/base/runtimes/torch_distributed.yaml",
        sha256="c4520df54615d481831d402e644dbeaf77a7a521eae87b2e80fd5f789aac5df2",
        derived="torch-distributed.runtime.derived.yaml",
        notice=KUBEFLOW_NOTICE,
    ),
)
BY_NAME: Mapping[str, Derivation] = {derivation.name: derivation for derivation in DERIVATIONS}
PYTORCHJOB = BY_NAME["pytorchjob"]
#: Where the PyTorchJob derivative lies (the local test cluster installs it).
DERIVED_PATH = PYTORCHJOB.derived_path

#: The objects other than CRDs that a derivation may hold: they carry no prose, only the comments dropped here.
_PLAIN_KINDS = frozenset({"ClusterTrainingRuntime"})

# apiextensions.k8s.io/v1 JSONSchemaProps, split by what the walk does with each key.
_DOCUMENTATION_KEYS = frozenset({"description", "title", "externalDocs", "example"})
_VALUE_KEYS = frozenset(
    {
        # Kept as they are: values, not schemas, so a "description" inside them is data.
        "type",
        "format",
        "default",
        "enum",
        "required",
        "pattern",
        "maximum",
        "minimum",
        "exclusiveMaximum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "maxItems",
        "minItems",
        "uniqueItems",
        "multipleOf",
        "maxProperties",
        "minProperties",
        "nullable",
        "id",
        "$schema",
        "$ref",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-embedded-resource",
        "x-kubernetes-int-or-string",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-list-type",
        "x-kubernetes-map-type",
        "x-kubernetes-validations",
    }
)
_SCHEMA_KEYS = frozenset({"items", "not", "additionalProperties", "additionalItems"})  # a schema (or bool / list)
_SCHEMA_LIST_KEYS = frozenset({"allOf", "anyOf", "oneOf"})
_SCHEMA_MAP_KEYS = frozenset({"properties", "patternProperties", "definitions", "dependencies"})  # name -> schema

# The fields of a CEL validation rule (x-kubernetes-validations items); none of them is documentation.
_VALIDATION_RULE_KEYS = frozenset({"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"})


class UnknownSchemaKey(ValueError):
    """The upstream schema uses a key this script does not classify; decide whether it is documentation."""


def derive_schema(schema: Any, where: str = "openAPIV3Schema") -> Any:
    """A JSONSchemaProps without its documentation; booleans and lists (``items``) pass through the same way."""
    if isinstance(schema, bool):
        return schema
    if isinstance(schema, list):
        return [derive_schema(item, f"{where}[{i}]") for i, item in enumerate(schema)]
    if not isinstance(schema, dict):
        raise UnknownSchemaKey(f"{where}: expected a schema object, got {type(schema).__name__}")
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DOCUMENTATION_KEYS:
            continue
        if key == "x-kubernetes-validations":
            out[key] = [_validation_rule(rule, f"{where}.{key}[{i}]") for i, rule in enumerate(value)]
        elif key in _VALUE_KEYS:
            out[key] = value
        elif key in _SCHEMA_KEYS:
            out[key] = derive_schema(value, f"{where}.{key}")
        elif key in _SCHEMA_LIST_KEYS:
            out[key] = [derive_schema(item, f"{where}.{key}[{i}]") for i, item in enumerate(value)]
        elif key in _SCHEMA_MAP_KEYS:
            # The keys here are field names (a property may well be called "description"); only values are schemas.
            # dependencies may map a name to a list of field names instead of a schema.
            out[key] = {
                name: sub if key == "dependencies" and isinstance(sub, list) else derive_schema(sub, f"{where}.{name}")
                for name, sub in value.items()
            }
        else:
            raise UnknownSchemaKey(
                f"{where}: unknown schema key {key!r}; classify it in scripts/derive_crd.py (documentation or not)"
            )
    return out


def _validation_rule(rule: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = set(rule) - _VALIDATION_RULE_KEYS
    if unknown:
        raise UnknownSchemaKey(f"{where}: unknown validation rule keys {sorted(unknown)}")
    return dict(rule)


def derive(upstream: Mapping[str, Any]) -> dict[str, Any]:
    """The description-free derivative of a parsed CustomResourceDefinition, or of one of :data:`_PLAIN_KINDS`
    (the input is not modified)."""
    if upstream.get("kind") in _PLAIN_KINDS:
        # No schema: a runtime object carries no documentation, only data. One that gains a description is looked at.
        found = [path for path in schema_annotations(upstream) if path.rsplit(".", 1)[-1] in _DOCUMENTATION_KEYS]
        if found:
            raise UnknownSchemaKey(f"{upstream.get('kind')}: documentation at {found}; decide what to keep")
        return copy.deepcopy(dict(upstream))
    if upstream.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"not a CustomResourceDefinition: kind={upstream.get('kind')!r}")
    doc: dict[str, Any] = {key: value for key, value in upstream.items() if key != "status"}
    doc["metadata"] = {key: value for key, value in upstream["metadata"].items() if key != "annotations"}
    spec = dict(upstream["spec"])
    versions = []
    for version in spec["versions"]:
        version = dict(version)
        if "schema" in version:
            version["schema"] = {
                **version["schema"],
                "openAPIV3Schema": derive_schema(version["schema"]["openAPIV3Schema"]),
            }
        if "additionalPrinterColumns" in version:
            version["additionalPrinterColumns"] = [
                {key: value for key, value in column.items() if key not in _DOCUMENTATION_KEYS}
                for column in version["additionalPrinterColumns"]
            ]
        versions.append(version)
    spec["versions"] = versions
    doc["spec"] = spec
    return copy.deepcopy(doc)  # shares nothing with the input, so neither can change the other


def schema_annotations(doc: Any, key: str = "description") -> list[str]:
    """Where ``key`` is used as an annotation (not as a field name) in a CRD: paths, empty when there is none."""
    found: list[str] = []

    def walk(node: Any, path: str, field_names: bool) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                if name == key and not field_names:
                    found.append(f"{path}.{name}")
                # Values under these keys are field-name -> schema maps; "default" and "enum" values are data.
                if not field_names and name in ("default", "enum", "example"):
                    continue
                walk(value, f"{path}.{name}", name in _SCHEMA_MAP_KEYS and not field_names)
        elif isinstance(node, list):
            for index, item in enumerate(node):
                walk(item, f"{path}[{index}]", False)

    walk(doc, "", False)
    return found


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        # A value that occurs twice is written twice: anchors would make the text depend on object identity.
        return True


def render(doc: Mapping[str, Any], derivation: Derivation = PYTORCHJOB) -> str:
    """The derivative as committed: header plus YAML with sorted keys, so the text depends only on the content."""
    # The pure-Python SafeDumper (not libyaml's) keeps the bytes independent of how PyYAML was built; a wide line
    # keeps long patterns and CEL rules on one line.
    body: str = yaml.dump(
        dict(doc),
        Dumper=_Dumper,
        default_flow_style=False,
        sort_keys=True,
        allow_unicode=False,
        width=1_000_000,
        explicit_start=True,
    )
    return derivation.header + body


def _load(text: str | bytes) -> Any:
    loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml parses the 640 KB upstream 10x faster
    return yaml.load(text, Loader=loader)


def derive_file(upstream_path: Path, derivation: Derivation = PYTORCHJOB) -> str:
    """The derivative's text for the upstream file at ``upstream_path``; refuses any file but the pinned release."""
    data = upstream_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != derivation.sha256:
        raise ValueError(
            f"{upstream_path} has sha256 {digest}, not that of {derivation.ref}'s {derivation.upstream_file} "
            f"({derivation.sha256}). For a new upstream release, update its Derivation in scripts/derive_crd.py "
            "(ref, sha256), regenerate and review."
        )
    if derivation.notice and not data.decode().startswith(derivation.notice):
        # The pinned digest makes this impossible; it guards an edit of the notice constant.
        raise ValueError(f"{upstream_path} does not open with the notice its derivative repeats")
    return render(derive(_load(data)), derivation)


def default_upstream_path(derivation: Derivation = PYTORCHJOB) -> Path:
    return derivation.default_upstream_path()


def _describe_difference(expected: str, actual: str, actual_name: str) -> str:
    diff = list(
        difflib.unified_diff(
            actual.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            fromfile=f"{actual_name} (committed)",
            tofile="derived from upstream",
            n=2,
        )
    )
    shown = "".join(diff[:80])
    more = f"... ({len(diff) - 80} more diff lines)\n" if len(diff) > 80 else ""
    return shown + more


def _one(derivation: Derivation, upstream: Path, output: Path, *, check: bool, out: Callable[[str], Any]) -> int:
    if not upstream.is_file():
        out(f"upstream file not found at {upstream} ({derivation.ref}, {derivation.upstream_file}); pass its path")
        return 2
    try:
        expected = derive_file(upstream, derivation)
    except ValueError as e:
        out(str(e))
        return 2
    if check:
        actual = output.read_text() if output.is_file() else ""
        if actual == expected:
            out(f"{output} is up to date with {upstream}")
            return 0
        if not actual:
            out(f"{output} is missing; run `make crd` (python scripts/derive_crd.py) to create it")
        else:
            out(
                f"{output} differs from what scripts/derive_crd.py derives from {upstream}; it must not be edited by "
                f"hand. Run `make crd` and commit the result.\n" + _describe_difference(expected, actual, str(output))
            )
        return 1
    output.parent.mkdir(parents=True, exist_ok=True)
    # Bytes, not text mode: the same newlines on every platform.
    output.write_bytes(expected.encode())
    out(f"wrote {output} ({len(expected.encode())} bytes) from {upstream}")
    return 0


def main(argv: list[str] | None = None, *, out: Callable[[str], Any] = print) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(BY_NAME), default=None, help="derive this one only (default: all)")
    parser.add_argument(
        "upstream",
        nargs="?",
        type=Path,
        default=None,
        help=f"upstream file, with --only (default: under ${UPSTREAM_DIR_ENV}, else ../shared/crds/)",
    )
    parser.add_argument("--output", type=Path, default=None, help="derivative to write or check, with --only")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a derivative differs")
    args = parser.parse_args(argv)
    if args.only is None and (args.upstream is not None or args.output is not None):
        parser.error("an upstream PATH or --output names one file: say which with --only NAME")
    selected = [BY_NAME[args.only]] if args.only else list(DERIVATIONS)
    status = 0
    for derivation in selected:
        upstream: Path = args.upstream or derivation.default_upstream_path()
        output: Path = args.output or derivation.derived_path
        status = max(status, _one(derivation, upstream, output, check=args.check, out=out))
    return status


if __name__ == "__main__":
    sys.exit(main())
