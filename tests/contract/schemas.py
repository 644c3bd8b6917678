"""The contracts a rendered object must meet, as executable checks.

* ``validate_pytorchjob``: the real PyTorchJob CRD's ``openAPIV3Schema`` (kubeflow/trainer v1.9.4), made strict the
  way the API server's ``fieldValidation=Strict`` is: unknown fields are rejected. The CRD is the repository's
  description-free derivative, ``tests/crds/kubeflow.org_pytorchjobs.derived.yaml`` (made by
  ``scripts/derive_crd.py``; ``test_crd_derivative.py`` keeps it equal to upstream); override:
  ``TORCHELASTIC_CRD_PATH``, e.g. the upstream file itself.
* ``check_webhook_rules``: the training operator's admission-webhook rules, which the CRD schema does not hold
  (``pkg/webhooks/pytorch/pytorchjob_webhook.go``; see ``../shared/notes/pytorchjob-controller.md``).
* ``validate_pod`` / ``validate_pod_template``: the Kubernetes Pod JSON schema, strict, from ``kubernetes-validate``,
  for the oldest and newest Kubernetes minor we claim (``KUBERNETES_VERSIONS``).
"""

from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml
from referencing import Registry, Resource

#: The oldest and newest Kubernetes minors the README claims (kubernetes-validate ships 1.25 to 1.37).
KUBERNETES_VERSIONS = ("1.25", "1.37")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CRD_PATH = REPO_ROOT / "tests" / "crds" / "kubeflow.org_pytorchjobs.derived.yaml"

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")


def crd_path() -> Path:
    return Path(os.environ.get("TORCHELASTIC_CRD_PATH", DEFAULT_CRD_PATH))


@functools.cache
def load_crd(path: Path | None = None) -> dict[str, Any]:
    path = path or crd_path()
    if not path.is_file():
        # Only an override can point nowhere: the default file is committed.
        raise FileNotFoundError(f"PyTorchJob CRD not found at {path} (TORCHELASTIC_CRD_PATH)")
    with path.open() as f:
        crd: dict[str, Any] = yaml.safe_load(f)
    return crd


def crd_to_jsonschema(schema: Any, *, strict: bool) -> Any:
    """An ``openAPIV3Schema`` as a Draft 4 JSON schema.

    * ``description``s are dropped (noise in error messages);
    * ``x-kubernetes-int-or-string`` becomes ``type: [integer, string]``; ``nullable`` adds ``null`` to the type;
    * strict: ``additionalProperties: false`` on every object with ``properties`` unless it keeps unknown fields
      (``x-kubernetes-preserve-unknown-fields``) or has its own ``additionalProperties``.
    """
    if isinstance(schema, list):
        return [crd_to_jsonschema(item, strict=strict) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: crd_to_jsonschema(sub, strict=strict) for name, sub in value.items()}
        else:
            out[key] = crd_to_jsonschema(value, strict=strict)
    if out.pop("x-kubernetes-int-or-string", False):
        out["type"] = ["integer", "string"]
    if out.pop("nullable", False) and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if (
        strict
        and "properties" in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def pytorchjob_schema(strict: bool = True) -> dict[str, Any]:
    return crd_jsonschema(load_crd(), strict=strict)


def crd_jsonschema(crd: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """The JSON schema ``validate_pytorchjob`` uses, for any parsed PyTorchJob CRD (the upstream one, a derivative)."""
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema: dict[str, Any] = crd_to_jsonschema(copy.deepcopy(version["schema"]["openAPIV3Schema"]), strict=strict)
    # ObjectMeta is validated by the API server itself, not by the CRD's schema.
    schema["properties"]["metadata"] = {"type": "object"}
    jsonschema.Draft4Validator.check_schema(schema)
    return schema


@functools.cache
def _pytorchjob_validator(strict: bool) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(pytorchjob_schema(strict))


def validate_pytorchjob(job: dict[str, Any], *, strict: bool = True) -> None:
    """Raise ``jsonschema.ValidationError`` if the CRD's schema rejects ``job``."""
    _pytorchjob_validator(strict).validate(job)


@functools.cache
def _core_v1_validator(kind: str, version: str) -> jsonschema.Draft202012Validator:
    """kubernetes-validate's strict schema for a core/v1 kind, loaded once.

    ``kubernetes_validate.validate`` re-reads its multi-megabyte definitions file on every call; this builds the same
    validator (same files, same draft, same reference registry) once per kind and version, which keeps the
    property-based tests fast. ``test_cached_validator_agrees_with_kubernetes_validate`` checks they agree.
    """
    if version not in kubernetes_validate.utils.all_versions() and f"{version}.0" not in (
        kubernetes_validate.utils.all_versions()
    ):
        raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {version}")
    folder = f"kubernetes-json-schema/v{version}.0-local-strict"
    schema = kubernetes_validate.utils.schema_contents(f"{folder}/{kind.lower()}-v1.json", version)
    definitions = kubernetes_validate.utils.schema_contents(f"{folder}/_definitions.json", version)
    registry: Registry[Any] = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_core_v1(obj: dict[str, Any], version: str) -> None:
    """Raise ``jsonschema.ValidationError`` if the strict schema of ``version`` rejects this core/v1 object."""
    if obj.get("apiVersion") != "v1":
        raise ValueError(f"not a core/v1 object: {obj.get('apiVersion')!r}")
    _core_v1_validator(obj["kind"], version).validate(obj)


def validate_pod(pod: dict[str, Any], version: str) -> None:
    """Raise ``jsonschema.ValidationError`` if the strict Pod schema of ``version`` rejects ``pod``."""
    validate_core_v1(pod, version)


def pod_template_as_object(template: dict[str, Any]) -> dict[str, Any]:
    """A ``PodTemplateSpec`` (``{metadata, spec}``) as the ``template`` of a v1 PodTemplate, which has a schema."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}


def validate_pod_template(template: dict[str, Any], version: str) -> None:
    validate_core_v1(pod_template_as_object(template), version)


def validate_secret(secret: dict[str, Any], version: str) -> None:
    validate_core_v1(secret, version)


class WebhookRejection(ValueError):
    """What the training operator's admission webhook would answer."""


def check_webhook_rules(job: dict[str, Any]) -> None:
    """The PyTorchJob admission webhook's rules (v1.9.4) that the CRD schema does not express; raise if one is broken.

    Also checks what the operator needs at runtime to build a working job: pod and Service names within 63 characters
    and a ``pytorchjob-port`` it can find (it would add the default one, so absence alone is fine).
    """
    name = job.get("metadata", {}).get("name", "")
    if not _DNS_1035.match(name) or len(name) > 63:
        raise WebhookRejection(f"metadata.name: {name!r} is not a DNS-1035 label")
    spec = job.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        raise WebhookRejection("spec.pytorchReplicaSpecs: must not be empty")
    for replica_type, replica in replicas.items():
        where = f"spec.pytorchReplicaSpecs.{replica_type}"
        if replica_type not in ("Master", "Worker"):
            raise WebhookRejection(f"{where}: replica type must be Master or Worker")
        containers = (replica.get("template") or {}).get("spec", {}).get("containers") or []
        if not containers:
            raise WebhookRejection(f"{where}: needs at least one container")
        for index, container in enumerate(containers):
            if not container.get("image"):
                raise WebhookRejection(f"{where}.template.spec.containers[{index}]: image is required")
        if not any(container.get("name") == "pytorch" for container in containers):
            raise WebhookRejection(f"{where}: needs a container named 'pytorch'")
        count = replica.get("replicas")
        if replica_type == "Master" and count != 1:
            raise WebhookRejection(f"{where}.replicas: must be explicitly 1, got {count!r}")
        if replica_type == "Worker" and count is not None and count < 1:
            raise WebhookRejection(f"{where}.replicas: must be >= 1, got {count!r}")
        # Pod and headless Service names: <job>-<type>-<index>, DNS-1035 labels.
        if count is not None:
            last = f"{name}-{replica_type.lower()}-{max(count - 1, 0)}"
            if len(last) > 63:
                raise WebhookRejection(f"{where}: pod name {last!r} is longer than 63 characters")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            raise WebhookRejection("spec.elasticPolicy: needs a Worker replica")
        if "nProcPerNode" in elastic and "nprocPerNode" in spec:
            raise WebhookRejection("spec.elasticPolicy.nProcPerNode: forbidden together with spec.nprocPerNode")
    managed_by = (spec.get("runPolicy") or {}).get("managedBy")
    if managed_by is not None and managed_by not in _MANAGED_BY:
        raise WebhookRejection(f"spec.runPolicy.managedBy: must be one of {_MANAGED_BY}, got {managed_by!r}")


def check_no_deprecated_fields(job: dict[str, Any]) -> None:
    """What the webhook only warns about: we never send it."""
    if "nProcPerNode" in (job.get("spec", {}).get("elasticPolicy") or {}):
        raise WebhookRejection("spec.elasticPolicy.nProcPerNode is deprecated; use spec.nprocPerNode")


def validate_rendered(manifests: list[dict[str, Any]]) -> None:
    """Every contract for one render: CRD + webhook for a PyTorchJob, the Pod schema for pods and templates."""
    for manifest in manifests:
        kind = manifest["kind"]
        for version in KUBERNETES_VERSIONS:
            if kind == "Secret":
                validate_secret(manifest, version)
            elif kind == "Pod":
                validate_pod(manifest, version)
            elif kind == "PyTorchJob":
                for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
                    validate_pod_template(replica["template"], version)
            else:
                raise AssertionError(f"unexpected kind {kind!r}")
        if kind == "PyTorchJob":
            validate_pytorchjob(manifest)
            check_webhook_rules(manifest)
            check_no_deprecated_fields(manifest)
